"""The route store: runs, requests and their rows in one data directory; `RouteStore` is the service's one handle.

    index/       the SQL index (SQLite beside the segments, or PostgreSQL shared by replicas)
    segments/    the segment files: written, sealed, read back; local files or a bucket
    requests/    a request's rows read, references resolved, ends and summaries
    tables/      run-health and comparison tables        lifecycle/   journals and retention
    runs.py      the run registry

Contract: what the index names is durable and served verified; nothing here imports the ingest pipeline, which
stands above the store and stores batches through it. Design: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from replay_format import Flag, RunShape
from replay_format.request_notes import Reference
from replay_format.weight_versions import RecomputeRule, check_label
from replay_service.errors import Conflict, InvalidInput, NotFound, RunDeleted
from replay_service.ownership import claim_requests, current_actor, require_owner
from replay_service.placement import on_loop
from replay_service.placement.processes import Processes, pool_id
from replay_service.settings import ReadPlace, ServiceSettings
from replay_service.store.index import Index, RequestStatus, Row, load_of
from replay_service.store.lifecycle.journal import open_journal
from replay_service.store.lifecycle.retention import Removed, collect_orphans, due, empty_trash, removed, to_trash
from replay_service.store.requests.ends import upload_end
from replay_service.store.requests.kept import Keep
from replay_service.store.requests.references import Resolution, Resolver
from replay_service.store.requests.rows import KnownSpans, Located, RouteRows, RowReader
from replay_service.store.requests.summaries import RequestPage, RequestRecord, RunRecord
from replay_service.store.runs import RunRegistry, RunState
from replay_service.store.segments.cache import QUARANTINE_DIR, SegmentCache, Sweep, require_index, sweep_unindexed
from replay_service.store.segments.places import LocalSegments, S3Segments, open_segment_store
from replay_service.store.tables.compares import CompareStore
from replay_service.store.tables.health import HealthTables

__all__ = ["Processes", "RequestStatus", "RouteRows", "RouteStore", "index_target"]


def index_target(settings: ServiceSettings) -> str | Path:
    """The index settings name: REPLAY_INDEX_URL (PostgreSQL), or `<data_dir>/index.sqlite` when unset."""
    return settings.index_url or Path(settings.data_dir) / "index.sqlite"


def _keep(run: RunState, request: RequestRecord) -> Keep:
    """What a read keeping its request's location is taken under (`requests/kept.py`)."""
    return Keep(run.created_at, request, request.expected_rows)


def _no_request(run_id: str, request_id: str) -> NotFound:
    return NotFound(f"request {request_id!r} not found in run {run_id!r}")


class RouteStore:
    """Runs, requests and their rows in one data directory: ingest, finish, reads and summaries."""

    def __init__(self, settings: ServiceSettings, processes: Processes = Processes.ONE) -> None:
        """Open the data directory `settings` name (and its index and bucket, when set there).

        `processes`: this process alone, or one of `serve`'s workers (placement/processes.py: no run row kept, the
        start-up checks and sweep left to the parent). Batches are stored by an ingest pipeline built over the
        opened store (`replay_service.ingest.pipeline.IngestPipeline.over`).
        """
        self.settings = settings
        self.root = Path(settings.data_dir)
        self.segments_root = self.root / "runs"
        self.segments_root.mkdir(parents=True, exist_ok=True)  # local segments and journals (unused with a bucket)
        self.segments = open_segment_store(self.root, settings.segments_url)
        self.segments.check()  # SegmentStoreUnreachable: an unusable bucket refuses the start, naming it
        # A SQLite file beside the segments, or a PostgreSQL database several replicas share (index/backends/);
        # IndexUnreachable / IndexTooNew refuse the start, naming REPLAY_INDEX_URL.
        if processes is Processes.WORKER:
            self.index = Index(index_target(settings), fsync=settings.fsync, shared=True)
            self.swept = Sweep()
        else:
            self.index = self._open_and_sweep(settings)
            empty_trash(self.root)  # what a delete interrupted by a crash left (retention.py)
        self.journal = open_journal(self.segments, self.segments_root, fsync=settings.fsync)
        self.cache = SegmentCache(self.segments, settings.open_segment_cache, settings.open_segment_cache_bytes,
                                  indexed=self.index.names_segment,
                                  pool=pool_id(processes))
        self.reader = RowReader(self.index, self.cache, settings.kept_locations_bytes)
        self.registry = RunRegistry(self.index)
        self.compares = CompareStore(self.root / "compares", self.index, fsync=settings.fsync,
                                     bucket=self.segments if isinstance(self.segments, S3Segments) else None)
        self.health = HealthTables(self.index)

    def close(self) -> None:
        """Stop checking new segments in the background, then close the index (close an ingest pipeline over this
        store first)."""
        self.cache.close()
        self.index.close()

    def _open_and_sweep(self, settings: ServiceSettings) -> Index:
        """The index, after the start-up checks of index against segments; unindexed local segments swept."""
        index_path = self.root / "index.sqlite"
        # Other replicas may be writing beside this one (a PostgreSQL index: replicas share it): a segment younger
        # than REPLAY_ORPHAN_GRACE_S may be one of their ingests about to commit, so the start-up checks leave it
        # alone. A SQLite index has this process alone (or `serve`'s parent, before its workers start): every
        # unindexed segment is its past (grace 0).
        grace = settings.orphan_grace_s if settings.index_url is not None else 0.0
        if settings.index_url is None and not index_path.exists():
            require_index(self.segments, set(), self.root, grace)  # refused before an empty index file is made
        index = Index(index_target(settings), fsync=settings.fsync)
        indexed = index.indexed_paths()
        try:
            # an index naming no segment beside segments
            require_index(self.segments, indexed, self.root, grace, shared_index=settings.index_url is not None)
        except Exception:
            index.close()
            raise
        # Local files only: in a shared bucket an unindexed object may be another replica's ingest about to
        # commit; those are deleted after REPLAY_ORPHAN_GRACE_S instead (retention.collect_orphans). Local files
        # shared by several processes (PostgreSQL index) are swept once older than that grace only.
        self.swept = (sweep_unindexed(self.segments.root, indexed, self.root / QUARANTINE_DIR, grace)
                      if isinstance(self.segments, LocalSegments) else Sweep())
        return index

    # ---- writes

    def journal_run_created(self, run_id: str) -> None:
        """Record in the run's journal that it was created (when it exists): the ingest pipeline calls it after the
        first batch of a new run is stored."""
        run = self.index.run(run_id)
        if run is not None:
            self.journal.run_created(run_id, run["created_at"])

    def finish(self, run_id: str, request_id: str, num_tokens: int, status: RequestStatus | str) -> RequestRecord:
        """Record a request's end with T = `num_tokens`; the request summary.

        Conflict when it ended otherwise, or when T contradicts its stored rows (a finish never cuts rows);
        Forbidden when another writer owns the request (ownership.py); the caller claims an unowned one.
        """
        status = RequestStatus(status)
        self.registry.require(run_id)
        actor = current_actor()
        with self.index.transaction() as tx:
            row = tx.request(run_id, request_id)
            require_owner(run_id, request_id, row["owner"] if row is not None else None)
            if row is not None and row["final_tokens"] is not None and (
                row["final_tokens"] != num_tokens or row["status"] != status
            ):
                raise Conflict(
                    f"request {request_id!r} was already {row['status']} with {row['final_tokens']} tokens; "
                    f"got {status} with {num_tokens}")
            if row is not None and row["pos_max"] > num_tokens - 2:  # pos_max: stored (or referenced) rows
                raise Conflict(
                    f"request {request_id!r} has rows up to position {row['pos_max']}, so at least "
                    f"{row['pos_max'] + 2} tokens; a finish with num_tokens={num_tokens} would leave "
                    f"{max(num_tokens - 1, 0)} rows of {row['pos_max'] + 1}: refused, stored rows are never cut")
            if actor is not None:
                tx.claim(run_id, request_id, actor.owner)
            tx.set_final(run_id, request_id, num_tokens, status)
        self.journal.request_end(run_id, request_id, num_tokens, status)
        return self.request_summary(run_id, request_id)

    def add_references(self, run_id: str, references: list[Reference]) -> Resolution:
        """Record prefix-cache references of a run and resolve those whose source rows are stored (references.py).

        Idempotent on (run, request, start, end, source); NotFound for an unknown run. One transaction,
        under the run's commit lock: a reference and its source's rows resolve once, in either order.
        """
        run = self.registry.require(run_id)
        with run.lock, self.index.transaction() as tx:
            tx.lock_runs([run_id])  # and every other replica's commits of this run (PostgreSQL)
            claim_requests(tx, run_id, [r.request_id for r in references])  # a reference writes to its request
            resolution = Resolver(tx, self.reader, run_id, run.shape).add(references)
        self.journal.references(run_id, references)
        return resolution

    def check_upload(self, run_id: str, request_id: str, start: int, num_tokens: int, finish: bool) -> None:
        """Conflict, before anything is stored, when an upload of rows `start .. num_tokens-2` cannot land (ends.py)."""
        if self.registry.get(run_id) is not None:
            upload_end(self.index.request(run_id, request_id), request_id, start, num_tokens, finish)

    def end_upload(self, run_id: str, request_id: str, start: int, num_tokens: int, finish: bool) -> None:
        """Move the request's end after an upload's rows were stored: finish it, extend it by a turn, or leave it."""
        with self.index.transaction() as tx:
            end = upload_end(tx.request(run_id, request_id), request_id, start, num_tokens, finish)
            if end is not None:
                tx.set_final(run_id, request_id, end, RequestStatus.FINISHED)
        if end is not None:
            self.journal.request_end(run_id, request_id, end, RequestStatus.FINISHED)

    # ---- runs

    def run_shape(self, run_id: str) -> RunShape:
        """A run's shape; NotFound when it does not exist."""
        return self.registry.require(run_id).shape

    def has_run(self, run_id: str) -> bool:
        """Whether the run exists."""
        return self.registry.get(run_id) is not None

    def run_count(self) -> int:
        """How many runs exist (cheap: no summaries)."""
        return self.index.count_runs()

    def runs(self) -> list[RunRecord]:
        """Every run's summary, by run id."""
        return [self._run_record(run) for run in self.index.runs()]

    def delete_run(self, run_id: str, reason: str = "requested") -> Removed:
        """Delete a run's index rows and files, safely beside reads and writes; NotFound when there is none.

        In order: the segment cache forgets the run; under its commit lock it is marked deleted (a read that saw
        its rows gone answers RunDeleted) and one index transaction deletes its rows; its objects leave the bucket
        and its folders go to the trash; the registry forgets it, so the next batch of its id starts a fresh run.
        """
        state = self.registry.require(run_id)
        self.cache.forget_run(run_id)
        with state.lock:
            state.deleted = True  # before its index rows go: a read that saw them gone sees the mark after
            try:
                with self.index.transaction() as tx:
                    tx.lock_runs([run_id])  # after any other replica's commit of this run (PostgreSQL)
                    rows = tx.delete_run(run_id) + self.compares.delete_rows(tx, run_id)
                    self.health.delete_rows(tx, run_id)  # not counted: a run of no rows has none either
                    if rows == 0:
                        raise NotFound(f"run {run_id!r} not found")
            except BaseException:
                state.deleted = False
                raise
            objects = (self.segments.delete_run(run_id) + self.journal.delete_run(run_id)  # a bucket's
                       + self.compares.delete_objects(run_id))
            trash = to_trash(self.root, [self.segments_root / run_id, self.compares.root / run_id])
        self.registry.forget(run_id)
        return removed(run_id, rows, trash, objects, reason)

    def retention_pass(self, max_bytes: int, max_age_s: float, now: float | None = None) -> list[Removed]:
        """One retention pass: delete the runs `due` names (a run deleted meanwhile is skipped), then the bucket's
        orphans older than REPLAY_ORPHAN_GRACE_S; the runs removed."""
        gone = []
        for run_id, reason in due(self.index.runs(), max_bytes, max_age_s, time.time() if now is None else now):
            try:
                gone.append(self.delete_run(run_id, reason))
            except NotFound:
                continue
        collect_orphans(self.segments, self.index, self.settings.orphan_grace_s)  # logs each one it deletes
        return gone

    def pin(self, run_id: str, pinned: bool) -> RunRecord:
        """Pin (retention never deletes it) or unpin a run; its summary. NotFound when it does not exist."""
        if not self.index.set_pinned(run_id, pinned):
            raise NotFound(f"run {run_id!r} not found")
        return self.run_summary(run_id)

    def run_summary(self, run_id: str) -> RunRecord:
        """One run's summary."""
        run = self.index.run(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return self._run_record(run)

    def _run_record(self, run: Row) -> RunRecord:
        run_id = run["run_id"]
        return RunRecord.of(run, self.index.run_aggregate(run_id), self.index.count_references(run_id),
                            self.index.run_versions(run_id))

    def expert_load(self, run_id: str) -> tuple[RunShape, np.ndarray]:
        """A run's shape and its served clean rows' expert counts `(num_moe_layers, num_experts)`."""
        shape = self.registry.require(run_id).shape
        run = self.index.run(run_id)  # the index's count, every replica's batches (commit.py)
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return shape, load_of(run["load"], shape)

    # ---- requests

    def _request(self, run_id: str, request_id: str) -> Row:
        self.registry.require(run_id)
        return self._request_row(run_id, request_id)

    def _request_row(self, run_id: str, request_id: str) -> Row:
        row = self.index.request(run_id, request_id)
        if row is None:
            raise _no_request(run_id, request_id)
        return row

    def request_summary(self, run_id: str, request_id: str) -> RequestRecord:
        """One request's summary (api.models.RequestSummary fields); NotFound when the run or the request is not."""
        row = self._request(run_id, request_id)
        return RequestRecord.of(row, self.index.version_spans(run_id, [request_id]).get(request_id, []))

    def run_to_read(self, run_id: str) -> RunState:
        """The run as a read takes it, before the records whose rows it reads (`read_rows` is handed both): a
        delete after that marks this state deleted, and the read answers RunDeleted instead of reading the records
        against a run a writer has started again under the same id. NotFound when there is no such run."""
        return self.registry.require(run_id)

    def request_to_read(self, run: RunState, request_id: str) -> RequestRecord:
        """The request's record as a read of its rows takes it (`read_rows`), in the run the read took
        (`run_to_read`): `request_summary` without the weight-version spans, one index query and no second look at
        the run. NotFound when the run has no such request, RunDeleted when the run was deleted since."""
        try:
            return RequestRecord.of(self._request_row(run.run_id, request_id))
        except NotFound:
            if run.deleted:
                raise RunDeleted.during_read(run.run_id) from None
            raise

    def requests_to_read(self, run: RunState, request_ids: Sequence[str]) -> list[RequestRecord]:
        """`request_to_read` of each of `request_ids`, in order, in one index query (a trainer slice's sequences);
        NotFound naming the first the run does not have."""
        rows = self.index.requests_of(run.run_id, request_ids)
        records = []
        for request_id in request_ids:
            row = rows.get(request_id)
            if row is None:
                if run.deleted:
                    raise RunDeleted.during_read(run.run_id)
                raise _no_request(run.run_id, request_id)
            records.append(RequestRecord.of(row))
        return records

    def list_requests(self, run_id: str, flag: Flag | None, cursor: str | None, limit: int) -> RequestPage:
        """A page of request summaries after `cursor` by id (those with `flag` only), and the next cursor."""
        self.registry.require(run_id)
        rows = self.index.requests_page(run_id, flag, cursor, limit + 1)
        spans = self.index.version_spans(run_id, [r["request_id"] for r in rows[:limit]]) if rows else {}
        items = [RequestRecord.of(r, spans.get(r["request_id"], [])) for r in rows[:limit]]
        return RequestPage(items, items[-1].request_id if len(rows) > limit else None)

    @property
    def reads_on_loop(self) -> bool:
        """Whether a hot read may run on the event loop (placement/on_loop.py): the index and the segments are local,
        and the settings allow it (`hot_reads`)."""
        return self.settings.hot_reads is ReadPlace.EVENT_LOOP and not (self.index.remote or self.segments.remote)

    def read_route(self, run_id: str, request_id: str, start: int = 0, end: int | None = None,
                   rule: RecomputeRule = RecomputeRule.FIRST, weight_version: str | None = None) -> RouteRows:
        """Rows `[start, end)` of a request, dense by position: a missing position is a GAP row.

        Per position the row `rule` serves (reads.py), of `weight_version` only when one is named (positions without
        a row of it read as GAP). RunDeleted when the run was deleted while it was read (its spans may have gone:
        never GAP rows for that).
        """
        run = self.run_to_read(run_id)
        return self.read_rows(run, self.request_to_read(run, request_id), start, end, rule, weight_version)

    def spans_of_requests(self, run: RunState, requests: list[RequestRecord]) -> KnownSpans:
        """Every span of these requests of `run` (records as `requests_to_read` took them), in one index read, for
        their `locate_rows(known_spans=..., keep=True)`; not those whose location is kept for such a read."""
        kept = frozenset(r.request_id for r in requests if self.reader.keeps(run.run_id, r.request_id, _keep(run, r)))
        return KnownSpans(self.index.spans_of_requests(run.run_id, [r.request_id for r in requests
                                                                    if r.request_id not in kept]), not_read=kept)

    def read_rows(self, run: RunState, request: RequestRecord, start: int = 0, end: int | None = None,
                  rule: RecomputeRule = RecomputeRule.FIRST, weight_version: str | None = None) -> RouteRows:
        """`read_route` of a request whose record the caller holds (`request_to_read`), of the run it took before
        that record (`run_to_read`): no second index lookup. RunDeleted when that run was deleted since (its spans
        may have gone: never GAP rows for that, even when a writer has started the run again).

        The late CONFLICT flags are looked up when `request` counted some.
        """
        return self.locate_rows(run, request, start, end, rule, weight_version).rows()

    def locate_rows(self, run: RunState, request: RequestRecord, start: int = 0, end: int | None = None,
                    rule: RecomputeRule = RecomputeRule.FIRST, weight_version: str | None = None,
                    known_spans: KnownSpans | None = None, keep: bool = False) -> Located:
        """`read_rows`' rows located, their ids not yet copied (`requests.rows.Located`: a trainer slice copies only
        the rows of its rank, straight from the segments); `known_spans`: the request's spans, read for many
        requests at once (`spans_of_requests`, taken after `request`); `keep`: the request's whole location kept for
        the plain reads of it that follow, in this worker, and reused while its record and segments are unchanged
        (`requests/kept.py`)."""
        if weight_version is not None:
            try:
                check_label(weight_version, "weight_version")
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
        run_id = run.run_id
        if end is None:
            end = request.expected_rows
        if start < 0 or end < start:
            raise InvalidInput(f"bad range start={start} end={end}")
        if end - start > self.settings.max_read_rows:
            raise InvalidInput(
                f"range {start}..{end} is {end - start} rows, more than one read returns "
                f"(REPLAY_MAX_READ_ROWS={self.settings.max_read_rows}); read it in pieces with start/end")
        if end - start > on_loop.MAX_ROWS:
            on_loop.refuse(f"{end - start} rows is more than a read on the event loop serves")
        late = self.index.late_flags(run_id, request.request_id, start, end) if request.flagged[Flag.CONFLICT] else {}
        route = self.reader.locate(run_id, request.request_id, run.shape, start, end, late, RecomputeRule(rule),
                                   weight_version, known_spans, _keep(run, request) if keep else None)
        if run.deleted:
            raise RunDeleted.during_read(run_id)
        return route
