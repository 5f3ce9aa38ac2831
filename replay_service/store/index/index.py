"""The index's typed API: `Index` (reads, and writes outside an ingest) and `IndexTransaction` (one transaction).

The index answers which rows of which segment hold a request without scanning any file, keeps per-request and
per-run counters, the idempotency key `(run_id, writer_id, seq)` of every stored batch, prefix-cache references,
weight versions and the STALE table's feed. Callers use these typed methods, never SQL text. The statements they
run are statements.py's (one group per table), the tables and migrations schema.py's, the value types
records.py's; where the rows live is a backend (backends/: a SQLite file beside the segments, or a PostgreSQL
database several replicas share). Other tables (store/tables/) run their own statements through `query` /
`IndexTransaction.execute`.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from operator import itemgetter
from pathlib import Path

import numpy as np

from replay_format import Flag, RunShape
from replay_service.store.index.backends import Backend, Cursor, Params, Row, Transaction, open_backend
from replay_service.store.index.records import (
    COUNT_COLUMNS,
    COUNTED_FLAGS,
    FeedEntry,
    HeldRows,
    RequestCounts,
    RequestSpans,
    RequestStatus,
    load_of,
)
from replay_service.store.index.schema import SCHEMA_VERSION, ddl, migrate
from replay_service.store.index.statements import Sql

__all__ = ["Index", "IndexTransaction"]

_COUNTS = tuple(zip(COUNTED_FLAGS, COUNT_COLUMNS))  # (flag, its `requests` column)


class Index:
    """The index of one store: reads are methods, writes go through `transaction()`.

    `target`: the path of a SQLite file, or a `postgresql://` URL (backends/).
    """

    def __init__(self, target: str | Path, fsync: bool = True, shared: bool = False) -> None:
        """Open (creating or migrating) the index `target` names; `shared`: other processes of this service write
        the same SQLite file (`serve`'s workers), so no run row may be kept in memory (a PostgreSQL index always is)."""
        self.backend: Backend = open_backend(target, fsync=fsync)
        self._shared = shared
        self.sql = Sql(self.backend.dialect)
        try:
            self.backend.ensure_schema(SCHEMA_VERSION, ddl(self.backend.dialect),
                                       functools.partial(migrate, self.backend.dialect))
        except BaseException:
            self.backend.close()
            raise

    @property
    def conn(self):  # noqa: ANN201 - sqlite3.Connection; SQLite only (reindex checkpoints the file it built)
        """The SQLite connection (a SQLite index only)."""
        return self.backend.conn  # type: ignore[attr-defined]

    # ---- generic access (store/tables/: the run-health and comparison stores run their own statements)

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
        return self.one(self.sql.runs.select_run, (run_id,))

    def runs(self) -> list[Row]:
        """Every `runs` row, by run id."""
        return self.query(self.sql.runs.select_runs)

    def count_runs(self) -> int:
        """How many runs exist (cheap: no per-run aggregation)."""
        row = self.one(self.sql.runs.count_runs)
        return int(row["n"]) if row else 0

    def run_aggregate(self, run_id: str) -> Row:
        """Sums over a run's requests: requests, rows, ended, gap and one column per counted flag."""
        row = self.one(self.sql.runs.run_aggregate, (run_id,))
        assert row is not None  # an aggregate always answers one row
        return row

    def stored_digest(self, run_id: str, writer_id: str, seq: int) -> str | None:
        """The digest of the batch stored under this idempotency key, if any."""
        row = self.one(self.sql.spans.select_digest, (run_id, writer_id, seq))
        return row["digest"] if row else None

    def indexed_paths(self) -> set[str]:
        """Every segment path the index names (relative to the segment root)."""
        return {row["path"] for row in self.query(self.sql.spans.select_paths)}

    def names_segment(self, run_id: str, path: str) -> bool:
        """Whether the index still names the segment at `path` (relative to the segment root) of `run_id`."""
        return bool(self.query(self.sql.spans.segment_named, (run_id, path)))

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[Row]:
        """A request's spans touching positions `[pos_lo, pos_hi]`, in the order it came to hold them.

        Each: segment_id, row_start, row_count, pos_min, pos_max, path. Inside a transaction (same thread)
        this sees the transaction's own writes.
        """
        return self.query(self.sql.spans.spans_overlapping, (run_id, request_id, pos_lo, pos_hi))

    def spans_of_requests(self, run_id: str, request_ids: Sequence[str]) -> dict[str, RequestSpans]:
        """Every span of each of `request_ids` (as `spans` holds them, in span order), in one query: a trainer
        slice's sequences. A request without spans is absent."""
        rows = self.query(self.sql.spans.spans_of_requests, (run_id, json.dumps(list(dict.fromkeys(request_ids)))))
        if not rows:
            return {}
        requests, paths, starts, counts, lows, highs = (list(map(itemgetter(name), rows)) for name in (
            "request_id", "path", "row_start", "row_count", "pos_min", "pos_max"))
        out = {}
        a = 0
        for b in range(1, len(rows) + 1):  # rows come grouped by request
            if b == len(rows) or requests[b] != requests[a]:
                out[requests[a]] = RequestSpans(paths[a:b], starts[a:b], counts[a:b], lows[a:b], highs[a:b])
                a = b
        return out

    def pieces_held(self, run_id: str, pieces: Sequence[tuple[str, int, int]]) -> set[int]:
        """Which of `pieces` (`(request_id, pos_lo, pos_hi)` each) name a request holding rows in a span touching
        positions `[pos_lo, pos_hi]`: their indexes, in one query. Sees the thread's own transaction as `spans`."""
        if not pieces:
            return set()
        return {int(r["piece"]) for r in self.query(self.sql.spans.pieces_held, (json.dumps(pieces), run_id))}

    def count_references(self, run_id: str) -> int:
        """How many distinct prefix-cache references a run received."""
        row = self.one(self.sql.references.count_references, (run_id,))
        return int(row["n"]) if row else 0

    def request(self, run_id: str, request_id: str) -> Row | None:
        """The `requests` row of a request."""
        return self.one(self.sql.requests.select_request, (run_id, request_id))

    def requests_of(self, run_id: str, request_ids: Sequence[str]) -> dict[str, Row]:
        """The `requests` rows of these requests, by id, in one query (a request without a row is absent)."""
        rows = self.query(self.sql.requests.select_requests, (run_id, json.dumps(list(dict.fromkeys(request_ids)))))
        return {r["request_id"]: r for r in rows}

    def requests_page(self, run_id: str, flag: Flag | None, cursor: str | None, limit: int) -> list[Row]:
        """Up to `limit` requests after `cursor` by id, those with `flag` only when given."""
        return self.query(self.sql.requests.list_requests[flag], (run_id, cursor or "", limit))

    def version_spans(self, run_id: str, request_ids: Sequence[str]) -> dict[str, list[tuple[str, int, int]]]:
        """The version spans `(version, pos_start, pos_end)` of the rows served by the default rule, per request
        (those with any), by position; adjacent spans of one version are not merged here (summaries.py does)."""
        out: dict[str, list[tuple[str, int, int]]] = {}
        for r in self.query(self.sql.versions.version_spans_of, (run_id, json.dumps(list(request_ids)))):
            out.setdefault(r["request_id"], []).append((r["version"], r["pos_start"], r["pos_end"]))
        return out

    def run_versions(self, run_id: str) -> dict[str, int]:
        """A run's rows served by the default rule per known weight version (version -> rows)."""
        return {r["version"]: r["rows"] for r in self.query(self.sql.versions.select_run_versions, (run_id,))}

    def late_flags(self, run_id: str, request_id: str, start: int, end: int) -> dict[int, int]:
        """Flags recorded for positions `[start, end)` after their rows were stored (position -> bits)."""
        return {r["position"]: r["flags"]
                for r in self.query(self.sql.row_flags.row_flags_in_range, (run_id, request_id, start, end))}

    # ---- writes outside an ingest

    def register_run(self, run_id: str, shape: RunShape, source: str, created_at: float) -> bool:
        """Insert a new run's row; False when it exists already (another replica created it meanwhile)."""
        with self.transaction() as tx:
            return tx.execute(self.sql.runs.insert_run, (
                run_id, shape.num_moe_layers, shape.top_k, shape.num_experts, json.dumps(list(shape.moe_layers)),
                shape.num_hidden_layers, source, created_at)).rowcount == 1

    def learn_num_hidden_layers(self, run_id: str, num_hidden_layers: int, was: int) -> bool:
        """Record a learnt layer count where the run still has `was`; False when it changed meanwhile (another
        replica learnt one, or the run was deleted): the caller reads the run again."""
        with self.transaction() as tx:
            return tx.execute(self.sql.runs.learn_num_hidden_layers, (num_hidden_layers, run_id, was)).rowcount == 1

    def set_pinned(self, run_id: str, pinned: bool) -> bool:
        """Pin (retention never deletes it) or unpin a run; False when the run does not exist."""
        with self.transaction() as tx:
            return tx.execute(self.sql.runs.set_pinned, (int(pinned), run_id)).rowcount == 1

    def publish_recent(self, host: str, written_at: float, records: bytes) -> None:
        """Add one entry of recently stored rows to the STALE table's feed (ingest/stale_feed.py)."""
        with self.transaction() as tx:
            tx.execute(self.sql.feed.feed_publish, (host, written_at, records))

    def published_ids(self, after: int, since: float, other_than: str, limit: int) -> list[int]:
        """The numbers of the feed's entries above `after`, written at `since` or later by hosts other than
        `other_than`, in order (at most `limit`)."""
        return [int(r["feed_id"]) for r in self.query(self.sql.feed.feed_since, (after, since, other_than, limit))]

    def published(self, first: int, last: int, other_than: str) -> list[FeedEntry]:
        """The feed's entries numbered `first` to `last` by hosts other than `other_than`, with their rows."""
        return [FeedEntry(int(r["feed_id"]), r["host"], bytes(r["records"]))
                for r in self.query(self.sql.feed.feed_records, (first, last, other_than))]

    def prune_published(self, before: float) -> None:
        """Drop the feed's entries written before `before`."""
        with self.transaction() as tx:
            tx.execute(self.sql.feed.feed_prune, (before,))

    def set_created_at(self, run_id: str, created_at: float) -> None:
        """Set a run's creation time (reindex: the time its journal recorded, not when it was rebuilt)."""
        with self.transaction() as tx:
            tx.execute(self.sql.runs.set_created_at, (created_at, run_id))


class IndexTransaction:
    """The writes of one transaction (typed: the statements are statements.py's `Sql`)."""

    def __init__(self, tx: Transaction, sql: Sql) -> None:
        self.tx = tx
        self.sql = sql

    def execute(self, sql: str, params: Params = ()) -> Cursor:
        """One statement in this transaction (for tables kept elsewhere: store/tables/)."""
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
        return self.tx.execute(self.sql.requests.select_request, (run_id, request_id)).fetchone()

    def set_final(self, run_id: str, request_id: str, num_tokens: int, status: RequestStatus) -> None:
        """Record a request's end (creating its row when no rows arrived yet)."""
        self.tx.execute(self.sql.requests.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.requests.set_final, (num_tokens, str(status), time.time(), run_id, request_id))

    def owners(self, run_id: str, request_ids: list[str]) -> dict[str, str]:
        """The owners of those of `request_ids` that have one (request id -> owner)."""
        return {r["request_id"]: r["owner"] for r in
                self.tx.execute(self.sql.requests.select_owners, (run_id, json.dumps(request_ids)))}

    def claim(self, run_id: str, request_id: str, owner: str) -> None:
        """Make `owner` the request's owner when it has none (creating its row)."""
        self.tx.execute(self.sql.requests.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.requests.claim_request, (owner, run_id, request_id))

    def insert_segment(self, run_id: str, writer_id: str, seq: int, path: str, rows: int, size: int,
                       digest: str) -> int:
        """A segment's row; returns its segment id (a later segment of a run has a larger id)."""
        cur = self.tx.execute(self.sql.spans.insert_segment, (run_id, writer_id, seq, path, rows, size, digest))
        return int(cur.fetchall()[0]["segment_id"])

    def insert_spans(self, run_id: str, held: Sequence[HeldRows]) -> None:
        """The `spans` rows of `held` (each: rows of a segment a request now holds)."""
        self.tx.execute_many(self.sql.spans.insert_span, [(run_id, h.request_id, h.segment_id, h.row_start, h.row_count,
                                                     h.pos_min, h.pos_max) for h in held])

    def add_counts(self, run_id: str, counts: Sequence[RequestCounts]) -> None:
        """Add each of `counts` to its request's counters (creating its row), in two statements for them all."""
        if not counts:
            return
        now = time.time()
        self.tx.execute_many(self.sql.requests.ensure_request, [(run_id, c.request_id) for c in counts])
        self.tx.execute_many(self.sql.requests.add_to_request, [
            {"run_id": run_id, "request_id": c.request_id, "rows": c.rows, "pos_max": c.pos_max,
             "flag_bits": c.flag_bits, "first_flagged": c.first_flagged, "referenced": c.referenced, "now": now,
             "unclean": c.unclean, **{column: int(c.counts.get(f, 0)) for f, column in _COUNTS}}
            for c in counts])

    def add_versions(self, run_id: str, request_id: str, spans: Sequence[tuple[str, int, int]]) -> None:
        """Record the versions of rows newly served at positions `[start, end)` (`(version, start, end)` each), and
        count them in the run's rows per version. Each position is served once, so spans never overlap."""
        if not spans:
            return
        pieces = json.dumps([list(s) for s in spans])
        self.tx.execute(self.sql.versions.insert_version_spans, (run_id, request_id, pieces))
        per_version: dict[str, int] = {}
        for version, start, end in spans:
            per_version[version] = per_version.get(version, 0) + end - start
        for version, rows in sorted(per_version.items()):
            self.tx.execute(self.sql.versions.add_run_version, (run_id, version, rows))

    def add_recomputed(self, run_id: str, request_id: str, positions: Sequence[int]) -> None:
        """Count positions newly recomputed under other weights (each counted once: the caller's rule)."""
        if positions:
            first = int(min(positions))
            self.tx.execute(self.sql.versions.count_recomputed, (len(positions), first, first, run_id, request_id))

    def mark_conflict(self, run_id: str, request_id: str, position: int) -> bool:
        """CONFLICT on an already stored row (a later batch disagreed), counted once; False when already marked."""
        known = self.tx.execute(self.sql.row_flags.select_row_flags, (run_id, request_id, position)).fetchone()
        if known is not None and known["flags"] & Flag.CONFLICT:
            return False
        self.tx.execute(self.sql.row_flags.or_row_flags, (run_id, request_id, position, int(Flag.CONFLICT)))
        self.tx.execute(self.sql.row_flags.count_conflict, (position, position, run_id, request_id))
        return True

    def spans(self, run_id: str, request_id: str, pos_lo: int, pos_hi: int) -> list[Row]:
        """`Index.spans`, read inside this transaction."""
        return self.tx.execute(self.sql.spans.spans_overlapping, (run_id, request_id, pos_lo, pos_hi)).fetchall()

    def held_in_segment(self, run_id: str, request_id: str, segment_id: int, pos_lo: int,
                        pos_hi: int) -> list[tuple[int, int]]:
        """`(row_start, row_count)` of one segment's rows a request holds at positions meeting `[pos_lo, pos_hi]`."""
        return [(r["row_start"], r["row_count"]) for r in
                self.tx.execute(self.sql.spans.held_in_segment, (run_id, request_id, pos_hi, pos_lo, segment_id))]

    def insert_reference(self, run_id: str, request_id: str, start: int, end: int, source_request_id: str) -> bool:
        """Record a prefix-cache reference; False when it was recorded before (a retry or a replayed spill).

        The referencing request's row is created and its positions expected up to `end - 1`.
        """
        cur = self.tx.execute(self.sql.references.insert_reference, (run_id, request_id, start, end, source_request_id))
        if cur.rowcount != 1:
            return False
        self.tx.execute(self.sql.requests.ensure_request, (run_id, request_id))
        self.tx.execute(self.sql.references.expect_position, (end - 1, run_id, request_id))
        return True

    def references_from(self, run_id: str, pieces: list[tuple[str, int, int]]) -> list[tuple[int, str, int, int]]:
        """References naming the source of a piece `(source_request_id, pos_lo, pos_hi)` whose range meets its
        positions: `(piece index, request_id, start, end)`, by piece."""
        return [(r["piece"], r["request_id"], r["pos_start"], r["pos_end"]) for r in
                self.tx.execute(self.sql.references.references_from, (json.dumps(pieces), run_id))]

    def delete_run(self, run_id: str) -> int:
        """Delete every index row of a run (compares aside: compares.py); how many rows were deleted."""
        return sum(self.tx.execute(sql, (run_id,)).rowcount for sql in self.sql.runs.delete_run_rows)

    def run_load(self, run_id: str, shape: RunShape) -> np.ndarray:
        """A run's stored expert load `(num_moe_layers, num_experts)`, read inside this transaction (zeros when it
        has none, or no row: a run deleted meanwhile, refused when its segment is inserted).

        Read after `lock_runs`: no other replica's commit of the run can change it before this one ends.
        """
        row = self.tx.execute(self.sql.runs.select_run_load, (run_id,)).fetchone()
        return load_of(row["load"] if row is not None else None, shape)

    def add_run_totals(self, run_id: str, size: int, load: np.ndarray, written_ns: int) -> None:
        """Add a segment's bytes to its run, store the run's new expert load and its last write (the segment's)."""
        self.tx.execute(self.sql.runs.add_run_totals, (size, load.astype(np.int64).tobytes(), written_ns / 1e9, run_id))


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
