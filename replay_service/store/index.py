"""The store's index: which rows of which segment hold request R, counters, idempotency keys, references.

It answers "which rows of which segment hold request R" without scanning any file, keeps
per-request and per-run counters for summaries and listings, records the idempotency key
`(run_id, writer_id, seq)` of every stored batch, and keeps prefix-cache references (`prefix_refs`:
request R's positions `[start, end)` are the rows request S stored there; `references.py` resolves
them into spans of R that point at S's segment rows, so rows are stored once). Every statement is
here, written once for both backends (`Sql`: the few words that differ come from the backend's
`Dialect`); callers use the typed methods of `Index` (reads) and `IndexTransaction` (writes), never
SQL text. Weight versions (rows.md, "Weight versions"): `version_spans` holds, per request, the versions of the
rows served by the default rule as position spans; `run_versions` counts a run's served rows per version;
`requests.recomputed` / `first_recomputed` count and locate positions recomputed under other weights.
Where the rows live is a backend (`index_backends/`): a SQLite file beside the segments
(default), or a PostgreSQL database (`REPLAY_INDEX_URL`) that several replicas share. (Over 400 lines
on purpose: every statement of the store is in this one file, beside the typed method that runs it.)
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replay_format import Flag, RunShape
from replay_service.store.index_backends import Backend, Cursor, Dialect, Params, Row, Transaction, open_backend

__all__ = ["COUNTED_FLAGS", "Index", "IndexTransaction", "RequestStatus", "Row", "count_column", "load_of"]


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


@dataclass(frozen=True)
class HeldRows:
    """Rows `[row_start, row_start + row_count)` of one segment, held by a request at positions pos_min..pos_max
    (a `spans` row, with its segment's path)."""

    request_id: str
    segment_id: int
    path: str
    row_start: int
    row_count: int
    pos_min: int
    pos_max: int


@dataclass(frozen=True)
class RequestCounts:
    """What one batch adds to one request's counters (`IndexTransaction.add_counts`).

    `rows`: rows newly served; `pos_max`: the last position the batch's span reaches (served or not);
    `counts`: rows per counted flag (PADDING: writer padding rows dropped); `referenced`: how many of `rows` are
    served through a prefix-cache reference; `unclean`: how many of `rows` carry any flag.
    """

    request_id: str
    rows: int
    pos_max: int
    flag_bits: int = 0
    first_flagged: int | None = None
    counts: Mapping[Flag, int] = field(default_factory=dict)
    referenced: int = 0
    unclean: int = 0

    @classmethod
    def of_rows(cls, request_id: str, positions: np.ndarray, flags: np.ndarray, pos_max: int, padding: int = 0,
                referenced: int = 0) -> RequestCounts:
        """The counts of rows newly served at sorted `positions` with their `flags`."""
        counts: dict[Flag, int] = {f: int(np.count_nonzero(flags & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        counts[Flag.PADDING] = padding
        flagged = positions[flags != 0]
        return cls(request_id, rows=len(positions), pos_max=pos_max,
                   flag_bits=int(np.bitwise_or.reduce(flags)) if flags.size else 0,
                   first_flagged=int(flagged[0]) if flagged.size else None, counts=counts,
                   referenced=referenced, unclean=int(flagged.size))


COUNT_COLUMNS = tuple(count_column(f) for f in COUNTED_FLAGS)
_COUNTS = tuple(zip(COUNTED_FLAGS, COUNT_COLUMNS))  # (flag, its column)
SPAN_FIELDS = "run_id, request_id, segment_id, row_start, row_count, pos_min, pos_max"
# A segment is indexed only while its run exists: a batch whose run was deleted while it was being written
# (retention.py) is refused at commit with this message (RunDeleted), never left as rows of no run.
RUN_DELETED = "run deleted while this batch was stored"
# Index files are brought up to date on open: user_version 0 named num_moe_layers num_layers (renamed);
# before 2, runs had no num_hidden_layers (added as 0: unknown, read as max(moe_layers) + 1); before 3,
# spans had no span_id (rebuilt in segment order, which is the order their rows were served in) and
# requests no referenced_rows (0: nothing was referenced); prefix_refs is new (created by the schema).
# Before 4, runs had no pinned (0: retention may delete it) nor last_write (NULL: read as created_at).
# Before 5, requests had no owner (NULL: not owned; the next authenticated writer claims it, ownership.py).
# A PostgreSQL index starts at 5. Before 6 (both backends), requests had no recomputed / first_recomputed (0 and
# NULL: none known) and version_spans, run_versions are new (empty: every stored row's version unknown).
# Before 7 (both backends), requests had no last_write (NULL: written before, never in a health window) nor
# unclean (rows served with a flag; 0: unknown, a request's flags still count) and the run-health tables
# (store/health.py) are new. A newer version than this one is refused (IndexTooNew).
SCHEMA_VERSION = 8  # 8: stale_feed
# Rows a request should have: T-1 once finished with T tokens, else up to the last position seen.
EXPECTED_ROWS = "COALESCE(final_tokens - 1, pos_max + 1)"


@dataclass(frozen=True)
class FeedEntry:
    """One entry of the STALE table's feed: the rows one host stored recently, as `ingest/stale_feed.py` packs them."""

    feed_id: int
    host: str
    records: bytes


class Sql:
    """Every statement of the index, in one dialect (`?` and `:name` parameters: the backend converts)."""

    def __init__(self, d: Dialect) -> None:
        text, integer, sqlite = d.text, d.integer, d.name == "sqlite"
        # A span's id is the order a request came to hold its rows: among rows at one position, the first held
        # is served. For a request's own rows that is segment order; a span mirrored from a reference's source
        # (references.py) is held from when it was inserted, so a request's own earlier rows keep winning.
        self.spans_columns = f"""
    span_id {d.serial_key},
    run_id {text} NOT NULL,
    request_id {text} NOT NULL,
    segment_id {integer} NOT NULL,
    row_start {integer} NOT NULL,
    row_count {integer} NOT NULL,
    pos_min {integer} NOT NULL,
    pos_max {integer} NOT NULL
"""
        # SQLite: a trigger refuses a segment of no run (its file predates foreign keys being enforced);
        # PostgreSQL: a foreign key, which also locks the run row against a concurrent delete.
        run_guard = "" if sqlite else " REFERENCES runs (run_id)"
        self.schema = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id {text} PRIMARY KEY,
    num_moe_layers {integer} NOT NULL,
    top_k {integer} NOT NULL,
    num_experts {integer} NOT NULL,
    moe_layers {text} NOT NULL,
    num_hidden_layers {integer} NOT NULL DEFAULT 0,
    source {text} NOT NULL,
    created_at {d.real} NOT NULL,
    bytes {integer} NOT NULL DEFAULT 0,
    load {d.blob},
    pinned {integer} NOT NULL DEFAULT 0,
    last_write {d.real}
);
CREATE TABLE IF NOT EXISTS requests (
    run_id {text} NOT NULL,
    request_id {text} NOT NULL,
    rows {integer} NOT NULL DEFAULT 0,
    pos_max {integer} NOT NULL DEFAULT -1,
    final_tokens {integer},
    status {text} NOT NULL DEFAULT '{RequestStatus.OPEN}',
    flag_bits {integer} NOT NULL DEFAULT 0,
    first_flagged {integer},
    {", ".join(f"{c} {integer} NOT NULL DEFAULT 0" for c in COUNT_COLUMNS)},
    referenced_rows {integer} NOT NULL DEFAULT 0,
    owner {text},
    recomputed {integer} NOT NULL DEFAULT 0,
    first_recomputed {integer},
    last_write {d.real},
    unclean {integer} NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, request_id)
);
CREATE INDEX IF NOT EXISTS requests_by_write ON requests (last_write);
CREATE TABLE IF NOT EXISTS segments (
    segment_id {d.serial_key},
    run_id {text} NOT NULL{run_guard},
    writer_id {text} NOT NULL,
    seq {integer} NOT NULL,
    path {text} NOT NULL,
    rows {integer} NOT NULL,
    bytes {integer} NOT NULL,
    digest {text} NOT NULL,
    UNIQUE (run_id, writer_id, seq)
);
CREATE TABLE IF NOT EXISTS spans ({self.spans_columns});
CREATE INDEX IF NOT EXISTS spans_by_request ON spans (run_id, request_id, pos_min);
CREATE TABLE IF NOT EXISTS row_flags (
    run_id {text} NOT NULL,
    request_id {text} NOT NULL,
    position {integer} NOT NULL,
    flags {integer} NOT NULL,
    PRIMARY KEY (run_id, request_id, position)
);
CREATE TABLE IF NOT EXISTS prefix_refs (
    run_id {text} NOT NULL,
    request_id {text} NOT NULL,
    pos_start {integer} NOT NULL,
    pos_end {integer} NOT NULL,
    source_request_id {text} NOT NULL,
    PRIMARY KEY (run_id, request_id, pos_start, pos_end, source_request_id)
){d.without_rowid};
CREATE INDEX IF NOT EXISTS prefix_refs_by_source ON prefix_refs (run_id, source_request_id, pos_start);
CREATE TABLE IF NOT EXISTS version_spans (
    run_id {text} NOT NULL,
    request_id {text} NOT NULL,
    pos_start {integer} NOT NULL,
    pos_end {integer} NOT NULL,
    version {text} NOT NULL,
    PRIMARY KEY (run_id, request_id, pos_start)
){d.without_rowid};
CREATE TABLE IF NOT EXISTS run_versions (
    run_id {text} NOT NULL,
    version {text} NOT NULL,
    rows {integer} NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, version)
){d.without_rowid};
CREATE TABLE IF NOT EXISTS stale_feed (
    feed_id {d.serial_key},
    host {text} NOT NULL,
    written_at {d.real} NOT NULL,
    records {d.blob} NOT NULL
);
"""
        if not sqlite:  # the feed's rows are hashes: compressing them (TOAST's default) cost 7x the insert itself
            self.schema += "ALTER TABLE stale_feed ALTER COLUMN records SET STORAGE EXTERNAL;\n"
        if sqlite:
            self.schema += f"""CREATE TRIGGER IF NOT EXISTS segments_of_a_run BEFORE INSERT ON segments
    WHEN NOT EXISTS (SELECT 1 FROM runs WHERE run_id = NEW.run_id)
    BEGIN SELECT RAISE(ABORT, '{RUN_DELETED}'); END;
"""
        greatest, least = d.greatest, d.least

        def total(expr: str) -> str:  # a sum as an integer on both (PostgreSQL sums BIGINT as NUMERIC)
            return f"CAST(COALESCE(SUM({expr}), 0) AS {integer})"

        # ---- the STALE table's feed between hosts (ingest/stale_feed.py)
        self.feed_publish = "INSERT INTO stale_feed (host, written_at, records) VALUES (?, ?, ?)"
        self.feed_since = ("SELECT feed_id FROM stale_feed WHERE feed_id > ? AND written_at >= ? AND host <> ?"
                           " ORDER BY feed_id LIMIT ?")
        self.feed_records = ("SELECT feed_id, host, records FROM stale_feed WHERE feed_id BETWEEN ? AND ? AND host <> ?"
                             " ORDER BY feed_id")
        self.feed_prune = "DELETE FROM stale_feed WHERE written_at < ?"

        # ---- runs
        self.insert_run = (
            "INSERT INTO runs (run_id, num_moe_layers, top_k, num_experts, moe_layers, num_hidden_layers, source,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"  # another replica's first batch
        )
        self.set_created_at = "UPDATE runs SET created_at = ? WHERE run_id = ?"  # reindex restores a creation time
        self.select_run = "SELECT * FROM runs WHERE run_id = ?"
        self.select_run_load = "SELECT load FROM runs WHERE run_id = ?"
        # Compare-and-set: a count another replica learnt meanwhile is never overwritten (runs.py).
        self.learn_num_hidden_layers = ("UPDATE runs SET num_hidden_layers = ?"
                                        " WHERE run_id = ? AND num_hidden_layers = ?")
        self.select_runs = "SELECT * FROM runs ORDER BY run_id"
        self.count_runs = "SELECT COUNT(*) AS n FROM runs"
        # last_write: Unix time of the run's last stored segment (retention's age of a run still being written).
        self.add_run_totals = (f"UPDATE runs SET bytes = bytes + ?, load = ?,"
                               f" last_write = {greatest}(COALESCE(last_write, 0), ?) WHERE run_id = ?")
        self.set_pinned = "UPDATE runs SET pinned = ? WHERE run_id = ?"
        # ---- deleting a run (retention.py): every table holding its rows, in one transaction (segments before
        # runs: the foreign key)
        self.delete_run_rows = tuple(f"DELETE FROM {table} WHERE run_id = ?"
                                     for table in ("spans", "row_flags", "prefix_refs", "version_spans",
                                                   "run_versions", "requests", "segments", "runs"))
        self.run_aggregate = (
            f"SELECT COUNT(*) AS requests, {total('rows')} AS rows,"
            f" {total(f'CASE WHEN status != {chr(39)}{RequestStatus.OPEN}{chr(39)} THEN 1 ELSE 0 END')} AS ended,"
            f" {total(f'{greatest}({EXPECTED_ROWS} - rows, 0)')} AS gap,"
            f" {total('referenced_rows')} AS referenced_rows, {total('recomputed')} AS recomputed, "
            + ", ".join(f"{total(c)} AS {c}" for c in COUNT_COLUMNS)
            + " FROM requests WHERE run_id = ?"
        )

        # ---- segments and spans
        self.select_digest = "SELECT digest FROM segments WHERE run_id = ? AND writer_id = ? AND seq = ?"
        self.insert_segment = ("INSERT INTO segments (run_id, writer_id, seq, path, rows, bytes, digest)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING segment_id")
        self.select_paths = "SELECT path FROM segments"
        self.segment_named = "SELECT 1 FROM segments WHERE run_id = ? AND path = ? LIMIT 1"
        self.insert_span = f"INSERT INTO spans ({SPAN_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
        # In the order the request came to hold them (span_id): among rows at one position, the first held wins.
        self.spans_overlapping = (
            "SELECT s.segment_id, s.row_start, s.row_count, s.pos_min, s.pos_max, g.path FROM spans s"
            " JOIN segments g USING (segment_id)"
            " WHERE s.run_id = ? AND s.request_id = ? AND s.pos_max >= ? AND s.pos_min <= ? ORDER BY s.span_id"
        )
        # Which pieces [request, lo, hi] name a request holding a span touching lo..hi (most of a fresh batch's none).
        self.pieces_held = (
            f"SELECT j.piece FROM {d.json_pieces} AS j WHERE EXISTS (SELECT 1 FROM spans s WHERE s.run_id = ?"
            " AND s.request_id = j.src AND s.pos_max >= j.lo AND s.pos_min <= j.hi)"
        )
        # Rows of one segment a request already holds near some positions (a mirror never inserts them twice).
        self.held_in_segment = (
            "SELECT row_start, row_count FROM spans"
            " WHERE run_id = ? AND request_id = ? AND pos_min <= ? AND pos_max >= ? AND segment_id = ?"
        )

        # ---- prefix-cache references (references.py)
        self.insert_reference = (
            "INSERT INTO prefix_refs (run_id, request_id, pos_start, pos_end, source_request_id)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        # For each piece of a JSON array [[source, lo, hi], ...]: the references naming that source whose range
        # meets positions [lo, hi]. One statement per commit, not one per request (a decode batch holds hundreds).
        self.references_from = (
            f"SELECT j.piece, p.request_id, p.pos_start, p.pos_end FROM {d.json_pieces} AS j"
            " JOIN prefix_refs AS p ON p.run_id = ? AND p.source_request_id = j.src"
            " AND p.pos_start <= j.hi AND p.pos_end > j.lo ORDER BY j.piece, p.request_id, p.pos_start"
        )
        self.count_references = "SELECT COUNT(*) AS n FROM prefix_refs WHERE run_id = ?"
        # A referenced range says the request has those positions: until resolved, an open request reads them GAP.
        self.expect_position = (f"UPDATE requests SET pos_max = {greatest}(pos_max, ?)"
                                " WHERE run_id = ? AND request_id = ?")

        # ---- requests (counters as col = col + x: no lost update beside another replica's commit)
        self.select_request = "SELECT * FROM requests WHERE run_id = ? AND request_id = ?"
        self.ensure_request = "INSERT INTO requests (run_id, request_id) VALUES (?, ?) ON CONFLICT DO NOTHING"
        self.add_to_request = (
            "UPDATE requests SET rows = rows + :rows, referenced_rows = referenced_rows + :referenced,"
            f" pos_max = {greatest}(pos_max, :pos_max), flag_bits = flag_bits | :flag_bits, last_write = :now,"
            " unclean = unclean + :unclean,"
            f" first_flagged = CASE WHEN CAST(:first_flagged AS {integer}) IS NULL THEN first_flagged"
            f" ELSE {least}(COALESCE(first_flagged, :first_flagged), :first_flagged) END, "
            + ", ".join(f"{c} = {c} + :{c}" for c in COUNT_COLUMNS)
            + " WHERE run_id = :run_id AND request_id = :request_id"
        )
        self.set_final = ("UPDATE requests SET final_tokens = ?, status = ?, last_write = ?"
                          " WHERE run_id = ? AND request_id = ?")
        # Writer ownership (replay_service/ownership.py): the first authenticated writer of a request owns it.
        self.select_owners = (
            f"SELECT request_id, owner FROM requests WHERE run_id = ? AND owner IS NOT NULL"
            f" AND request_id IN ({d.json_texts})"
        )
        self.claim_request = "UPDATE requests SET owner = ? WHERE run_id = ? AND request_id = ? AND owner IS NULL"
        base, order = "SELECT * FROM requests WHERE run_id = ? AND request_id > ?", " ORDER BY request_id LIMIT ?"
        # One statement per filter (every request, or those with a flag); the cursor "" starts at the first id.
        self.list_requests: dict[Flag | None, str] = {
            None: base + order,
            Flag.GAP: base + f" AND {EXPECTED_ROWS} - rows > 0" + order,
            **{f: base + f" AND {count_column(f)} > 0" + order for f in COUNTED_FLAGS},
        }

        # ---- weight versions: spans of the served rows' versions, a run's served rows per version, recomputes
        # One statement per request and commit: a JSON array [[version, pos_start, pos_end], ...] (pieces).
        self.insert_version_spans = (
            "INSERT INTO version_spans (run_id, request_id, version, pos_start, pos_end)"
            f" SELECT ?, ?, j.src, j.lo, j.hi FROM {d.json_pieces} AS j WHERE 1 = 1"  # SQLite: WHERE before an upsert
            " ON CONFLICT DO NOTHING"  # a position is served once: a second span there is never recorded
        )
        self.version_spans_of = (
            "SELECT request_id, version, pos_start, pos_end FROM version_spans WHERE run_id = ?"
            f" AND request_id IN ({d.json_texts}) ORDER BY request_id, pos_start"
        )
        self.add_run_version = (
            "INSERT INTO run_versions (run_id, version, rows) VALUES (?, ?, ?)"
            " ON CONFLICT (run_id, version) DO UPDATE SET rows = run_versions.rows + excluded.rows"
        )
        self.select_run_versions = "SELECT version, rows FROM run_versions WHERE run_id = ? ORDER BY version"
        self.count_recomputed = (
            "UPDATE requests SET recomputed = recomputed + ?,"
            f" first_recomputed = {least}(COALESCE(first_recomputed, ?), ?) WHERE run_id = ? AND request_id = ?"
        )

        # ---- per-position verdicts that arrive after the row was stored (CONFLICT with a later batch)
        self.select_row_flags = "SELECT flags FROM row_flags WHERE run_id = ? AND request_id = ? AND position = ?"
        self.row_flags_in_range = ("SELECT position, flags FROM row_flags WHERE run_id = ? AND request_id = ?"
                                   " AND position >= ? AND position < ?")
        self.or_row_flags = (
            "INSERT INTO row_flags (run_id, request_id, position, flags) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (run_id, request_id, position) DO UPDATE SET flags = row_flags.flags | excluded.flags"
        )
        conflict = count_column(Flag.CONFLICT)
        self.count_conflict = (
            f"UPDATE requests SET {conflict} = {conflict} + 1, flag_bits = flag_bits | {int(Flag.CONFLICT)},"
            " unclean = unclean + 1,"
            f" first_flagged = {least}(COALESCE(first_flagged, ?), ?) WHERE run_id = ? AND request_id = ?"
        )

        # ---- SQLite index files of older releases (`Index._migrate`)
        self.table_columns = "SELECT name FROM pragma_table_info(?)"
        self.rename_num_layers = "ALTER TABLE runs RENAME COLUMN num_layers TO num_moe_layers"
        self.add_num_hidden_layers = "ALTER TABLE runs ADD COLUMN num_hidden_layers INTEGER NOT NULL DEFAULT 0"
        self.add_referenced_rows = "ALTER TABLE requests ADD COLUMN referenced_rows INTEGER NOT NULL DEFAULT 0"
        self.add_owner = "ALTER TABLE requests ADD COLUMN owner TEXT"
        self.rebuild_spans = (
            f"CREATE TABLE spans_v3 ({self.spans_columns})",
            f"INSERT INTO spans_v3 ({SPAN_FIELDS}) SELECT {SPAN_FIELDS} FROM spans ORDER BY segment_id, rowid",
            "DROP TABLE spans",  # drops spans_by_request too; the schema creates it again
            "ALTER TABLE spans_v3 RENAME TO spans",
        )
        self.add_pinned = "ALTER TABLE runs ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0"
        self.add_last_write = "ALTER TABLE runs ADD COLUMN last_write REAL"
        # ---- both backends, schema 6 (weight versions): columns added, nothing rewritten
        if_new = "" if sqlite else " IF NOT EXISTS"
        self.add_recomputed = (f"ALTER TABLE requests ADD COLUMN{if_new} recomputed {integer} NOT NULL DEFAULT 0",
                               f"ALTER TABLE requests ADD COLUMN{if_new} first_recomputed {integer}")
        # ---- both backends, schema 7 (run health): when a request was last written (health windows)
        self.add_request_last_write = (f"ALTER TABLE requests ADD COLUMN{if_new} last_write {d.real}",
                                       f"ALTER TABLE requests ADD COLUMN{if_new} unclean {integer} NOT NULL DEFAULT 0")


class Index:
    """The index of one store: reads are methods, writes go through `transaction()`.

    `target`: the path of a SQLite file, or a `postgresql://` URL (index_backends/).
    """

    def __init__(self, target: str | Path, fsync: bool = True, shared: bool = False) -> None:
        """Open (creating or migrating) the index `target` names; `shared`: other processes of this service write
        the same SQLite file (`serve`'s workers), so no run row may be kept in memory (a PostgreSQL index always is)."""
        self.backend: Backend = open_backend(target, fsync=fsync)
        self._shared = shared
        self.sql = Sql(self.backend.dialect)
        try:
            self.backend.ensure_schema(SCHEMA_VERSION, self.sql.schema, self._migrate)
        except BaseException:
            self.backend.close()
            raise

    @property
    def conn(self):  # noqa: ANN201 - sqlite3.Connection; SQLite only (reindex checkpoints the file it built)
        """The SQLite connection (a SQLite index only)."""
        return self.backend.conn  # type: ignore[attr-defined]

    def _migrate(self, tx: Transaction, found: int) -> None:
        """Bring an older index up to SCHEMA_VERSION, inside `tx` (a crash leaves it as it was).

        SQLite files of every older release; a PostgreSQL database from 5 (it started there). New tables come
        from the schema, run after this.
        """
        if self.backend.dialect.name != "sqlite":
            if found:  # a database of schema 5: the weight-version columns (IF NOT EXISTS: a half-done start)
                for statement in self.sql.add_recomputed:
                    tx.execute(statement)
                for statement in self.sql.add_request_last_write:  # schema 6 and older
                    tx.execute(statement)
            return
        if found == 0 and not self._columns(tx, "runs"):
            return  # a new index: the schema creates every table as it is now
        sql = self.sql
        runs, requests, spans = (self._columns(tx, t) for t in ("runs", "requests", "spans"))
        if "num_layers" in runs:
            tx.execute(sql.rename_num_layers)
        if runs and "num_hidden_layers" not in runs:
            tx.execute(sql.add_num_hidden_layers)
        if runs and "pinned" not in runs:
            tx.execute(sql.add_pinned)
        if runs and "last_write" not in runs:
            tx.execute(sql.add_last_write)
        if requests and "referenced_rows" not in requests:
            tx.execute(sql.add_referenced_rows)
        if requests and "owner" not in requests:
            tx.execute(sql.add_owner)
        if requests and "recomputed" not in requests:
            for statement in sql.add_recomputed:
                tx.execute(statement)
        if requests and "last_write" not in requests:
            for statement in sql.add_request_last_write:
                tx.execute(statement)
        if spans and "span_id" not in spans:
            for statement in sql.rebuild_spans:
                tx.execute(statement)

    def _columns(self, tx: Transaction, table: str) -> set[str]:
        # A table without columns does not exist yet.
        return {row["name"] for row in tx.execute(self.sql.table_columns, (table,))}

    # ---- generic access (the comparison store keeps its own statements beside its table)

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        """Every row of one statement (inside this thread's transaction, when one is open)."""
        return self.backend.query(sql, params)

    def one(self, sql: str, params: Params = ()) -> Row | None:
        """The first row of one statement, or None."""
        rows = self.query(sql, params)
        return rows[0] if rows else None

    @property
    def remote(self) -> bool:
        """Whether a query may wait on the network (PostgreSQL), not only on this machine (SQLite)."""
        return self.backend.remote

    @property
    def shared(self) -> bool:
        """Whether other processes write this index too (PostgreSQL: replicas; SQLite: `serve`'s other workers), so
        no run row may be cached."""
        return self._shared or self.backend.dialect.name != "sqlite"

    def transaction(self) -> _Transaction:
        """`with index.transaction() as tx:` one write transaction, committed on a clean exit."""
        return _Transaction(self)

    def close(self) -> None:
        """Close the connection(s)."""
        self.backend.close()

    # ---- reads

    def run(self, run_id: str) -> Row | None:
        """The `runs` row of a run."""
        return self.one(self.sql.select_run, (run_id,))

    def runs(self) -> list[Row]:
        """Every `runs` row, by run id."""
        return self.query(self.sql.select_runs)

    def count_runs(self) -> int:
        """How many runs exist (cheap: no per-run aggregation)."""
        row = self.one(self.sql.count_runs)
        return int(row["n"]) if row else 0

    def run_aggregate(self, run_id: str) -> Row:
        """Sums over a run's requests: requests, rows, ended, gap and one column per counted flag."""
        row = self.one(self.sql.run_aggregate, (run_id,))
        assert row is not None  # an aggregate always answers one row
        return row

    def stored_digest(self, run_id: str, writer_id: str, seq: int) -> str | None:
        """The digest of the batch stored under this idempotency key, if any."""
        row = self.one(self.sql.select_digest, (run_id, writer_id, seq))
        return row["digest"] if row else None

    def indexed_paths(self) -> set[str]:
        """Every segment path the index names (relative to the segment root)."""
        return {row["path"] for row in self.query(self.sql.select_paths)}

    def names_segment(self, run_id: str, path: str) -> bool:
        """Whether the index still names the segment at `path` (relative to the segment root) of `run_id`."""
        return bool(self.query(self.sql.segment_named, (run_id, path)))

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[Row]:
        """A request's spans touching positions `[pos_lo, pos_hi]`, in the order it came to hold them.

        Each: segment_id, row_start, row_count, pos_min, pos_max, path. Inside a transaction (same thread)
        this sees the transaction's own writes.
        """
        return self.query(self.sql.spans_overlapping, (run_id, request_id, pos_lo, pos_hi))

    def pieces_held(self, run_id: str, pieces: Sequence[tuple[str, int, int]]) -> set[int]:
        """Which of `pieces` (`(request_id, pos_lo, pos_hi)` each) name a request holding rows in a span touching
        positions `[pos_lo, pos_hi]`: their indexes, in one query. Sees the thread's own transaction as `spans`."""
        if not pieces:
            return set()
        return {int(r["piece"]) for r in self.query(self.sql.pieces_held, (json.dumps(pieces), run_id))}

    def count_references(self, run_id: str) -> int:
        """How many distinct prefix-cache references a run received."""
        row = self.one(self.sql.count_references, (run_id,))
        return int(row["n"]) if row else 0

    def request(self, run_id: str, request_id: str) -> Row | None:
        """The `requests` row of a request."""
        return self.one(self.sql.select_request, (run_id, request_id))

    def requests_page(self, run_id: str, flag: Flag | None, cursor: str | None, limit: int) -> list[Row]:
        """Up to `limit` requests after `cursor` by id, those with `flag` only when given."""
        return self.query(self.sql.list_requests[flag], (run_id, cursor or "", limit))

    def version_spans(self, run_id: str, request_ids: Sequence[str]) -> dict[str, list[tuple[str, int, int]]]:
        """The version spans `(version, pos_start, pos_end)` of the rows served by the default rule, per request
        (those with any), by position; adjacent spans of one version are not merged here (summaries.py does)."""
        out: dict[str, list[tuple[str, int, int]]] = {}
        for r in self.query(self.sql.version_spans_of, (run_id, json.dumps(list(request_ids)))):
            out.setdefault(r["request_id"], []).append((r["version"], r["pos_start"], r["pos_end"]))
        return out

    def run_versions(self, run_id: str) -> dict[str, int]:
        """A run's rows served by the default rule per known weight version (version -> rows)."""
        return {r["version"]: r["rows"] for r in self.query(self.sql.select_run_versions, (run_id,))}

    def late_flags(self, run_id: str, request_id: str, start: int, end: int) -> dict[int, int]:
        """Flags recorded for positions `[start, end)` after their rows were stored (position -> bits)."""
        return {r["position"]: r["flags"]
                for r in self.query(self.sql.row_flags_in_range, (run_id, request_id, start, end))}

    # ---- writes outside an ingest

    def register_run(self, run_id: str, shape: RunShape, source: str, created_at: float) -> bool:
        """Insert a new run's row; False when it exists already (another replica created it meanwhile)."""
        with self.transaction() as tx:
            return tx.execute(self.sql.insert_run, (
                run_id, shape.num_moe_layers, shape.top_k, shape.num_experts, json.dumps(list(shape.moe_layers)),
                shape.num_hidden_layers, source, created_at)).rowcount == 1

    def learn_num_hidden_layers(self, run_id: str, num_hidden_layers: int, was: int) -> bool:
        """Record a learnt layer count where the run still has `was`; False when it changed meanwhile (another
        replica learnt one, or the run was deleted): the caller reads the run again."""
        with self.transaction() as tx:
            return tx.execute(self.sql.learn_num_hidden_layers, (num_hidden_layers, run_id, was)).rowcount == 1

    def set_pinned(self, run_id: str, pinned: bool) -> bool:
        """Pin (retention never deletes it) or unpin a run; False when the run does not exist."""
        with self.transaction() as tx:
            return tx.execute(self.sql.set_pinned, (int(pinned), run_id)).rowcount == 1

    def publish_recent(self, host: str, written_at: float, records: bytes) -> None:
        """Add one entry of recently stored rows to the STALE table's feed (ingest/stale_feed.py)."""
        with self.transaction() as tx:
            tx.execute(self.sql.feed_publish, (host, written_at, records))

    def published_ids(self, after: int, since: float, other_than: str, limit: int) -> list[int]:
        """The numbers of the feed's entries above `after`, written at `since` or later by hosts other than
        `other_than`, in order (at most `limit`)."""
        return [int(r["feed_id"]) for r in self.query(self.sql.feed_since, (after, since, other_than, limit))]

    def published(self, first: int, last: int, other_than: str) -> list[FeedEntry]:
        """The feed's entries numbered `first` to `last` by hosts other than `other_than`, with their rows."""
        return [FeedEntry(int(r["feed_id"]), r["host"], bytes(r["records"]))
                for r in self.query(self.sql.feed_records, (first, last, other_than))]

    def prune_published(self, before: float) -> None:
        """Drop the feed's entries written before `before`."""
        with self.transaction() as tx:
            tx.execute(self.sql.feed_prune, (before,))

    def set_created_at(self, run_id: str, created_at: float) -> None:
        """Set a run's creation time (reindex: the time its journal recorded, not when it was rebuilt)."""
        with self.transaction() as tx:
            tx.execute(self.sql.set_created_at, (created_at, run_id))


def load_of(blob: bytes | None, shape: RunShape) -> np.ndarray:
    """The expert load a `runs.load` value records (NULL: nothing counted yet), as a new writable array."""
    load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
    if blob is not None:
        load[:] = np.frombuffer(blob, np.int64).reshape(load.shape)
    return load


class IndexTransaction:
    """The writes of one transaction (typed: the statements are `Sql`'s)."""

    def __init__(self, tx: Transaction, sql: Sql) -> None:
        self.tx = tx
        self.sql = sql

    def execute(self, sql: str, params: Params = ()) -> Cursor:
        """One statement in this transaction (for tables kept elsewhere: the comparison store's)."""
        return self.tx.execute(sql, params)

    def savepoint(self) -> AbstractContextManager[None]:
        """A nested step of this transaction: on an error only its writes are undone, and the error is raised."""
        return self.tx.savepoint()

    @property
    def active(self) -> bool:
        """Whether the transaction is still open (SQLite ends it itself on some errors)."""
        return self.tx.active

    def lock_runs(self, run_ids: Sequence[str]) -> None:
        """Serialise this transaction's writes to these runs with every other process's (held until it ends).

        On SQLite one process writes and BEGIN IMMEDIATE already serialises; on PostgreSQL it is what the
        in-process run lock is for several replicas (an advisory lock per run).
        """
        self.tx.lock_runs(run_ids)

    def request(self, run_id: str, request_id: str) -> Row | None:
        """The `requests` row of a request, read inside this transaction."""
        return self.tx.execute(self.sql.select_request, (run_id, request_id)).fetchone()

    def set_final(self, run_id: str, request_id: str, num_tokens: int, status: RequestStatus) -> None:
        """Record a request's end (creating its row when no rows arrived yet)."""
        self.tx.execute(self.sql.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.set_final, (num_tokens, str(status), time.time(), run_id, request_id))

    def owners(self, run_id: str, request_ids: list[str]) -> dict[str, str]:
        """The owners of those of `request_ids` that have one (request id -> owner)."""
        return {r["request_id"]: r["owner"] for r in
                self.tx.execute(self.sql.select_owners, (run_id, json.dumps(request_ids)))}

    def claim(self, run_id: str, request_id: str, owner: str) -> None:
        """Make `owner` the request's owner when it has none (creating its row)."""
        self.tx.execute(self.sql.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.claim_request, (owner, run_id, request_id))

    def insert_segment(self, run_id: str, writer_id: str, seq: int, path: str, rows: int, size: int,
                       digest: str) -> int:
        """A segment's row; returns its segment id (a later segment of a run has a larger id)."""
        cur = self.tx.execute(self.sql.insert_segment, (run_id, writer_id, seq, path, rows, size, digest))
        return int(cur.fetchall()[0]["segment_id"])

    def insert_spans(self, run_id: str, held: Sequence[HeldRows]) -> None:
        """The `spans` rows of `held` (each: rows of a segment a request now holds)."""
        self.tx.execute_many(self.sql.insert_span, [(run_id, h.request_id, h.segment_id, h.row_start, h.row_count,
                                                     h.pos_min, h.pos_max) for h in held])

    def add_counts(self, run_id: str, counts: Sequence[RequestCounts]) -> None:
        """Add each of `counts` to its request's counters (creating its row), in two statements for them all."""
        if not counts:
            return
        now = time.time()
        self.tx.execute_many(self.sql.ensure_request, [(run_id, c.request_id) for c in counts])
        self.tx.execute_many(self.sql.add_to_request, [
            {"run_id": run_id, "request_id": c.request_id, "rows": c.rows, "pos_max": c.pos_max,
             "flag_bits": c.flag_bits, "first_flagged": c.first_flagged, "referenced": c.referenced, "now": now,
             "unclean": c.unclean, **{column: int(c.counts.get(f, 0)) for f, column in _COUNTS}}
            for c in counts])

    def add_versions(self, run_id: str, request_id: str, spans: Sequence[tuple[str, int, int]]) -> None:
        """Record the versions of rows newly served at positions `[start, end)` (`(version, start, end)` each), and
        count them in the run's rows per version. Each position is served once, so spans never overlap."""
        if not spans:
            return
        self.tx.execute(self.sql.insert_version_spans, (run_id, request_id, json.dumps([list(s) for s in spans])))
        per_version: dict[str, int] = {}
        for version, start, end in spans:
            per_version[version] = per_version.get(version, 0) + end - start
        for version, rows in sorted(per_version.items()):
            self.tx.execute(self.sql.add_run_version, (run_id, version, rows))

    def add_recomputed(self, run_id: str, request_id: str, positions: Sequence[int]) -> None:
        """Count positions newly recomputed under other weights (each counted once: the caller's rule)."""
        if positions:
            first = int(min(positions))
            self.tx.execute(self.sql.count_recomputed, (len(positions), first, first, run_id, request_id))

    def mark_conflict(self, run_id: str, request_id: str, position: int) -> bool:
        """CONFLICT on an already stored row (a later batch disagreed), counted once; False when already marked."""
        known = self.tx.execute(self.sql.select_row_flags, (run_id, request_id, position)).fetchone()
        if known is not None and known["flags"] & Flag.CONFLICT:
            return False
        self.tx.execute(self.sql.or_row_flags, (run_id, request_id, position, int(Flag.CONFLICT)))
        self.tx.execute(self.sql.count_conflict, (position, position, run_id, request_id))
        return True

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[Row]:
        """`Index.spans`, read inside this transaction."""
        return self.tx.execute(self.sql.spans_overlapping, (run_id, request_id, pos_lo, pos_hi)).fetchall()

    def held_in_segment(self, run_id: str, request_id: str, segment_id: int, pos_lo: int,
                        pos_hi: int) -> list[tuple[int, int]]:
        """`(row_start, row_count)` of one segment's rows a request holds at positions meeting `[pos_lo, pos_hi]`."""
        return [(r["row_start"], r["row_count"]) for r in
                self.tx.execute(self.sql.held_in_segment, (run_id, request_id, pos_hi, pos_lo, segment_id))]

    def insert_reference(self, run_id: str, request_id: str, start: int, end: int, source_request_id: str) -> bool:
        """Record a prefix-cache reference; False when it was recorded before (a retry or a replayed spill).

        The referencing request's row is created and its positions expected up to `end - 1`.
        """
        cur = self.tx.execute(self.sql.insert_reference, (run_id, request_id, start, end, source_request_id))
        if cur.rowcount != 1:
            return False
        self.tx.execute(self.sql.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.expect_position, (end - 1, run_id, request_id))
        return True

    def references_from(self, run_id: str, pieces: list[tuple[str, int, int]]) -> list[tuple[int, str, int, int]]:
        """References naming the source of a piece `(source_request_id, pos_lo, pos_hi)` whose range meets its
        positions: `(piece index, request_id, start, end)`, by piece."""
        return [(r["piece"], r["request_id"], r["pos_start"], r["pos_end"]) for r in
                self.tx.execute(self.sql.references_from, (json.dumps(pieces), run_id))]

    def delete_run(self, run_id: str) -> int:
        """Delete every index row of a run (compares aside: compares.py); how many rows were deleted."""
        return sum(self.tx.execute(sql, (run_id,)).rowcount for sql in self.sql.delete_run_rows)

    def run_load(self, run_id: str, shape: RunShape) -> np.ndarray:
        """A run's stored expert load `(num_moe_layers, num_experts)`, read inside this transaction (zeros when it
        has none, or no row: a run deleted meanwhile, refused when its segment is inserted).

        Read after `lock_runs`: no other replica's commit of the run can change it before this one ends.
        """
        row = self.tx.execute(self.sql.select_run_load, (run_id,)).fetchone()
        return load_of(row["load"] if row is not None else None, shape)

    def add_run_totals(self, run_id: str, size: int, load: np.ndarray, written_ns: int) -> None:
        """Add a segment's bytes to its run, store the run's new expert load and its last write (the segment's)."""
        self.tx.execute(self.sql.add_run_totals, (size, load.astype(np.int64).tobytes(), written_ns / 1e9, run_id))


class _Transaction:
    def __init__(self, index: Index) -> None:
        self.index = index
        self.tx: Transaction | None = None

    def __enter__(self) -> IndexTransaction:
        self.tx = self.index.backend.begin()
        return IndexTransaction(self.tx, self.index.sql)

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.tx is not None
        self.tx.finish(commit=exc_type is None)
