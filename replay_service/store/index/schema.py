"""What the index's core tables are, and how an index of an older release is brought up to date.

`ddl(d)` creates every core table (runs, requests, segments, spans, row_flags, prefix_refs, version_spans,
run_versions, stale_feed) in one backend's dialect; `migrate(d, tx, found)` brings an index of schema `found` up to
`SCHEMA_VERSION` before it. The backend runs both on open (`Backend.ensure_schema`) and refuses a newer index
(IndexTooNew). The run-health and comparison tables are created by store/tables/health.py and compares.py.
"""

from __future__ import annotations

from replay_service.store.index.backends import Dialect, Transaction
from replay_service.store.index.records import COUNT_COLUMNS, RequestStatus

__all__ = ["RUN_DELETED", "SCHEMA_VERSION", "SPAN_FIELDS", "ddl", "migrate", "spans_columns"]

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
# (store/tables/health.py) are new. A newer version than this one is refused (IndexTooNew).
SCHEMA_VERSION = 8  # 8: stale_feed
SPAN_FIELDS = "run_id, request_id, segment_id, row_start, row_count, pos_min, pos_max"
# A segment is indexed only while its run exists: a batch whose run was deleted while it was being written
# (retention.py) is refused at commit with this message (RunDeleted), never left as rows of no run.
RUN_DELETED = "run deleted while this batch was stored"


def ddl(d: Dialect) -> str:
    """Every core table and its indexes, in `d`'s dialect (`CREATE ... IF NOT EXISTS`: run on every open)."""
    text = "\n" + "".join(table(d) for table in _TABLES)
    if d.name != "sqlite":  # the feed's rows are hashes: compressing them (TOAST's default) cost 7x the insert itself
        text += "ALTER TABLE stale_feed ALTER COLUMN records SET STORAGE EXTERNAL;\n"
    else:
        text += f"""CREATE TRIGGER IF NOT EXISTS segments_of_a_run BEFORE INSERT ON segments
    WHEN NOT EXISTS (SELECT 1 FROM runs WHERE run_id = NEW.run_id)
    BEGIN SELECT RAISE(ABORT, '{RUN_DELETED}'); END;
"""
    return text


def _runs(d: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS runs (
    run_id {d.text} PRIMARY KEY,
    num_moe_layers {d.integer} NOT NULL,
    top_k {d.integer} NOT NULL,
    num_experts {d.integer} NOT NULL,
    moe_layers {d.text} NOT NULL,
    num_hidden_layers {d.integer} NOT NULL DEFAULT 0,
    source {d.text} NOT NULL,
    created_at {d.real} NOT NULL,
    bytes {d.integer} NOT NULL DEFAULT 0,
    load {d.blob},
    pinned {d.integer} NOT NULL DEFAULT 0,
    last_write {d.real}
);
"""


def _requests(d: Dialect) -> str:
    integer = d.integer
    return f"""CREATE TABLE IF NOT EXISTS requests (
    run_id {d.text} NOT NULL,
    request_id {d.text} NOT NULL,
    rows {integer} NOT NULL DEFAULT 0,
    pos_max {integer} NOT NULL DEFAULT -1,
    final_tokens {integer},
    status {d.text} NOT NULL DEFAULT '{RequestStatus.OPEN}',
    flag_bits {integer} NOT NULL DEFAULT 0,
    first_flagged {integer},
    {", ".join(f"{c} {integer} NOT NULL DEFAULT 0" for c in COUNT_COLUMNS)},
    referenced_rows {integer} NOT NULL DEFAULT 0,
    owner {d.text},
    recomputed {integer} NOT NULL DEFAULT 0,
    first_recomputed {integer},
    last_write {d.real},
    unclean {integer} NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, request_id)
);
CREATE INDEX IF NOT EXISTS requests_by_write ON requests (last_write);
"""


def _segments(d: Dialect) -> str:
    # SQLite: a trigger refuses a segment of no run (its file predates foreign keys being enforced, `ddl`);
    # PostgreSQL: a foreign key, which also locks the run row against a concurrent delete.
    run_guard = "" if d.name == "sqlite" else " REFERENCES runs (run_id)"
    return f"""CREATE TABLE IF NOT EXISTS segments (
    segment_id {d.serial_key},
    run_id {d.text} NOT NULL{run_guard},
    writer_id {d.text} NOT NULL,
    seq {d.integer} NOT NULL,
    path {d.text} NOT NULL,
    rows {d.integer} NOT NULL,
    bytes {d.integer} NOT NULL,
    digest {d.text} NOT NULL,
    UNIQUE (run_id, writer_id, seq)
);
"""


def spans_columns(d: Dialect) -> str:
    """The columns of `spans` (also those of the table a schema-2 file's spans are rebuilt into)."""
    # A span's id is the order a request came to hold its rows: among rows at one position, the first held
    # is served. For a request's own rows that is segment order; a span mirrored from a reference's source
    # (references.py) is held from when it was inserted, so a request's own earlier rows keep winning.
    return f"""
    span_id {d.serial_key},
    run_id {d.text} NOT NULL,
    request_id {d.text} NOT NULL,
    segment_id {d.integer} NOT NULL,
    row_start {d.integer} NOT NULL,
    row_count {d.integer} NOT NULL,
    pos_min {d.integer} NOT NULL,
    pos_max {d.integer} NOT NULL
"""


def _spans(d: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS spans ({spans_columns(d)});
CREATE INDEX IF NOT EXISTS spans_by_request ON spans (run_id, request_id, pos_min);
"""


def _row_flags(d: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS row_flags (
    run_id {d.text} NOT NULL,
    request_id {d.text} NOT NULL,
    position {d.integer} NOT NULL,
    flags {d.integer} NOT NULL,
    PRIMARY KEY (run_id, request_id, position)
);
"""


def _prefix_refs(d: Dialect) -> str:
    # Prefix-cache references: request R's positions [pos_start, pos_end) are the rows request S
    # (source_request_id) stored there; store/requests/references.py resolves them into spans of R that point at
    # S's segment rows, so rows are stored once.
    return f"""CREATE TABLE IF NOT EXISTS prefix_refs (
    run_id {d.text} NOT NULL,
    request_id {d.text} NOT NULL,
    pos_start {d.integer} NOT NULL,
    pos_end {d.integer} NOT NULL,
    source_request_id {d.text} NOT NULL,
    PRIMARY KEY (run_id, request_id, pos_start, pos_end, source_request_id)
){d.without_rowid};
CREATE INDEX IF NOT EXISTS prefix_refs_by_source ON prefix_refs (run_id, source_request_id, pos_start);
"""


def _versions(d: Dialect) -> str:
    # Weight versions (rows.md, "Weight versions"): version_spans holds, per request, the versions of the rows served
    # by the default rule as position spans; run_versions counts a run's served rows per version. (requests'
    # recomputed / first_recomputed count and locate positions recomputed under other weights.)
    return f"""CREATE TABLE IF NOT EXISTS version_spans (
    run_id {d.text} NOT NULL,
    request_id {d.text} NOT NULL,
    pos_start {d.integer} NOT NULL,
    pos_end {d.integer} NOT NULL,
    version {d.text} NOT NULL,
    PRIMARY KEY (run_id, request_id, pos_start)
){d.without_rowid};
CREATE TABLE IF NOT EXISTS run_versions (
    run_id {d.text} NOT NULL,
    version {d.text} NOT NULL,
    rows {d.integer} NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, version)
){d.without_rowid};
"""


def _stale_feed(d: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS stale_feed (
    feed_id {d.serial_key},
    host {d.text} NOT NULL,
    written_at {d.real} NOT NULL,
    records {d.blob} NOT NULL
);
"""


_TABLES = (_runs, _requests, _segments, _spans, _row_flags, _prefix_refs, _versions, _stale_feed)

# ---- migrations: SQLite files of every older release (their column names and types are SQLite's)
TABLE_COLUMNS = "SELECT name FROM pragma_table_info(?)"
RENAME_NUM_LAYERS = "ALTER TABLE runs RENAME COLUMN num_layers TO num_moe_layers"
ADD_NUM_HIDDEN_LAYERS = "ALTER TABLE runs ADD COLUMN num_hidden_layers INTEGER NOT NULL DEFAULT 0"
ADD_REFERENCED_ROWS = "ALTER TABLE requests ADD COLUMN referenced_rows INTEGER NOT NULL DEFAULT 0"
ADD_OWNER = "ALTER TABLE requests ADD COLUMN owner TEXT"
ADD_PINNED = "ALTER TABLE runs ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0"
ADD_LAST_WRITE = "ALTER TABLE runs ADD COLUMN last_write REAL"


def rebuild_spans(d: Dialect) -> tuple[str, ...]:
    """Schema 3: spans rebuilt with a span_id, in segment order (the order their rows were served in)."""
    return (
        f"CREATE TABLE spans_v3 ({spans_columns(d)})",
        f"INSERT INTO spans_v3 ({SPAN_FIELDS}) SELECT {SPAN_FIELDS} FROM spans ORDER BY segment_id, rowid",
        "DROP TABLE spans",  # drops spans_by_request too; the schema creates it again
        "ALTER TABLE spans_v3 RENAME TO spans",
    )


def add_recomputed(d: Dialect) -> tuple[str, ...]:
    """Both backends, schema 6 (weight versions): columns added, nothing rewritten."""
    if_new = "" if d.name == "sqlite" else " IF NOT EXISTS"
    return (f"ALTER TABLE requests ADD COLUMN{if_new} recomputed {d.integer} NOT NULL DEFAULT 0",
            f"ALTER TABLE requests ADD COLUMN{if_new} first_recomputed {d.integer}")


def add_request_last_write(d: Dialect) -> tuple[str, ...]:
    """Both backends, schema 7 (run health): when a request was last written (health windows), unclean rows."""
    if_new = "" if d.name == "sqlite" else " IF NOT EXISTS"
    return (f"ALTER TABLE requests ADD COLUMN{if_new} last_write {d.real}",
            f"ALTER TABLE requests ADD COLUMN{if_new} unclean {d.integer} NOT NULL DEFAULT 0")


def migrate(d: Dialect, tx: Transaction, found: int) -> None:
    """Bring an index of schema `found` up to SCHEMA_VERSION, inside `tx` (a crash leaves it as it was).

    SQLite files of every older release; a PostgreSQL database from 5 (it started there). New tables come
    from `ddl`, run after this.
    """
    if d.name != "sqlite":
        if found:  # a database of schema 5: the weight-version columns (IF NOT EXISTS: a half-done start)
            _run(tx, add_recomputed(d))
            _run(tx, add_request_last_write(d))  # schema 6 and older
        return
    if found == 0 and not _columns(tx, "runs"):
        return  # a new index: the schema creates every table as it is now
    runs, requests, spans = (_columns(tx, t) for t in ("runs", "requests", "spans"))
    if "num_layers" in runs:
        tx.execute(RENAME_NUM_LAYERS)
    if runs and "num_hidden_layers" not in runs:
        tx.execute(ADD_NUM_HIDDEN_LAYERS)
    if runs and "pinned" not in runs:
        tx.execute(ADD_PINNED)
    if runs and "last_write" not in runs:
        tx.execute(ADD_LAST_WRITE)
    if requests and "referenced_rows" not in requests:
        tx.execute(ADD_REFERENCED_ROWS)
    if requests and "owner" not in requests:
        tx.execute(ADD_OWNER)
    if requests and "recomputed" not in requests:
        _run(tx, add_recomputed(d))
    if requests and "last_write" not in requests:
        _run(tx, add_request_last_write(d))
    if spans and "span_id" not in spans:
        _run(tx, rebuild_spans(d))


def _run(tx: Transaction, statements: tuple[str, ...]) -> None:
    for statement in statements:
        tx.execute(statement)


def _columns(tx: Transaction, table: str) -> set[str]:
    # A table without columns does not exist yet.
    return {row["name"] for row in tx.execute(TABLE_COLUMNS, (table,))}
