"""Stored comparison results: the JSON answer in the index's `compares` table, per-token mismatch bits in a file.

Contract: `save` writes the file durably (`<data>/compares/<run_id>/<compare_id>.npz`, replay_format/compare.md; with
a bucket the object `<run_id>/compares/<compare_id>.npz`) before the index row naming it commits; `list`, `get` and
`request_mismatch` read them back. A deleted run's rows go in its delete transaction (`delete_rows`), its bucket
objects after it (`delete_objects`).
Design: docs/design/store.md ("Stored comparisons").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from replay_format.compare import CompareFileMeta, RequestMismatch, encode_compare_file, read_compare_file
from replay_format.core import UndecodableError
from replay_service.errors import NotFound
from replay_service.store.index import Index, IndexTransaction
from replay_service.store.index.backends import Dialect
from replay_service.store.segments.durable import write_file
from replay_service.store.segments.places import Freed, S3Segments


def schema(d: Dialect) -> str:
    """The `compares` table in a backend's dialect (PostgreSQL has no rowid: `added` keeps insertion order)."""
    added = "" if d.name == "sqlite" else f",\n    added {d.serial_key.replace(' PRIMARY KEY', ' UNIQUE')}"
    return f"""
CREATE TABLE IF NOT EXISTS compares (
    compare_id {d.text} PRIMARY KEY,
    run_id {d.text} NOT NULL,
    created_at {d.real} NOT NULL,
    path {d.text} NOT NULL,
    requests {d.text} NOT NULL,
    doc {d.text} NOT NULL{added}
);
CREATE INDEX IF NOT EXISTS compares_by_run ON compares (run_id, created_at);
"""


def list_by_run(d: Dialect) -> str:
    """A run's comparisons, newest first (the later inserted first among equal times)."""
    added = "rowid" if d.name == "sqlite" else "added"
    return f"SELECT doc FROM compares WHERE run_id = ? ORDER BY created_at DESC, {added} DESC"


INSERT = "INSERT INTO compares (compare_id, run_id, created_at, path, requests, doc) VALUES (?, ?, ?, ?, ?, ?)"
ONE = "SELECT * FROM compares WHERE run_id = ? AND compare_id = ?"
DELETE_BY_RUN = "DELETE FROM compares WHERE run_id = ?"


class CompareNotFound(NotFound):
    """A stored comparison (or a request in it) that does not exist."""


class CompareStore:
    """Comparisons of one data directory: files under `root`, answers in the index's `compares` table."""

    def __init__(self, root: Path, index: Index, fsync: bool = True, bucket: S3Segments | None = None) -> None:
        self.root = Path(root)
        self.index = index
        self.fsync = fsync
        self.bucket = bucket  # where the files go when segments are objects (module docstring)
        index.backend.script(schema(index.backend.dialect))
        self._list_by_run = list_by_run(index.backend.dialect)

    def save(self, doc: dict, per_request: Sequence[RequestMismatch]) -> None:
        """Store one comparison: its file first (durably), then the index row naming it."""
        names = [item.request_id for item in per_request]
        meta = CompareFileMeta(doc["run_id"], doc["compare_id"], len(doc["per_layer"]), tuple(names))
        data = encode_compare_file(meta, per_request)
        if self.bucket is not None:
            rel = f"{doc['run_id']}/compares/{doc['compare_id']}.npz"
            self.bucket.put(rel, data)
        else:
            rel = f"{doc['run_id']}/{doc['compare_id']}.npz"
            write_file(self.root / rel, data, fsync=self.fsync)
        with self.index.transaction() as tx:
            tx.execute(INSERT, (doc["compare_id"], doc["run_id"], doc["created_at"], rel, json.dumps(names),
                                json.dumps(doc)))

    def delete_rows(self, tx: IndexTransaction, run_id: str) -> int:
        """Delete a run's comparison rows inside `tx` (retention.py removes their files after it commits)."""
        return tx.execute(DELETE_BY_RUN, (run_id,)).rowcount

    def delete_objects(self, run_id: str) -> Freed:
        """Delete a run's comparison objects from the bucket (after its rows' commit); what that freed.

        Local files go to the trash with the run's folders instead (retention.py): nothing here.
        """
        if self.bucket is None:
            return Freed()
        objects = self.bucket.other_objects(f"{run_id}/compares/", ".npz")
        for obj in objects:
            self.bucket.delete(obj.path)
        return Freed.of(objects)

    def list(self, run_id: str) -> list[dict]:
        """The stored answers of a run's comparisons, newest first."""
        return [json.loads(r["doc"]) for r in self.index.query(self._list_by_run, (run_id,))]

    def _row(self, run_id: str, compare_id: str):
        row = self.index.one(ONE, (run_id, compare_id))
        if row is None:
            raise CompareNotFound(f"comparison {compare_id!r} not found in run {run_id!r}")
        return row

    def get(self, run_id: str, compare_id: str) -> dict:
        """One stored answer; CompareNotFound when there is none."""
        return json.loads(self._row(run_id, compare_id)["doc"])

    def request_mismatch(self, run_id: str, compare_id: str, request_id: str) -> RequestMismatch:
        """One request's positions and `(n, num_moe_layers)` mismatch bits in a stored comparison."""
        row = self._row(run_id, compare_id)
        names = tuple(json.loads(row["requests"]))
        if request_id not in names:
            raise CompareNotFound(f"comparison {compare_id!r} holds no rows of request {request_id!r}")
        # What the index knows: all a file written before the format had a version can be read with.
        known = CompareFileMeta(run_id, compare_id, len(json.loads(row["doc"])["per_layer"]), names)
        if self.bucket is None:
            return read_compare_file(self.root / row["path"], request_id, known)
        try:
            data = self.bucket.read_bytes(row["path"])
        except FileNotFoundError:
            raise UndecodableError(f"stored comparison {compare_id!r}: its file {row['path']} is missing from "
                                   f"{self.bucket.url}") from None
        return read_compare_file(data, request_id, known)
