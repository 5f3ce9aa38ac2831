"""Ingest stage 4, commit: written segments become acknowledged rows, many batches per index transaction.

Contract (`Committer.commit`): a batch is answered only once the transaction holding it committed (acknowledged means
durable). Batches waiting together commit as one group: run folders synced once, runs locked in run-id order, one
savepoint per batch, so a batch that fails (Forbidden, Conflict, RunDeleted, any error) is rolled back and its segment
deleted while the others commit. Per batch: a retry of a stored (run, writer, seq) is a duplicate; rows at positions
already held are settled by `judge_repeats`; then its index rows, health ticks and run totals are written and
prefix-cache references resolved. The answer is an `IngestResult`.
Design: docs/design/ingest.md ("Group commit", "Settling repeats at commit").
"""

from __future__ import annotations

import contextvars
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from replay_format import Flag, RunShape
from replay_format.weight_versions import UNKNOWN, WeightVersions
from replay_service.checks.check import CheckedRows, judge_repeats
from replay_service.errors import Conflict, RunDeleted
from replay_service.ingest.result import IngestOutcome, IngestResult
from replay_service.ingest.segment import Segment, SegmentWriter
from replay_service.ownership import claim_requests
from replay_service.store.index import COUNTED_FLAGS, HeldRows, Index, IndexTransaction, RequestCounts
from replay_service.store.requests.references import Resolver
from replay_service.store.requests.rows import RowReader
from replay_service.store.runs import RunState
from replay_service.store.tables.health import TICK_FLAGS, HealthTables


@dataclass
class _Settled:
    """A batch's repeats of rows already held: CONFLICT positions, and positions newly recomputed per request."""

    conflicts: list[tuple[str, int]] = field(default_factory=list)  # (request, position): late CONFLICT flags
    recomputed: dict[str, list[int]] = field(default_factory=dict)  # request -> positions, each counted once


@dataclass
class _Waiting:
    """One batch in the commit queue, and its answer once its group committed."""

    segment: Segment
    run: RunState
    context: contextvars.Context  # its writer's (the actor a claim is made for)
    result: IngestResult | None = None
    error: BaseException | None = None
    done: bool = False


class Committer:
    """Commits segments to the index in groups (module docstring); answers retries."""

    def __init__(self, index: Index, reader: RowReader, segments: SegmentWriter, health: HealthTables,
                 health_bucket_s: float) -> None:
        self.index = index
        self.reader = reader
        self.segments = segments
        self.health = health  # each batch's rows and load in its ingest-time bucket (store/tables/health.py)
        self.health_bucket_s = health_bucket_s
        self._queue: list[_Waiting] = []
        self._turn = threading.Condition()  # guards the queue and `_leading`
        self._leading = False

    def find_duplicate(self, checked: CheckedRows) -> IngestResult | None:
        """The answer to a retry of a stored batch, None for a new one; Conflict when the seq was reused."""
        meta = checked.rows.meta
        previous = self.index.stored_digest(meta.run_id, meta.writer_id, meta.seq)
        if previous is None:
            return None
        if previous != checked.digest:
            raise Conflict(
                f"writer {meta.writer_id!r} already stored seq {meta.seq} in run {meta.run_id!r} with other rows; "
                "a retry must resend the same batch, new rows need a new seq")
        return IngestResult(IngestOutcome.DUPLICATE, checked.num_rows)

    def commit(self, segment: Segment, run: RunState) -> IngestResult:
        """Acknowledge `segment`'s rows once durable (or answer a retry that landed meanwhile).

        Blocks until the group holding it committed; the file is deleted when this batch fails.
        """
        me = _Waiting(segment, run, contextvars.copy_context())
        group: list[_Waiting] | None = None
        with self._turn:
            self._queue.append(me)
            while self._leading and not me.done:
                self._turn.wait()
            if not me.done:  # nobody is committing: this thread leads, for every batch queued so far
                self._leading = True
                group, self._queue = self._queue, []
        if group is not None:
            try:
                self._commit_group(group)
            finally:
                with self._turn:
                    for waiting in group:
                        waiting.done = True
                    self._leading = False
                    self._turn.notify_all()
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _commit_group(self, group: list[_Waiting]) -> None:
        """Commit `group` in one transaction, one savepoint per batch; every batch ends with a result or an error."""
        try:
            self._sync_folders(group)
            runs = sorted({id(w.run): w.run for w in group}.values(), key=lambda r: r.run_id)
            with ExitStack() as held:
                for run in runs:  # always in run-id order: two leaders never wait on each other's runs
                    held.enter_context(run.lock)
                try:
                    with self.index.transaction() as tx:
                        tx.lock_runs([run.run_id for run in runs])  # the run locks of other replicas (PostgreSQL)
                        # The index is the load's one source: read under the lock, so no replica's count is lost.
                        loads = {id(run): tx.run_load(run.run_id, run.shape) for run in runs}
                        for waiting in group:
                            if waiting.error is None:
                                self._commit_one(tx, waiting, loads)
                except BaseException as exc:  # the transaction failed as a whole: nothing of the group is kept
                    for waiting in group:
                        if waiting.error is None:
                            waiting.result, waiting.error = None, exc
                    raise
        except BaseException as exc:
            for waiting in group:
                if waiting.error is None and waiting.result is None:
                    waiting.error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            for waiting in group:
                if waiting.error is not None or (waiting.result is not None and not waiting.result.stored):
                    self.segments.discard(waiting.segment)

    def _sync_folders(self, group: list[_Waiting]) -> None:
        """Make the group's segment names durable before any index row names them (the segment store's job:
        one fsync per run folder for local files, nothing for an object store)."""
        unsynced = [w for w in group if w.segment.folder_unsynced]
        failed = self.segments.store.sync(sorted({w.segment.path for w in unsynced}))
        for waiting in unsynced:
            exc = failed.get(waiting.segment.path)
            if exc is not None:  # its run folder is gone: the run was deleted under the write (lifecycle/retention.py)
                # here, or by another replica sharing this directory (its run row is gone from the index)
                deleted = waiting.run.deleted or self.index.run(waiting.run.run_id) is None
                waiting.error = RunDeleted(
                    f"run {waiting.run.run_id!r} was deleted while this batch was being stored; nothing was "
                    "stored (send it again to start a fresh run)") if deleted else exc

    def _commit_one(self, tx: IndexTransaction, waiting: _Waiting, loads: dict[int, np.ndarray]) -> None:
        """One batch of a group inside its savepoint; on failure only its own writes are undone."""
        try:
            with tx.savepoint():
                waiting.result, load = waiting.context.run(self._write, tx, waiting, loads[id(waiting.run)])
        except Exception as exc:
            waiting.result, waiting.error = None, exc
            if not tx.active:  # SQLite rolled the whole transaction back (a full disk): the group fails
                raise
            return
        if load is not None:  # kept: the group's later batches of this run count it
            loads[id(waiting.run)] = load

    def _write(self, tx: IndexTransaction, waiting: _Waiting,
               run_load: np.ndarray) -> tuple[IngestResult, np.ndarray | None]:
        """A batch's index rows (its run's lock held, its writer's context entered); its answer and the run's load.

        `run_load`: the run's expert load before this batch (the group's earlier batches included).
        """
        segment, run = waiting.segment, waiting.run
        checked = segment.rows
        duplicate = self.find_duplicate(checked)  # reads inside the transaction: sees earlier batches of the group
        if duplicate is not None:
            return duplicate, None
        shadowed = checked.shadowed.copy()
        settled = self._settle_stored_repeats(checked, run.shape, shadowed)
        batch_load = checked.served_load(shadowed)
        load = run_load + batch_load
        # another writer's request refuses the batch (403): nothing of it kept
        claim_requests(tx, checked.rows.meta.run_id, list(checked.rows.request_ids))
        held = self._record(tx, segment, shadowed, settled, load)
        Resolver(tx, self.reader, run.run_id, run.shape).propagate(held)
        served_flags = checked.flags[~shadowed]
        flagged = {str(f.name): int(np.count_nonzero(served_flags & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        flagged[str(Flag.CONFLICT.name)] += len(settled.conflicts)
        self._count_health(tx, checked, run, shadowed, flagged, batch_load)
        recomputed = sum(len(p) for p in settled.recomputed.values())
        return IngestResult(IngestOutcome.STORED, checked.num_rows, int(checked.padding_dropped.sum()),
                            {k: v for k, v in flagged.items() if v}, segment.size, recomputed), load

    def _count_health(self, tx: IndexTransaction, checked: CheckedRows, run: RunState, shadowed: np.ndarray,
                      flagged: dict[str, int], batch_load: np.ndarray) -> None:
        """Add the batch's served rows, their flags and their clean rows' load (per weight version too) to the run's
        health tables, in the ingest-time bucket of now."""
        served = ~shadowed
        versions = checked.rows.versions()
        version_loads: dict[str, np.ndarray] = {}
        codes = np.unique(versions.index[served])
        for code in codes[codes != UNKNOWN].tolist():
            if len(codes) == 1:  # one version for every served row: the batch's load is its
                version_loads[versions.labels[code]] = batch_load
            else:
                version_loads[versions.labels[code]] = checked.load_where(served & (versions.index == code))
        bucket = time.time() // self.health_bucket_s * self.health_bucket_s
        self.health.add_batch(tx, run.run_id, run.shape, bucket, int(served.sum()),
                              {f: flagged.get(str(f.name), 0) for f in TICK_FLAGS}, batch_load, version_loads)

    def _settle_stored_repeats(self, checked: CheckedRows, shape: RunShape, shadowed: np.ndarray) -> _Settled:
        """Shadow rows at positions already held; returns the positions where the rule says CONFLICT (late flags)
        and, per request, the positions newly recomputed under other weights (the batch's own included)."""
        rows = checked.rows
        versions = rows.versions()
        settled = _Settled()
        spans = checked.request_spans()
        pieces = [(rows.request_ids[rows.request_index[lo]], int(rows.positions[lo]), int(rows.positions[hi - 1]))
                  for lo, hi in spans]
        holding = self.index.pieces_held(rows.meta.run_id, pieces)  # one query: the others hold nothing there
        for i, (lo, hi) in enumerate(spans):
            request_id = pieces[i][0]
            positions = rows.positions[lo:hi]
            stored = (self.reader.stored_rows(rows.meta.run_id, request_id, shape, positions) if i in holding
                      else None)
            if stored is None or not len(stored.positions):  # the check stage's verdicts stand
                if checked.recomputed is not None and checked.recomputed[lo:hi].any():
                    settled.recomputed[request_id] = np.unique(positions[checked.recomputed[lo:hi]]).tolist()
                continue
            m = len(stored.positions)
            every = np.concatenate([stored.positions, positions])
            order = np.argsort(every, kind="stable")  # per position: rows held first, then the batch's in order
            codes = WeightVersions.concat([stored.versions, versions.take(slice(lo, hi))]).index
            verdicts = judge_repeats(every[order].astype(np.int64), np.concatenate([stored.experts,
                                     rows.experts[lo:hi]])[order], codes[order])
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            repeat, conflict, recompute = (v[back] for v in (verdicts.repeat, verdicts.conflict, verdicts.recompute))
            shadowed[lo:hi] |= repeat[m:]
            held_positions = np.isin(positions, stored.positions)
            settled.conflicts += [(request_id, int(p))
                                  for p in np.unique(positions[conflict[m:] & held_positions]).tolist()]
            counted = np.unique(stored.positions[recompute[:m]])  # recomputes held before: counted then
            new = np.setdiff1d(positions[recompute[m:]], counted)
            if len(new):
                settled.recomputed[request_id] = new.tolist()
        return settled

    @staticmethod
    def _record(tx: IndexTransaction, segment: Segment, shadowed: np.ndarray, settled: _Settled,
                run_load: np.ndarray) -> list[HeldRows]:
        """Index the segment; returns the spans inserted (rows the batch's requests now hold)."""
        checked = segment.rows
        rows, meta = checked.rows, checked.rows.meta
        segment_id = tx.insert_segment(meta.run_id, meta.writer_id, meta.seq, segment.path, rows.num_rows,
                                       segment.size, checked.digest)
        spans = checked.request_spans()
        held = [HeldRows(rows.request_ids[rows.request_index[lo]], segment_id, segment.path, lo, hi - lo,
                         int(rows.positions[lo]), int(rows.positions[hi - 1])) for lo, hi in spans]
        tx.insert_spans(meta.run_id, held)
        tx.add_counts(meta.run_id, served_counts(checked, shadowed, spans))
        if rows.weight_versions is not None:
            for (lo, hi), h in zip(spans, held):
                served = ~shadowed[lo:hi]
                versions = rows.weight_versions.take(slice(lo, hi)).take(served).spans(rows.positions[lo:hi][served])
                tx.add_versions(meta.run_id, h.request_id, [(v.version, v.start, v.end) for v in versions])
        for request_id, position in settled.conflicts:
            tx.mark_conflict(meta.run_id, request_id, position)
        for request_id, recomputed in settled.recomputed.items():
            tx.add_recomputed(meta.run_id, request_id, recomputed)
        tx.add_run_totals(meta.run_id, segment.size, run_load, segment.written_ns)
        return held


def served_counts(checked: CheckedRows, shadowed: np.ndarray, spans: list[tuple[int, int]]) -> list[RequestCounts]:
    """What the batch adds to each request's counters: its rows not `shadowed` (served), their flags, and its writer
    padding; a request whose rows were all padding counts only that. Counted for every span at once."""
    rows = checked.rows
    padding = checked.padding_dropped
    counts: list[RequestCounts] = []
    if spans:
        starts = np.fromiter((lo for lo, _ in spans), dtype=np.intp, count=len(spans))
        served = ~shadowed
        flags = np.where(served, checked.flags, 0)
        per_flag = {f: np.add.reduceat((flags & f) != 0, starts, dtype=np.int64).tolist()
                    for f in COUNTED_FLAGS if f != Flag.PADDING}
        n_served = np.add.reduceat(served, starts, dtype=np.int64).tolist()
        unclean = np.add.reduceat(flags != 0, starts, dtype=np.int64).tolist()
        bits = np.bitwise_or.reduceat(flags, starts).tolist()
        never = np.iinfo(np.int64).max
        first = np.minimum.reduceat(np.where(flags != 0, rows.positions.astype(np.int64), never), starts).tolist()
        for i, (lo, hi) in enumerate(spans):
            index = int(rows.request_index[lo])
            by_flag: dict[Flag, int] = {f: n[i] for f, n in per_flag.items()}
            by_flag[Flag.PADDING] = int(padding[index])
            counts.append(RequestCounts(rows.request_ids[index], rows=n_served[i], pos_max=int(rows.positions[hi - 1]),
                                        flag_bits=bits[i], first_flagged=None if first[i] == never else first[i],
                                        counts=by_flag, unclean=unclean[i]))
    with_rows = {int(rows.request_index[lo]) for lo, _ in spans}
    for index in np.flatnonzero(padding).tolist():
        if index not in with_rows:  # a request whose rows were all padding this batch
            counts.append(RequestCounts(rows.request_ids[index], rows=0, pos_max=-1,
                                        counts={Flag.PADDING: int(padding[index])}))
    return counts
