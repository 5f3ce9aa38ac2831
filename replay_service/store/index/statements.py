"""Every statement `Index` and `IndexTransaction` run on the core tables, grouped by table, in one dialect.

Each group is built once per index from the backend's `Dialect` (the few words that differ); statements use `?`
and `:name` parameters (the backend converts). `Sql` holds one of each group: a method runs
`self.sql.<group>.<statement>`, and callers of the index never see SQL text. Not here: the tables' DDL and
migrations (schema.py), and the statements of store/tables/health.py (the run-health tables, and its sums over
`requests`, `runs`, `run_versions`) and store/tables/compares.py, run through `Index.query` / `.execute`.
"""

from __future__ import annotations

from replay_format import Flag
from replay_service.store.index.backends import Dialect
from replay_service.store.index.records import (
    COUNT_COLUMNS,
    COUNTED_FLAGS,
    EXPECTED_ROWS,
    RequestStatus,
    count_column,
)
from replay_service.store.index.schema import SPAN_FIELDS

__all__ = ["FeedSql", "ReferenceSql", "RequestSql", "RowFlagSql", "RunSql", "SpanSql", "Sql", "VersionSql"]


def _total(expr: str, integer: str) -> str:
    """A sum as an integer on both backends (PostgreSQL sums BIGINT as NUMERIC)."""
    return f"CAST(COALESCE(SUM({expr}), 0) AS {integer})"


class FeedSql:
    """`stale_feed`: the STALE table's feed between hosts (ingest/stale_feed.py)."""

    def __init__(self, d: Dialect) -> None:
        self.feed_publish = "INSERT INTO stale_feed (host, written_at, records) VALUES (?, ?, ?)"
        self.feed_since = ("SELECT feed_id FROM stale_feed WHERE feed_id > ? AND written_at >= ? AND host <> ?"
                           " ORDER BY feed_id LIMIT ?")
        self.feed_records = ("SELECT feed_id, host, records FROM stale_feed WHERE feed_id BETWEEN ? AND ? AND host <> ?"
                             " ORDER BY feed_id")
        self.feed_prune = "DELETE FROM stale_feed WHERE written_at < ?"


class RunSql:
    """`runs`, a run's sums over its requests, and deleting a run from every table (retention.py)."""

    def __init__(self, d: Dialect) -> None:
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
                               f" last_write = {d.greatest}(COALESCE(last_write, 0), ?) WHERE run_id = ?")
        self.set_pinned = "UPDATE runs SET pinned = ? WHERE run_id = ?"
        # Every table holding the run's rows, in one transaction (segments before runs: the foreign key).
        self.delete_run_rows = tuple(f"DELETE FROM {table} WHERE run_id = ?"
                                     for table in ("spans", "row_flags", "prefix_refs", "version_spans",
                                                   "run_versions", "requests", "segments", "runs"))
        open_ = f"{chr(39)}{RequestStatus.OPEN}{chr(39)}"
        self.run_aggregate = (
            f"SELECT COUNT(*) AS requests, {_total('rows', d.integer)} AS rows,"
            f" {_total(f'CASE WHEN status != {open_} THEN 1 ELSE 0 END', d.integer)} AS ended,"
            f" {_total(f'{d.greatest}({EXPECTED_ROWS} - rows, 0)', d.integer)} AS gap,"
            f" {_total('referenced_rows', d.integer)} AS referenced_rows,"
            f" {_total('recomputed', d.integer)} AS recomputed, "
            + ", ".join(f"{_total(c, d.integer)} AS {c}" for c in COUNT_COLUMNS)
            + " FROM requests WHERE run_id = ?"
        )


class SpanSql:
    """`segments` (idempotency keys, paths) and `spans` (which rows of which segment a request holds)."""

    def __init__(self, d: Dialect) -> None:
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
        # Every span of many requests (a trainer slice's), each request's in the order it came to hold them.
        self.spans_of_requests = (
            "SELECT s.request_id, g.path, s.row_start, s.row_count, s.pos_min, s.pos_max FROM spans s"
            f" JOIN segments g USING (segment_id) WHERE s.run_id = ? AND s.request_id IN ({d.json_texts})"
            " ORDER BY s.request_id, s.span_id"
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


class ReferenceSql:
    """`prefix_refs`: prefix-cache references (references.py)."""

    def __init__(self, d: Dialect) -> None:
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
        self.expect_position = (f"UPDATE requests SET pos_max = {d.greatest}(pos_max, ?)"
                                " WHERE run_id = ? AND request_id = ?")


class RequestSql:
    """`requests`: counters (as col = col + x: no lost update beside another replica's commit), ends, owners."""

    def __init__(self, d: Dialect) -> None:
        self.select_request = "SELECT * FROM requests WHERE run_id = ? AND request_id = ?"
        self.select_requests = f"SELECT * FROM requests WHERE run_id = ? AND request_id IN ({d.json_texts})"
        self.ensure_request = "INSERT INTO requests (run_id, request_id) VALUES (?, ?) ON CONFLICT DO NOTHING"
        self.add_to_request = (
            "UPDATE requests SET rows = rows + :rows, referenced_rows = referenced_rows + :referenced,"
            f" pos_max = {d.greatest}(pos_max, :pos_max), flag_bits = flag_bits | :flag_bits, last_write = :now,"
            " unclean = unclean + :unclean,"
            f" first_flagged = CASE WHEN CAST(:first_flagged AS {d.integer}) IS NULL THEN first_flagged"
            f" ELSE {d.least}(COALESCE(first_flagged, :first_flagged), :first_flagged) END, "
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


class VersionSql:
    """Weight versions: `version_spans` (the served rows' versions), `run_versions` (rows per version), and
    `requests.recomputed` / `first_recomputed` (positions recomputed under other weights)."""

    def __init__(self, d: Dialect) -> None:
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
            f" first_recomputed = {d.least}(COALESCE(first_recomputed, ?), ?) WHERE run_id = ? AND request_id = ?"
        )


class RowFlagSql:
    """`row_flags`: per-position verdicts that arrive after the row was stored (CONFLICT with a later batch)."""

    def __init__(self, d: Dialect) -> None:
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
            f" first_flagged = {d.least}(COALESCE(first_flagged, ?), ?) WHERE run_id = ? AND request_id = ?"
        )


class Sql:
    """The statements of every core table in one dialect, one group per table (built once per `Index`)."""

    def __init__(self, d: Dialect) -> None:
        self.feed = FeedSql(d)
        self.runs = RunSql(d)
        self.spans = SpanSql(d)
        self.references = ReferenceSql(d)
        self.requests = RequestSql(d)
        self.versions = VersionSql(d)
        self.row_flags = RowFlagSql(d)
