"""What run health reads from the index: its own tables, and sums over a scope of a run's requests.

    health_ticks        per run and ingest-time bucket: served rows, rows per content flag, expert load of clean rows
    version_load        per run and weight version: expert load of clean rows
    health_thresholds   per run: the checks' limits it overrides (a JSON object, replay_service/health/rules.py)

Contract: the commit stage adds each batch to the first two in its transaction (`add_batch`); a scope is a run's
requests (all, those written since a time, or a named batch) and `ScopeTotals` are its sums.
Design: docs/design/store.md ("Run health tables").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from replay_format import Flag, RunShape
from replay_service.store.index import (
    COUNTED_FLAGS,
    EXPECTED_ROWS,
    Index,
    IndexTransaction,
    RequestStatus,
    Row,
    count_column,
    load_of,
)
from replay_service.store.index.backends import Dialect

# The content flags an ingest-time bucket counts (PADDING rows are dropped, never served; GAP is not a row).
TICK_FLAGS = (Flag.ZERO, Flag.STALE, Flag.OUT_OF_RANGE, Flag.DUPLICATE, Flag.CONFLICT)
TICK_COLUMNS = tuple(count_column(f) for f in TICK_FLAGS)


def schema(d: Dialect) -> str:
    """The run-health tables in a backend's dialect."""
    counts = ",\n    ".join(f"{c} {d.integer} NOT NULL DEFAULT 0" for c in TICK_COLUMNS)
    return f"""
CREATE TABLE IF NOT EXISTS health_ticks (
    run_id {d.text} NOT NULL,
    bucket {d.real} NOT NULL,
    rows {d.integer} NOT NULL DEFAULT 0,
    {counts},
    load {d.blob},
    PRIMARY KEY (run_id, bucket)
){d.without_rowid};
CREATE TABLE IF NOT EXISTS version_load (
    run_id {d.text} NOT NULL,
    version {d.text} NOT NULL,
    load {d.blob},
    PRIMARY KEY (run_id, version)
){d.without_rowid};
CREATE TABLE IF NOT EXISTS health_thresholds (
    run_id {d.text} PRIMARY KEY,
    doc {d.text} NOT NULL
);
"""


@dataclass(frozen=True)
class Tick:
    """One ingest-time bucket of a run: served rows, rows per content flag, clean rows' expert load `(L, E)`."""

    t: float  # the bucket's start, Unix seconds
    rows: int
    flagged: Mapping[Flag, int]
    load: np.ndarray


@dataclass(frozen=True)
class ScopeTotals:
    """Sums over a scope of a run's requests (`HealthTables.totals`)."""

    requests: int
    ended: int
    rows: int  # rows served
    expected: int  # rows the requests should have
    gap: int  # rows expected, never received
    flagged: Mapping[Flag, int]  # rows per counted flag (PADDING: writer padding dropped)
    unclean: int  # rows served with any flag (a row counted once, however many flags it has; for a request stored
    # before schema 7, the most rows of one flag: a lower bound)
    recomputed: int
    references: int  # prefix-cache references of the scope's requests
    unresolved: int  # of which the source's rows do not reach the reference's end

    @property
    def open(self) -> int:
        """Requests not ended."""
        return self.requests - self.ended


@dataclass(frozen=True)
class RecentTotals:
    """A run's sums over the requests it wrote since a time (`HealthTables.recent`), and its last write."""

    run_id: str
    last_write: float | None
    totals: ScopeTotals


class HealthTables:
    """The run-health tables of one index, and the scope sums health reads (module docstring)."""

    def __init__(self, index: Index) -> None:
        self.index = index
        d = index.backend.dialect
        index.backend.script(schema(d))
        self._d = d
        integer = d.integer

        def total(expr: str) -> str:
            return f"CAST(COALESCE(SUM({expr}), 0) AS {integer})"

        ended = f"CASE WHEN status != '{RequestStatus.OPEN}' THEN 1 ELSE 0 END"
        # Rows served with any flag: `unclean`, or at least the most of one kind (a request stored before the
        # index counted `unclean`, schema 6 and older, has only its counts per flag).
        unclean = "unclean"
        for f in COUNTED_FLAGS:
            if f is not Flag.PADDING:
                unclean = f"{d.greatest}({unclean}, {count_column(f)})"
        self._unclean = unclean
        self._sums = (
            f"COUNT(*) AS requests, {total('rows')} AS rows, {total(ended)} AS ended,"
            f" {total(EXPECTED_ROWS)} AS expected, {total(f'{d.greatest}({EXPECTED_ROWS} - rows, 0)')} AS gap,"
            f" {total('recomputed')} AS recomputed, {total(unclean)} AS unclean, "
            + ", ".join(f"{total(c)} AS {c}" for c in (count_column(f) for f in COUNTED_FLAGS))
        )
        self._refs = (
            "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(CASE WHEN s.request_id IS NULL OR s.pos_max < p.pos_end - 1"
            f" THEN 1 ELSE 0 END), 0) AS {integer}) AS unresolved FROM prefix_refs p"
            " LEFT JOIN requests s ON s.run_id = p.run_id AND s.request_id = p.source_request_id"
            " WHERE p.run_id = ?"
        )

    # ---- written by the commit stage (its transaction, the run's lock held)

    def add_batch(self, tx: IndexTransaction, run_id: str, shape: RunShape, bucket: float, rows: int,
                  flagged: Mapping[Flag, int], load: np.ndarray, version_loads: Mapping[str, np.ndarray]) -> None:
        """Count a batch's served rows in its ingest-time bucket and its clean rows' load per weight version."""
        row = tx.execute("SELECT load FROM health_ticks WHERE run_id = ? AND bucket = ?", (run_id, bucket)).fetchone()
        total = load.astype(np.int64) + (load_of(row["load"], shape) if row is not None else 0)
        columns = ", ".join(TICK_COLUMNS)
        marks = ", ".join("?" for _ in TICK_COLUMNS)
        adds = ", ".join(f"{c} = health_ticks.{c} + excluded.{c}" for c in TICK_COLUMNS)
        tx.execute(
            f"INSERT INTO health_ticks (run_id, bucket, rows, {columns}, load) VALUES (?, ?, ?, {marks}, ?)"
            f" ON CONFLICT (run_id, bucket) DO UPDATE SET rows = health_ticks.rows + excluded.rows, {adds},"
            " load = excluded.load",
            (run_id, bucket, rows, *(int(flagged.get(f, 0)) for f in TICK_FLAGS), total.tobytes()))
        for version, vload in sorted(version_loads.items()):
            got = tx.execute("SELECT load FROM version_load WHERE run_id = ? AND version = ?",
                             (run_id, version)).fetchone()
            vtotal = vload.astype(np.int64) + (load_of(got["load"], shape) if got is not None else 0)
            tx.execute("INSERT INTO version_load (run_id, version, load) VALUES (?, ?, ?)"
                       " ON CONFLICT (run_id, version) DO UPDATE SET load = excluded.load",
                       (run_id, version, vtotal.tobytes()))

    def delete_rows(self, tx: IndexTransaction, run_id: str) -> int:
        """Delete a run's health rows inside `tx` (retention.py, with the run's other rows)."""
        return sum(tx.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,)).rowcount
                   for table in ("health_ticks", "version_load", "health_thresholds"))

    # ---- thresholds a run overrides

    def overrides(self, run_id: str) -> dict:
        """The limits a run overrides (a JSON object of check name to `{"warn", "fail"}`), {} when none."""
        row = self.index.one("SELECT doc FROM health_thresholds WHERE run_id = ?", (run_id,))
        return json.loads(row["doc"]) if row is not None else {}

    def set_overrides(self, run_id: str, doc: dict) -> None:
        """Store a run's overrides (replacing the ones before); an empty object drops them."""
        with self.index.transaction() as tx:
            tx.execute("DELETE FROM health_thresholds WHERE run_id = ?", (run_id,))
            if doc:
                tx.execute("INSERT INTO health_thresholds (run_id, doc) VALUES (?, ?)", (run_id, json.dumps(doc)))

    # ---- reads

    def ticks(self, run_id: str, shape: RunShape) -> list[Tick]:
        """A run's ingest-time buckets, by time."""
        rows = self.index.query("SELECT * FROM health_ticks WHERE run_id = ? ORDER BY bucket", (run_id,))
        return [Tick(float(r["bucket"]), int(r["rows"]), {f: int(r[count_column(f)]) for f in TICK_FLAGS},
                     load_of(r["load"], shape)) for r in rows]

    def version_loads(self, run_id: str, shape: RunShape) -> dict[str, np.ndarray]:
        """A run's clean rows' expert load per weight version."""
        rows = self.index.query("SELECT version, load FROM version_load WHERE run_id = ?", (run_id,))
        return {r["version"]: load_of(r["load"], shape) for r in rows}

    def totals(self, run_id: str, request_ids: Sequence[str] | None = None, since: float | None = None) -> ScopeTotals:
        """Sums over the run's requests: all, those named, or those written at or after `since`."""
        where, params = self._scope(run_id, request_ids, since)
        row = self.index.one(f"SELECT {self._sums} FROM requests WHERE {where}", params)
        assert row is not None
        refs_sql, refs_params = self._refs, [run_id]
        if request_ids is not None or since is not None:
            sub, sub_params = self._scope(run_id, request_ids, since)
            refs_sql += f" AND p.request_id IN (SELECT request_id FROM requests WHERE {sub})"
            refs_params += sub_params
        refs = self.index.one(refs_sql, tuple(refs_params))
        assert refs is not None
        return _totals(row, int(refs["n"]), int(refs["unresolved"]))

    def recent(self, since: float) -> list[RecentTotals]:
        """Every run's sums over the requests it wrote at or after `since`, newest last write first (then by id)."""
        rows = self.index.query(
            f"SELECT run_id, {self._sums} FROM requests WHERE last_write >= ? GROUP BY run_id", (since,))
        by_run = {r["run_id"]: r for r in rows}
        out = []
        for run in self.index.query("SELECT run_id, last_write FROM runs"):  # not runs' load blobs
            row = by_run.get(run["run_id"])
            totals = _totals(row, 0, 0) if row is not None else _empty()
            out.append(RecentTotals(run["run_id"], run["last_write"], totals))
        out.sort(key=lambda r: (-(r.last_write or 0.0), r.run_id))
        return out

    def kind_requests(self, run_id: str, flag: Flag | None, request_ids: Sequence[str] | None, since: float | None,
                      limit: int) -> list[Row]:
        """Up to `limit` `requests` rows of the scope holding rows of `flag` (GAP: rows expected, never received;
        None: any flagged or missing row, what a trainer slice fills), by id."""
        if flag is None:
            count = f"{self._unclean} + {self._d.greatest}({EXPECTED_ROWS} - rows, 0)"
        else:
            count = f"{EXPECTED_ROWS} - rows" if flag == Flag.GAP else count_column(flag)
        where, params = self._scope(run_id, request_ids, since)
        return self.index.query(f"SELECT * FROM requests WHERE {where} AND {count} > 0 ORDER BY request_id LIMIT ?",
                                (*params, limit))

    def open_requests(self, run_id: str, request_ids: Sequence[str] | None, since: float | None,
                      limit: int) -> list[str]:
        """Up to `limit` request ids of the scope not ended, by id."""
        where, params = self._scope(run_id, request_ids, since)
        rows = self.index.query(f"SELECT request_id FROM requests WHERE {where} AND status = ?"
                                " ORDER BY request_id LIMIT ?", (*params, str(RequestStatus.OPEN), limit))
        return [r["request_id"] for r in rows]

    def known(self, run_id: str, request_ids: Sequence[str]) -> set[str]:
        """Which of `request_ids` the run holds."""
        rows = self.index.query(f"SELECT request_id FROM requests WHERE run_id = ? AND request_id IN"
                                f" ({self._d.json_texts})", (run_id, json.dumps(list(request_ids))))
        return {r["request_id"] for r in rows}

    def versions(self, run_id: str, request_ids: Sequence[str] | None, since: float | None) -> dict[str, int]:
        """Served rows per weight version over the scope (`version_spans`)."""
        if request_ids is None and since is None:
            rows = self.index.query("SELECT version, rows FROM run_versions WHERE run_id = ?", (run_id,))
            return {r["version"]: int(r["rows"]) for r in rows}
        where, params = self._scope(run_id, request_ids, since)
        rows = self.index.query(
            f"SELECT version, CAST(SUM(pos_end - pos_start) AS {self._d.integer}) AS n FROM version_spans"
            f" WHERE run_id = ? AND request_id IN (SELECT request_id FROM requests WHERE {where}) GROUP BY version",
            (run_id, *params))
        return {r["version"]: int(r["n"]) for r in rows}

    def _scope(self, run_id: str, request_ids: Sequence[str] | None, since: float | None) -> tuple[str, tuple]:
        where = "run_id = ?"
        params: list[object] = [run_id]
        if request_ids is not None:
            where += f" AND request_id IN ({self._d.json_texts})"
            params.append(json.dumps(list(request_ids)))
        if since is not None:
            where += " AND last_write >= ?"
            params.append(since)
        return where, tuple(params)


def _totals(row, references: int, unresolved: int) -> ScopeTotals:  # noqa: ANN001 - an index row
    flagged = {f: int(row[count_column(f)]) for f in COUNTED_FLAGS}
    return ScopeTotals(int(row["requests"]), int(row["ended"]), int(row["rows"]), int(row["expected"]),
                       int(row["gap"]), flagged, int(row["unclean"]), int(row["recomputed"]), references, unresolved)


def _empty() -> ScopeTotals:
    return ScopeTotals(0, 0, 0, 0, 0, {f: 0 for f in COUNTED_FLAGS}, 0, 0, 0, 0)
