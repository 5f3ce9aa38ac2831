"""Stored comparison results: the JSON answer in the index, per-token mismatch bits in a file.

`<data>/compares/<run_id>/<compare_id>.npz` holds, per compared request, its
positions and an `(n, L)` bit-packed mismatch matrix; it is written to `.tmp`,
fsynced and renamed before the index row commits (as segments are). Kept
outside `runs/` so the segment sweep never sees it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from replay_service.errors import NotFound
from replay_service.store.files import fsync_dir
from replay_service.store.index import Index

SCHEMA = """
CREATE TABLE IF NOT EXISTS compares (
    compare_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    path TEXT NOT NULL,
    requests TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS compares_by_run ON compares (run_id, created_at);
"""


class CompareNotFound(NotFound):
    """A stored comparison (or a request in it) that does not exist."""


class CompareStore:
    def __init__(self, root: Path, index: Index, fsync: bool = True) -> None:
        self.root = Path(root)
        self.index = index
        self.fsync = fsync
        with index.lock:
            index.conn.executescript(SCHEMA)

    def save(self, doc: dict, per_request: list) -> None:
        """`per_request`: objects with request_id, positions (n,), mismatch (n, L) bool."""
        rel = f"{doc['run_id']}/{doc['compare_id']}.npz"
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {}
        names = []
        for i, item in enumerate(per_request):
            names.append(item.request_id)
            arrays[f"p{i}"] = item.positions
            arrays[f"m{i}"] = np.packbits(item.mismatch, axis=1)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(buf.getbuffer())
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if self.fsync:
            fsync_dir(path.parent)
        with self.index.transaction() as tx:
            tx.execute(
                "INSERT INTO compares (compare_id, run_id, created_at, path, requests, doc) VALUES (?, ?, ?, ?, ?, ?)",
                (doc["compare_id"], doc["run_id"], doc["created_at"], rel, json.dumps(names), json.dumps(doc)),
            )

    def list(self, run_id: str) -> list[dict]:
        rows = self.index.query(
            "SELECT doc FROM compares WHERE run_id = ? ORDER BY created_at DESC, rowid DESC", (run_id,)
        )
        return [json.loads(r["doc"]) for r in rows]

    def _row(self, run_id: str, compare_id: str):
        row = self.index.one("SELECT * FROM compares WHERE run_id = ? AND compare_id = ?", (run_id, compare_id))
        if row is None:
            raise CompareNotFound(f"comparison {compare_id!r} not found in run {run_id!r}")
        return row

    def get(self, run_id: str, compare_id: str) -> dict:
        return json.loads(self._row(run_id, compare_id)["doc"])

    def request_mismatch(self, run_id: str, compare_id: str, request_id: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(positions (n,), mismatch (n, L) uint8, L) for one request of a stored comparison."""
        row = self._row(run_id, compare_id)
        names = json.loads(row["requests"])
        if request_id not in names:
            raise CompareNotFound(f"comparison {compare_id!r} holds no rows of request {request_id!r}")
        i = names.index(request_id)
        num_layers = len(json.loads(row["doc"])["per_layer"])
        with np.load(self.root / row["path"]) as data:
            positions = data[f"p{i}"]
            bits = np.unpackbits(data[f"m{i}"], axis=1, count=num_layers)
        return positions, bits, num_layers
