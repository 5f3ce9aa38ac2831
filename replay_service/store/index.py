"""The store's index: SQLite (WAL, synchronous=FULL) beside the segment files.

It answers "which rows of which segment hold request R" without scanning any
file, keeps per-request and per-run counters for summaries and listings, and
records the idempotency key `(run_id, writer_id, seq)` of every stored batch.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from replay_format import Flag

# Counted per request; GAP is derived on read, PADDING counts rows dropped at ingest.
COUNTED_FLAGS = (Flag.ZERO, Flag.DUPLICATE, Flag.OUT_OF_RANGE, Flag.STALE, Flag.CONFLICT, Flag.PADDING)
COUNT_COLUMNS = tuple(f"n_{f.name.lower()}" for f in COUNTED_FLAGS)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    num_layers INTEGER NOT NULL,
    top_k INTEGER NOT NULL,
    num_experts INTEGER NOT NULL,
    moe_layers TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    load BLOB
);
CREATE TABLE IF NOT EXISTS requests (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    rows INTEGER NOT NULL DEFAULT 0,
    pos_max INTEGER NOT NULL DEFAULT -1,
    final_tokens INTEGER,
    status TEXT NOT NULL DEFAULT 'open',
    flag_bits INTEGER NOT NULL DEFAULT 0,
    first_flagged INTEGER,
    {", ".join(f"{c} INTEGER NOT NULL DEFAULT 0" for c in COUNT_COLUMNS)},
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS segments (
    segment_id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    writer_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    path TEXT NOT NULL,
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    digest TEXT NOT NULL,
    UNIQUE (run_id, writer_id, seq)
);
CREATE TABLE IF NOT EXISTS spans (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    segment_id INTEGER NOT NULL,
    row_start INTEGER NOT NULL,
    row_count INTEGER NOT NULL,
    pos_min INTEGER NOT NULL,
    pos_max INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS spans_by_request ON spans (run_id, request_id, pos_min);
CREATE TABLE IF NOT EXISTS row_flags (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    flags INTEGER NOT NULL,
    PRIMARY KEY (run_id, request_id, position)
);
"""


class Index:
    """Thin, thread-safe wrapper: one connection, one lock, short transactions."""

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'OFF'}")
        self.conn.executescript(SCHEMA)
        self.lock = threading.RLock()

    def query(self, sql: str, params: tuple | list = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self.conn.execute(sql, params).fetchall()

    def one(self, sql: str, params: tuple | list = ()) -> sqlite3.Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def transaction(self) -> "_Transaction":
        return _Transaction(self)

    def indexed_paths(self) -> set[str]:
        return {row["path"] for row in self.query("SELECT path FROM segments")}

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class _Transaction:
    def __init__(self, index: Index) -> None:
        self.index = index

    def __enter__(self) -> sqlite3.Connection:
        self.index.lock.acquire()
        self.index.conn.execute("BEGIN IMMEDIATE")
        return self.index.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.index.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.index.lock.release()


def moe_layers_json(layers: tuple[int, ...]) -> str:
    return json.dumps(list(layers))
