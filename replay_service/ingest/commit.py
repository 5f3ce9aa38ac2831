"""Ingest stage 4, commit: a written segment becomes acknowledged rows, in one index transaction.

Under the run's lock (one commit per run at a time): a concurrent retry of the same
(run, writer, seq) is answered as a duplicate; rows at positions already served are settled
by the check stage's rule (`check.repeat_conflicts`: identical is a resend, different is
CONFLICT on the served row, recorded as a late flag); then the segment, its spans, the
requests' counters and the run's totals are committed together, with the spans that prefix-cache
references mirror from the new rows into the requests referencing them (`store/references.py`:
a reference that arrived before its source's rows resolves here). The answer is an `IngestResult`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from replay_format import Flag, RunShape
from replay_service.errors import Conflict
from replay_service.ingest.check import CheckedRows, repeat_conflicts
from replay_service.ingest.segment import Segment, SegmentWriter
from replay_service.ownership import claim_requests
from replay_service.store.index import COUNTED_FLAGS, Index, IndexTransaction
from replay_service.store.reads import RowReader
from replay_service.store.references import HeldRows, Resolver
from replay_service.store.runs import RunState


class IngestOutcome(enum.StrEnum):
    """What became of one ingested batch (also the `replay_ingest_batches_total` label)."""

    STORED = "stored"
    DUPLICATE = "duplicate"  # this (run, writer, seq) was stored before: nothing written
    REJECTED = "rejected"  # refused with a domain or format error: nothing written


@dataclass
class IngestResult:
    """The answer to one ingested batch."""

    outcome: IngestOutcome
    rows: int  # rows in the batch, padding dropped
    padding_dropped: int = 0
    flagged: dict[str, int] = field(default_factory=dict)  # flag name -> rows of this batch, where not 0
    bytes: int = 0  # segment size

    @property
    def stored(self) -> bool:
        """True when this call stored the batch."""
        return self.outcome == IngestOutcome.STORED


class Committer:
    """Commits segments to the index; answers retries."""

    def __init__(self, index: Index, reader: RowReader, segments: SegmentWriter) -> None:
        self.index = index
        self.reader = reader
        self.segments = segments

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
        """Acknowledge `segment`'s rows (or answer a retry that landed meanwhile); the file is deleted on failure."""
        checked = segment.rows
        try:
            with run.lock:
                duplicate = self.find_duplicate(checked)
                if duplicate is not None:
                    self.segments.discard(segment)
                    return duplicate
                shadowed = checked.shadowed.copy()
                conflicts = self._settle_stored_repeats(checked, run.shape, shadowed)
                load = checked.served_load(shadowed)
                with self.index.transaction() as tx:
                    # another writer's request refuses the batch (403): nothing kept
                    claim_requests(tx, checked.rows.meta.run_id, list(checked.rows.request_ids))
                    held = self._record(tx, segment, shadowed, conflicts, run.load + load)
                    Resolver(tx, self.reader, run.run_id, run.shape).propagate(held)
                run.load += load
        except Exception:
            self.segments.discard(segment)
            raise
        served_flags = checked.flags[~shadowed]
        flagged = {str(f.name): int(np.count_nonzero(served_flags & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        flagged[str(Flag.CONFLICT.name)] += len(conflicts)
        return IngestResult(IngestOutcome.STORED, checked.num_rows, int(checked.padding_dropped.sum()),
                            {k: v for k, v in flagged.items() if v}, segment.size)

    def _settle_stored_repeats(self, checked: CheckedRows, shape: RunShape,
                               shadowed: np.ndarray) -> list[tuple[str, int]]:
        """Shadow rows at positions already served; returns (request, position) where they differ (CONFLICT)."""
        rows = checked.rows
        conflicts: list[tuple[str, int]] = []
        for lo, hi in checked.request_spans():
            request_id = rows.request_ids[rows.request_index[lo]]
            positions = rows.positions[lo:hi]
            served_positions, served_experts = self.reader.served_rows(rows.meta.run_id, request_id, shape, positions)
            if not len(served_positions):
                continue
            slot = np.minimum(np.searchsorted(served_positions, positions), len(served_positions) - 1)
            repeats = np.flatnonzero(served_positions[slot] == positions)
            shadowed[lo + repeats] = True
            differs = repeat_conflicts(rows.experts[lo + repeats], served_experts[slot[repeats]])
            conflicts += [(request_id, int(p)) for p in positions[repeats[differs]].tolist()]
        return conflicts

    @staticmethod
    def _record(tx: IndexTransaction, segment: Segment, shadowed: np.ndarray, conflicts: list[tuple[str, int]],
                run_load: np.ndarray) -> list[HeldRows]:
        """Index the segment; returns the spans inserted (rows the batch's requests now hold)."""
        checked = segment.rows
        rows, meta = checked.rows, checked.rows.meta
        segment_id = tx.insert_segment(meta.run_id, meta.writer_id, meta.seq, segment.path, rows.num_rows,
                                       segment.size, checked.digest)
        padding = checked.padding_dropped
        with_rows = set()
        held: list[HeldRows] = []
        for lo, hi in checked.request_spans():
            index = int(rows.request_index[lo])
            with_rows.add(index)
            request_id = rows.request_ids[index]
            positions = rows.positions[lo:hi]
            tx.insert_span(meta.run_id, request_id, segment_id, lo, hi - lo, int(positions[0]), int(positions[-1]))
            held.append(HeldRows(request_id, segment_id, segment.path, lo, hi - lo, int(positions[0]),
                                 int(positions[-1])))
            served = ~shadowed[lo:hi]  # only served rows count
            tx.add_served(meta.run_id, request_id, positions[served], checked.flags[lo:hi][served],
                          pos_max=int(positions[-1]), padding=int(padding[index]))
        for index in np.flatnonzero(padding).tolist():
            if index not in with_rows:  # a request whose rows were all padding this batch
                tx.add_to_request(meta.run_id, rows.request_ids[index], rows=0, pos_max=-1, flag_bits=0,
                                  first_flagged=None, counts={Flag.PADDING: int(padding[index])})
        for request_id, position in conflicts:
            tx.mark_conflict(meta.run_id, request_id, position)
        tx.add_run_totals(meta.run_id, segment.size, run_load, segment.written_ns)
        return held
