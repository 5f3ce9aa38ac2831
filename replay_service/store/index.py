"""The store's index: SQLite (WAL, synchronous=FULL) beside the segment files. All of the store's SQL is here.

It answers "which rows of which segment hold request R" without scanning any file, keeps
per-request and per-run counters for summaries and listings, records the idempotency key
`(run_id, writer_id, seq)` of every stored batch, and keeps prefix-cache references (`prefix_refs`:
request R's positions `[start, end)` are the rows request S stored there; `references.py` resolves
them into spans of R that point at S's segment rows, so rows are stored once). Every statement is a
module constant; callers use the typed methods of `Index` (reads) and `IndexTransaction` (writes),
never SQL text. (Over 400 lines on purpose: every statement of the store is in this one file, beside the
typed method that runs it, so the whole schema and its queries read in one place.)
"""

from __future__ import annotations

import enum
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from replay_format import Flag, RunShape


class RequestStatus(enum.StrEnum):
    """A request's state in the `requests` table (and the finish body's `status`)."""

    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


# Counted per request; GAP is derived on read, PADDING counts rows dropped at ingest.
COUNTED_FLAGS = (Flag.ZERO, Flag.DUPLICATE, Flag.OUT_OF_RANGE, Flag.STALE, Flag.CONFLICT, Flag.PADDING)


def count_column(flag: Flag) -> str:
    """The `requests` column counting rows with `flag`."""
    return f"n_{str(flag.name).lower()}"


COUNT_COLUMNS = tuple(count_column(f) for f in COUNTED_FLAGS)

# A span's id is the order a request came to hold its rows: among rows at one position, the first held is
# served. For a request's own rows that is segment order; a span mirrored from a reference's source
# (references.py) is held from when it was inserted, so a request's own earlier rows keep winning.
SPANS_COLUMNS = """
    span_id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    segment_id INTEGER NOT NULL,
    row_start INTEGER NOT NULL,
    row_count INTEGER NOT NULL,
    pos_min INTEGER NOT NULL,
    pos_max INTEGER NOT NULL
"""
SPAN_FIELDS = "run_id, request_id, segment_id, row_start, row_count, pos_min, pos_max"

# A segment is indexed only while its run exists: a batch whose run was deleted while it was being written
# (retention.py) is refused at commit with this message, never left as rows of no run.
RUN_DELETED = "run deleted while this batch was stored"
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    num_moe_layers INTEGER NOT NULL,
    top_k INTEGER NOT NULL,
    num_experts INTEGER NOT NULL,
    moe_layers TEXT NOT NULL,
    num_hidden_layers INTEGER NOT NULL DEFAULT 0,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    load BLOB,
    pinned INTEGER NOT NULL DEFAULT 0,
    last_write REAL
);
CREATE TABLE IF NOT EXISTS requests (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    rows INTEGER NOT NULL DEFAULT 0,
    pos_max INTEGER NOT NULL DEFAULT -1,
    final_tokens INTEGER,
    status TEXT NOT NULL DEFAULT '{RequestStatus.OPEN}',
    flag_bits INTEGER NOT NULL DEFAULT 0,
    first_flagged INTEGER,
    {", ".join(f"{c} INTEGER NOT NULL DEFAULT 0" for c in COUNT_COLUMNS)},
    referenced_rows INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
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
CREATE TABLE IF NOT EXISTS spans ({SPANS_COLUMNS});
CREATE INDEX IF NOT EXISTS spans_by_request ON spans (run_id, request_id, pos_min);
CREATE TABLE IF NOT EXISTS row_flags (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    flags INTEGER NOT NULL,
    PRIMARY KEY (run_id, request_id, position)
);
CREATE TABLE IF NOT EXISTS prefix_refs (
    run_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    pos_start INTEGER NOT NULL,
    pos_end INTEGER NOT NULL,
    source_request_id TEXT NOT NULL,
    PRIMARY KEY (run_id, request_id, pos_start, pos_end, source_request_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS prefix_refs_by_source ON prefix_refs (run_id, source_request_id, pos_start);
CREATE TRIGGER IF NOT EXISTS segments_of_a_run BEFORE INSERT ON segments
    WHEN NOT EXISTS (SELECT 1 FROM runs WHERE run_id = NEW.run_id)
    BEGIN SELECT RAISE(ABORT, '{RUN_DELETED}'); END;
"""
# Index files are brought up to date on open: user_version 0 named num_moe_layers num_layers (renamed);
# before 2, runs had no num_hidden_layers (added as 0: unknown, read as max(moe_layers) + 1); before 3,
# spans had no span_id (rebuilt in segment order, which is the order their rows were served in) and
# requests no referenced_rows (0: nothing was referenced); prefix_refs is new (created by SCHEMA).
# Before 4, runs had no pinned (0: retention may delete it) nor last_write (NULL: read as created_at).
# Before 5, requests had no owner (NULL: not owned; the next authenticated writer claims it, ownership.py).
SCHEMA_VERSION = 5
TABLE_COLUMNS = "SELECT name FROM pragma_table_info(?)"
RENAME_NUM_LAYERS = "ALTER TABLE runs RENAME COLUMN num_layers TO num_moe_layers"
ADD_NUM_HIDDEN_LAYERS = "ALTER TABLE runs ADD COLUMN num_hidden_layers INTEGER NOT NULL DEFAULT 0"
ADD_REFERENCED_ROWS = "ALTER TABLE requests ADD COLUMN referenced_rows INTEGER NOT NULL DEFAULT 0"
ADD_OWNER = "ALTER TABLE requests ADD COLUMN owner TEXT"
REBUILD_SPANS = (
    f"CREATE TABLE spans_v3 ({SPANS_COLUMNS})",
    f"INSERT INTO spans_v3 ({SPAN_FIELDS}) SELECT {SPAN_FIELDS} FROM spans ORDER BY segment_id, rowid",
    "DROP TABLE spans",  # drops spans_by_request too; SCHEMA creates it again
    "ALTER TABLE spans_v3 RENAME TO spans",
)
ADD_PINNED = "ALTER TABLE runs ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0"
ADD_LAST_WRITE = "ALTER TABLE runs ADD COLUMN last_write REAL"
GET_SCHEMA_VERSION = "PRAGMA user_version"
# One batch of a group commit (ingest/commit.py): undone alone when it fails, the group's others kept.
SAVEPOINT = "SAVEPOINT batch"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO batch"
RELEASE_SAVEPOINT = "RELEASE batch"
SET_SCHEMA_VERSION = f"PRAGMA user_version = {SCHEMA_VERSION}"

# Rows a request should have: T-1 once finished with T tokens, else up to the last position seen.
EXPECTED_ROWS = "COALESCE(final_tokens - 1, pos_max + 1)"

# ---- runs
INSERT_RUN = (
    "INSERT INTO runs (run_id, num_moe_layers, top_k, num_experts, moe_layers, num_hidden_layers, source, created_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
SET_NUM_HIDDEN_LAYERS = "UPDATE runs SET num_hidden_layers = ? WHERE run_id = ?"
SET_CREATED_AT = "UPDATE runs SET created_at = ? WHERE run_id = ?"  # reindex restores a run's creation time
SELECT_RUN = "SELECT * FROM runs WHERE run_id = ?"
SELECT_RUNS = "SELECT * FROM runs ORDER BY run_id"
COUNT_RUNS = "SELECT COUNT(*) AS n FROM runs"
# last_write: Unix time of the run's last stored segment (retention's age of a run still being written).
ADD_RUN_TOTALS = (
    "UPDATE runs SET bytes = bytes + ?, load = ?, last_write = MAX(COALESCE(last_write, 0), ?) WHERE run_id = ?"
)
SET_PINNED = "UPDATE runs SET pinned = ? WHERE run_id = ?"
# ---- deleting a run (retention.py): every table holding its rows, in one transaction
DELETE_RUN_ROWS = tuple(f"DELETE FROM {table} WHERE run_id = ?"
                        for table in ("spans", "row_flags", "prefix_refs", "requests", "segments", "runs"))
RUN_AGGREGATE = (
    "SELECT COUNT(*) AS requests, COALESCE(SUM(rows), 0) AS rows,"
    f" COALESCE(SUM(status != '{RequestStatus.OPEN}'), 0) AS ended,"
    f" COALESCE(SUM(MAX({EXPECTED_ROWS} - rows, 0)), 0) AS gap,"
    " COALESCE(SUM(referenced_rows), 0) AS referenced_rows, "
    + ", ".join(f"COALESCE(SUM({c}), 0) AS {c}" for c in COUNT_COLUMNS)
    + " FROM requests WHERE run_id = ?"
)

# ---- segments and spans
SELECT_DIGEST = "SELECT digest FROM segments WHERE run_id = ? AND writer_id = ? AND seq = ?"
INSERT_SEGMENT = (
    "INSERT INTO segments (run_id, writer_id, seq, path, rows, bytes, digest) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
SELECT_PATHS = "SELECT path FROM segments"
INSERT_SPAN = f"INSERT INTO spans ({SPAN_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
# In the order the request came to hold them (span_id): among rows at one position, the first held is served.
SPANS_OVERLAPPING = (
    "SELECT s.segment_id, s.row_start, s.row_count, s.pos_min, s.pos_max, g.path FROM spans s"
    " JOIN segments g USING (segment_id)"
    " WHERE s.run_id = ? AND s.request_id = ? AND s.pos_max >= ? AND s.pos_min <= ? ORDER BY s.span_id"
)
# Rows of one segment a request already holds near some positions (a mirror never inserts them twice).
HELD_IN_SEGMENT = (
    "SELECT row_start, row_count FROM spans"
    " WHERE run_id = ? AND request_id = ? AND pos_min <= ? AND pos_max >= ? AND segment_id = ?"
)

# ---- prefix-cache references (references.py)
INSERT_REFERENCE = (
    "INSERT INTO prefix_refs (run_id, request_id, pos_start, pos_end, source_request_id) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
# For each piece of a JSON array [[source, lo, hi], ...]: the references naming that source whose range meets
# positions [lo, hi]. One statement per commit, not one per request (a decode batch holds hundreds).
REFERENCES_FROM = (
    "SELECT j.key AS piece, p.request_id, p.pos_start, p.pos_end FROM json_each(?) AS j"
    " JOIN prefix_refs AS p ON p.run_id = ? AND p.source_request_id = j.value ->> 0"
    " AND p.pos_start <= j.value ->> 2 AND p.pos_end > j.value ->> 1 ORDER BY j.key, p.request_id, p.pos_start"
)
COUNT_REFERENCES = "SELECT COUNT(*) AS n FROM prefix_refs WHERE run_id = ?"
# A referenced range says the request has those positions: until resolved, an open request reads them as GAP.
EXPECT_POSITION = "UPDATE requests SET pos_max = MAX(pos_max, ?) WHERE run_id = ? AND request_id = ?"

# ---- requests
SELECT_REQUEST = "SELECT * FROM requests WHERE run_id = ? AND request_id = ?"
ENSURE_REQUEST = "INSERT INTO requests (run_id, request_id) VALUES (?, ?) ON CONFLICT DO NOTHING"
ADD_TO_REQUEST = (
    "UPDATE requests SET rows = rows + :rows, referenced_rows = referenced_rows + :referenced,"
    " pos_max = MAX(pos_max, :pos_max), flag_bits = flag_bits | :flag_bits,"
    " first_flagged = CASE WHEN :first_flagged IS NULL THEN first_flagged"
    " ELSE MIN(COALESCE(first_flagged, :first_flagged), :first_flagged) END, "
    + ", ".join(f"{c} = {c} + :{c}" for c in COUNT_COLUMNS)
    + " WHERE run_id = :run_id AND request_id = :request_id"
)
SET_FINAL = "UPDATE requests SET final_tokens = ?, status = ? WHERE run_id = ? AND request_id = ?"
# Writer ownership (replay_service/ownership.py): the first authenticated writer of a request owns it.
SELECT_OWNERS = (
    "SELECT request_id, owner FROM requests WHERE run_id = ? AND owner IS NOT NULL"
    " AND request_id IN (SELECT value FROM json_each(?))"
)
CLAIM_REQUEST = "UPDATE requests SET owner = ? WHERE run_id = ? AND request_id = ? AND owner IS NULL"
_LIST_BASE = "SELECT * FROM requests WHERE run_id = ? AND request_id > ?"
_LIST_ORDER = " ORDER BY request_id LIMIT ?"
# One statement per filter (every request, or those with a flag); the cursor "" starts at the first id.
LIST_REQUESTS: dict[Flag | None, str] = {
    None: _LIST_BASE + _LIST_ORDER,
    Flag.GAP: _LIST_BASE + f" AND {EXPECTED_ROWS} - rows > 0" + _LIST_ORDER,
    **{f: _LIST_BASE + f" AND {count_column(f)} > 0" + _LIST_ORDER for f in COUNTED_FLAGS},
}

# ---- per-position verdicts that arrive after the row was stored (CONFLICT with a later batch)
SELECT_ROW_FLAGS = "SELECT flags FROM row_flags WHERE run_id = ? AND request_id = ? AND position = ?"
ROW_FLAGS_IN_RANGE = (
    "SELECT position, flags FROM row_flags WHERE run_id = ? AND request_id = ? AND position >= ? AND position < ?"
)
OR_ROW_FLAGS = (
    "INSERT INTO row_flags (run_id, request_id, position, flags) VALUES (?, ?, ?, ?)"
    " ON CONFLICT DO UPDATE SET flags = flags | excluded.flags"
)
COUNT_CONFLICT = (
    f"UPDATE requests SET {count_column(Flag.CONFLICT)} = {count_column(Flag.CONFLICT)} + 1,"
    f" flag_bits = flag_bits | {int(Flag.CONFLICT)}, first_flagged = MIN(COALESCE(first_flagged, ?), ?)"
    " WHERE run_id = ? AND request_id = ?"
)


class Index:
    """One SQLite connection behind one lock; reads are methods, writes go through `transaction()`."""

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'OFF'}")
        self._migrate()
        self.conn.executescript(SCHEMA)
        self.lock = threading.RLock()

    def _migrate(self) -> None:
        """Bring an older index file up to SCHEMA_VERSION, in one transaction (a crash leaves the old file)."""
        if self.conn.execute(GET_SCHEMA_VERSION).fetchone()[0] >= SCHEMA_VERSION:
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            # A table without columns does not exist yet (a new file): SCHEMA creates it as it is now.
            runs, requests, spans = (self._columns(t) for t in ("runs", "requests", "spans"))
            if "num_layers" in runs:
                self.conn.execute(RENAME_NUM_LAYERS)
            if runs and "num_hidden_layers" not in runs:
                self.conn.execute(ADD_NUM_HIDDEN_LAYERS)
            if runs and "pinned" not in runs:
                self.conn.execute(ADD_PINNED)
            if runs and "last_write" not in runs:
                self.conn.execute(ADD_LAST_WRITE)
            if requests and "referenced_rows" not in requests:
                self.conn.execute(ADD_REFERENCED_ROWS)
            if requests and "owner" not in requests:
                self.conn.execute(ADD_OWNER)
            if spans and "span_id" not in spans:
                for statement in REBUILD_SPANS:
                    self.conn.execute(statement)
            self.conn.execute(SET_SCHEMA_VERSION)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def _columns(self, table: str) -> set[str]:
        return {row["name"] for row in self.conn.execute(TABLE_COLUMNS, (table,))}

    # ---- generic access (the comparison store keeps its own statements beside its table)

    def query(self, sql: str, params: tuple | list | dict = ()) -> list[sqlite3.Row]:
        """Every row of one statement."""
        with self.lock:
            return self.conn.execute(sql, params).fetchall()

    def one(self, sql: str, params: tuple | list | dict = ()) -> sqlite3.Row | None:
        """The first row of one statement, or None."""
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def transaction(self) -> _Transaction:
        """`with index.transaction() as tx:` one IMMEDIATE transaction, committed on a clean exit."""
        return _Transaction(self)

    def close(self) -> None:
        """Close the connection."""
        with self.lock:
            self.conn.close()

    # ---- reads

    def run(self, run_id: str) -> sqlite3.Row | None:
        """The `runs` row of a run."""
        return self.one(SELECT_RUN, (run_id,))

    def runs(self) -> list[sqlite3.Row]:
        """Every `runs` row, by run id."""
        return self.query(SELECT_RUNS)

    def count_runs(self) -> int:
        """How many runs exist (cheap: no per-run aggregation)."""
        row = self.one(COUNT_RUNS)
        return int(row["n"]) if row else 0

    def run_aggregate(self, run_id: str) -> sqlite3.Row:
        """Sums over a run's requests: requests, rows, ended, gap and one column per counted flag."""
        row = self.one(RUN_AGGREGATE, (run_id,))
        assert row is not None  # an aggregate always answers one row
        return row

    def stored_digest(self, run_id: str, writer_id: str, seq: int) -> str | None:
        """The digest of the batch stored under this idempotency key, if any."""
        row = self.one(SELECT_DIGEST, (run_id, writer_id, seq))
        return row["digest"] if row else None

    def indexed_paths(self) -> set[str]:
        """Every segment path the index names (relative to the segment root)."""
        return {row["path"] for row in self.query(SELECT_PATHS)}

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[sqlite3.Row]:
        """A request's spans touching positions `[pos_lo, pos_hi]`, in the order it came to hold them.

        Each: segment_id, row_start, row_count, pos_min, pos_max, path. Inside a transaction (same thread)
        this sees the transaction's own writes.
        """
        return self.query(SPANS_OVERLAPPING, (run_id, request_id, pos_lo, pos_hi))

    def count_references(self, run_id: str) -> int:
        """How many distinct prefix-cache references a run received."""
        row = self.one(COUNT_REFERENCES, (run_id,))
        return int(row["n"]) if row else 0

    def request(self, run_id: str, request_id: str) -> sqlite3.Row | None:
        """The `requests` row of a request."""
        return self.one(SELECT_REQUEST, (run_id, request_id))

    def requests_page(self, run_id: str, flag: Flag | None, cursor: str | None, limit: int) -> list[sqlite3.Row]:
        """Up to `limit` requests after `cursor` by id, those with `flag` only when given."""
        return self.query(LIST_REQUESTS[flag], (run_id, cursor or "", limit))

    def late_flags(self, run_id: str, request_id: str, start: int, end: int) -> dict[int, int]:
        """Flags recorded for positions `[start, end)` after their rows were stored (position -> bits)."""
        return {r["position"]: r["flags"] for r in self.query(ROW_FLAGS_IN_RANGE, (run_id, request_id, start, end))}

    # ---- writes outside an ingest

    def register_run(self, run_id: str, shape: RunShape, source: str, created_at: float) -> None:
        """Insert a new run's row."""
        with self.transaction() as tx:
            tx.execute(INSERT_RUN, (run_id, shape.num_moe_layers, shape.top_k, shape.num_experts,
                                    json.dumps(list(shape.moe_layers)), shape.num_hidden_layers, source, created_at))

    def set_num_hidden_layers(self, run_id: str, num_hidden_layers: int) -> None:
        """Record the model's layer count a run learnt (it had only the count derived from its MoE layers)."""
        with self.transaction() as tx:
            tx.execute(SET_NUM_HIDDEN_LAYERS, (num_hidden_layers, run_id))

    def set_pinned(self, run_id: str, pinned: bool) -> bool:
        """Pin (retention never deletes it) or unpin a run; False when the run does not exist."""
        with self.transaction() as tx:
            return tx.execute(SET_PINNED, (int(pinned), run_id)).rowcount == 1

    def set_created_at(self, run_id: str, created_at: float) -> None:
        """Set a run's creation time (reindex: the time its journal recorded, not when it was rebuilt)."""
        with self.transaction() as tx:
            tx.execute(SET_CREATED_AT, (created_at, run_id))


class IndexTransaction:
    """The writes of one transaction (typed: the statements are this module's constants)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, params: tuple | list | dict = ()) -> sqlite3.Cursor:
        """One statement in this transaction (for tables kept elsewhere: the comparison store's)."""
        return self.conn.execute(sql, params)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested step of this transaction: on an error only its writes are undone, and the error is raised."""
        self.conn.execute(SAVEPOINT)
        try:
            yield
        except BaseException:
            if self.conn.in_transaction:  # SQLite may roll the whole transaction back itself (SQLITE_FULL)
                self.conn.execute(ROLLBACK_TO_SAVEPOINT)
                self.conn.execute(RELEASE_SAVEPOINT)
            raise
        self.conn.execute(RELEASE_SAVEPOINT)

    @property
    def active(self) -> bool:
        """Whether the transaction is still open (SQLite ends it itself on some errors)."""
        return self.conn.in_transaction

    def request(self, run_id: str, request_id: str) -> sqlite3.Row | None:
        """The `requests` row of a request, read inside this transaction."""
        return self.conn.execute(SELECT_REQUEST, (run_id, request_id)).fetchone()

    def set_final(self, run_id: str, request_id: str, num_tokens: int, status: RequestStatus) -> None:
        """Record a request's end (creating its row when no rows arrived yet)."""
        self.conn.execute(ENSURE_REQUEST, (run_id, request_id))
        self.conn.execute(SET_FINAL, (num_tokens, str(status), run_id, request_id))

    def owners(self, run_id: str, request_ids: list[str]) -> dict[str, str]:
        """The owners of those of `request_ids` that have one (request id -> owner)."""
        return {r["request_id"]: r["owner"] for r in
                self.conn.execute(SELECT_OWNERS, (run_id, json.dumps(request_ids)))}

    def claim(self, run_id: str, request_id: str, owner: str) -> None:
        """Make `owner` the request's owner when it has none (creating its row)."""
        self.conn.execute(ENSURE_REQUEST, (run_id, request_id))
        self.conn.execute(CLAIM_REQUEST, (owner, run_id, request_id))

    def insert_segment(self, run_id: str, writer_id: str, seq: int, path: str, rows: int, size: int,
                       digest: str) -> int:
        """A segment's row; returns its segment id (a later segment has a larger id)."""
        cur = self.conn.execute(INSERT_SEGMENT, (run_id, writer_id, seq, path, rows, size, digest))
        assert cur.lastrowid is not None
        return cur.lastrowid

    def insert_span(self, run_id: str, request_id: str, segment_id: int, row_start: int, row_count: int,
                    pos_min: int, pos_max: int) -> None:
        """Rows `[row_start, row_start + row_count)` of a segment hold a request's positions pos_min..pos_max."""
        self.conn.execute(INSERT_SPAN, (run_id, request_id, segment_id, row_start, row_count, pos_min, pos_max))

    def add_to_request(self, run_id: str, request_id: str, rows: int, pos_max: int, flag_bits: int,
                       first_flagged: int | None, counts: dict[Flag, int], referenced: int = 0) -> None:
        """Add served rows (and flag counts) to a request's counters, creating its row.

        `referenced`: how many of `rows` are served through a prefix-cache reference (stored by another request).
        """
        self.conn.execute(ENSURE_REQUEST, (run_id, request_id))
        params: dict[str, Any] = {"run_id": run_id, "request_id": request_id, "rows": rows, "pos_max": pos_max,
                                  "flag_bits": flag_bits, "first_flagged": first_flagged, "referenced": referenced}
        params.update({count_column(f): int(counts.get(f, 0)) for f in COUNTED_FLAGS})
        self.conn.execute(ADD_TO_REQUEST, params)

    def add_served(self, run_id: str, request_id: str, positions: np.ndarray, flags: np.ndarray, pos_max: int,
                   padding: int = 0, referenced: int = 0) -> None:
        """Add rows newly served at sorted `positions` (with their `flags`) to a request's counters, creating its row.

        `pos_max`: the last position the rows' span reaches (served or not); `padding`: writer padding rows
        dropped; `referenced`: how many of the rows are served through a prefix-cache reference.
        """
        counts: dict[Flag, int] = {f: int(np.count_nonzero(flags & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        counts[Flag.PADDING] = padding
        flagged = positions[flags != 0]
        self.add_to_request(run_id, request_id, rows=len(positions), pos_max=pos_max,
                            flag_bits=int(np.bitwise_or.reduce(flags)) if flags.size else 0,
                            first_flagged=int(flagged[0]) if flagged.size else None, counts=counts,
                            referenced=referenced)

    def mark_conflict(self, run_id: str, request_id: str, position: int) -> bool:
        """CONFLICT on an already stored row (a later batch disagreed), counted once; False when already marked."""
        known = self.conn.execute(SELECT_ROW_FLAGS, (run_id, request_id, position)).fetchone()
        if known is not None and known["flags"] & Flag.CONFLICT:
            return False
        self.conn.execute(OR_ROW_FLAGS, (run_id, request_id, position, int(Flag.CONFLICT)))
        self.conn.execute(COUNT_CONFLICT, (position, position, run_id, request_id))
        return True

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[sqlite3.Row]:
        """`Index.spans`, read inside this transaction."""
        return self.conn.execute(SPANS_OVERLAPPING, (run_id, request_id, pos_lo, pos_hi)).fetchall()

    def held_in_segment(self, run_id: str, request_id: str, segment_id: int, pos_lo: int,
                        pos_hi: int) -> list[tuple[int, int]]:
        """`(row_start, row_count)` of one segment's rows a request holds at positions meeting `[pos_lo, pos_hi]`."""
        return [(r["row_start"], r["row_count"]) for r in
                self.conn.execute(HELD_IN_SEGMENT, (run_id, request_id, pos_hi, pos_lo, segment_id))]

    def insert_reference(self, run_id: str, request_id: str, start: int, end: int, source_request_id: str) -> bool:
        """Record a prefix-cache reference; False when it was recorded before (a retry or a replayed spill).

        The referencing request's row is created and its positions expected up to `end - 1`.
        """
        cur = self.conn.execute(INSERT_REFERENCE, (run_id, request_id, start, end, source_request_id))
        if cur.rowcount != 1:
            return False
        self.conn.execute(ENSURE_REQUEST, (run_id, request_id))
        self.conn.execute(EXPECT_POSITION, (end - 1, run_id, request_id))
        return True

    def references_from(self, run_id: str, pieces: list[tuple[str, int, int]]) -> list[tuple[int, str, int, int]]:
        """References naming the source of a piece `(source_request_id, pos_lo, pos_hi)` whose range meets its
        positions: `(piece index, request_id, start, end)`, by piece."""
        return [(r["piece"], r["request_id"], r["pos_start"], r["pos_end"]) for r in
                self.conn.execute(REFERENCES_FROM, (json.dumps(pieces), run_id))]

    def delete_run(self, run_id: str) -> int:
        """Delete every index row of a run (compares aside: compares.py); how many rows were deleted."""
        return sum(self.conn.execute(sql, (run_id,)).rowcount for sql in DELETE_RUN_ROWS)

    def add_run_totals(self, run_id: str, size: int, load: np.ndarray, written_ns: int) -> None:
        """Add a segment's bytes to its run, store the run's new expert load and its last write (the segment's)."""
        self.conn.execute(ADD_RUN_TOTALS, (size, load.astype(np.int64).tobytes(), written_ns / 1e9, run_id))


class _Transaction:
    def __init__(self, index: Index) -> None:
        self.index = index

    def __enter__(self) -> IndexTransaction:
        self.index.lock.acquire()
        self.index.conn.execute("BEGIN IMMEDIATE")
        return IndexTransaction(self.index.conn)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None or self.index.conn.in_transaction:  # SQLite may have rolled back itself already
                self.index.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.index.lock.release()
