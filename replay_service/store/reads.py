"""Reading stored rows back: one request's route, and the row served at a position.

The served row at a position is the first one the request came to hold there (span order: its
own rows in segment order, rows resolved from a prefix-cache reference from when it resolved, by
`store/references.py`); later rows at that position are kept on disk and never served. Whether they disagreed
(CONFLICT) was decided at ingest (`replay_service.checks.check`) and recorded then: in the
served row's flags, or in the index's late flags when the disagreeing row came later. A read
only picks rows; it decides no flag except GAP (a position nobody sent: ids zero, never clean).

The common case (one span covering the range, nothing to add) stays a zero-copy view of the
memory-mapped segment. From an object store, a span's rows are fetched by the blocks holding them and checked
(`SegmentStore.read_rows`, store/ranges.py), unless the segment is read whole (compressed, or before segment 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import NO_TOKEN, Flag, LayerAxis, RunShape
from replay_format.core import token_ids
from replay_format.weight_versions import WeightVersions
from replay_service.store.files import SegmentCache
from replay_service.store.index import Index


@dataclass
class RouteRows:
    """Rows `[start, end)` of one request, dense by position."""

    request_id: str
    shape: RunShape
    positions: np.ndarray  # int32 (n,)
    token_ids: np.ndarray  # int32 (n,), NO_TOKEN where unknown
    experts: np.ndarray  # (n, L*K) run dtype, possibly a read-only view of a segment
    flags: np.ndarray  # uint16 (n,)
    weight_versions: WeightVersions | None = None  # which weights computed each row; None: none known

    def versions(self) -> WeightVersions:
        """Each row's weight version (all unknown when none is known)."""
        return WeightVersions.unknown(self.num_rows) if self.weight_versions is None else self.weight_versions

    @property
    def num_rows(self) -> int:
        """Rows in the range."""
        return len(self.positions)

    def experts_3d(self) -> np.ndarray:
        """The ids as `(n, num_moe_layers, top_k)`."""
        return self.experts.reshape(self.num_rows, self.shape.num_moe_layers, self.shape.top_k)

    def experts_on(self, axis: LayerAxis) -> np.ndarray:
        """The ids on a layer axis: `(n, num_moe_layers, K)` (a view), or `(n, num_hidden_layers, K)`, dense zero."""
        if axis == LayerAxis.MODEL:
            return self.shape.to_model_axis(self.experts)
        return self.experts_3d()

    def bad_rows(self) -> np.ndarray:
        """Row numbers of flagged (or missing) rows."""
        return np.flatnonzero(self.flags)


@dataclass
class _Pieces:
    """Stored rows of one request, concatenated in stored order (not yet one per position)."""

    positions: np.ndarray
    token_ids: np.ndarray
    experts: np.ndarray
    flags: np.ndarray

    def take(self, index: np.ndarray | slice) -> _Pieces:
        """These rows at `index` (a mask, row numbers or a slice: a slice keeps views)."""
        return _Pieces(self.positions[index], self.token_ids[index], self.experts[index], self.flags[index])

    def first_per_position(self) -> _Pieces:
        """Sorted by position (stably: stored order within one), the first row of each position only."""
        rows, p = self, self.positions
        if len(p) > 1 and np.any(p[1:] < p[:-1]):  # one span is sorted already: no sort on the common path
            rows = self.take(np.argsort(p, kind="stable"))
            p = rows.positions
        if len(p) > 1:
            first = np.concatenate(([True], p[1:] != p[:-1]))
            if not first.all():
                return rows.take(first)
        return rows


def _piece(batch: pa.RecordBatch, width: int) -> _Pieces:
    positions = batch.column("position").to_numpy()
    experts = batch.column("experts").flatten().to_numpy(zero_copy_only=True).reshape(len(positions), width)
    return _Pieces(positions, token_ids(batch.column("token_id")), experts, batch.column("flags").to_numpy())


def _concat(pieces: list[_Pieces], shape: RunShape) -> _Pieces:
    if len(pieces) == 1:
        return pieces[0]
    if not pieces:
        return _Pieces(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, shape.row_width), shape.dtype),
                       np.zeros(0, np.uint16))
    return _Pieces(*(np.concatenate([getattr(p, name) for p in pieces])
                     for name in ("positions", "token_ids", "experts", "flags")))


class RowReader:
    """Stored rows by (run, request, positions), through the index's spans and the segment cache."""

    def __init__(self, index: Index, cache: SegmentCache) -> None:
        self.index = index
        self.cache = cache

    def _spans(self, run_id: str, request_id: str, lo: int, hi: int) -> list[pa.RecordBatch]:
        """The request's stored rows in spans touching positions `[lo, hi]`, in the order it came to hold them."""
        return [self._rows(s["path"], s["row_start"], s["row_count"])
                for s in self.index.spans(run_id, request_id, lo, hi)]

    def _rows(self, path: str, start: int, count: int) -> pa.RecordBatch:
        """Rows `[start, start + count)` of a segment: fetched and checked by themselves where the store reads ranges
        (an object store: only their blocks travel), else a slice of the whole segment, opened and checked once."""
        try:
            rows = self.cache.store.read_rows(path, start, start + count)
        except FileNotFoundError:
            rows = None  # the segment cache says what a missing segment means (its run deleted, or damage)
        return self.cache.get(path).slice(start, count) if rows is None else rows

    def served_rows(self, run_id: str, request_id: str, shape: RunShape,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of sorted `positions`, those already served, and the ids served there: `(positions, experts)`."""
        found = []
        for span in self._spans(run_id, request_id, int(positions[0]), int(positions[-1])):
            piece = _piece(span, shape.row_width)
            hit = np.isin(piece.positions, positions)
            if hit.any():
                found.append(piece.take(hit))
        served = _concat(found, shape).first_per_position()
        return served.positions, served.experts

    def route(self, run_id: str, request_id: str, shape: RunShape, start: int, end: int,
              late_flags: dict[int, int]) -> RouteRows:
        """Rows `[start, end)` of a request: the served row per position, GAP rows where none is stored."""
        spans = self._spans(run_id, request_id, start, end - 1) if end > start else []
        return assemble_route(request_id, shape, spans, start, end, late_flags)


def assemble_route(request_id: str, shape: RunShape, spans: list[pa.RecordBatch], start: int, end: int,
                   late_flags: dict[int, int]) -> RouteRows:
    """A request's spans (in the order it came to hold them) as a dense route over `[start, end)` with `late_flags`."""
    rows = _concat([_piece(span, shape.row_width) for span in spans], shape)
    if len(spans) == 1:
        lo, hi = np.searchsorted(rows.positions, [start, end])  # a span's rows are sorted by position
        rows = rows.take(slice(lo, hi))
    else:
        rows = rows.take((rows.positions >= start) & (rows.positions < end))
    rows = rows.first_per_position()
    n = end - start
    dense = len(rows.positions) == n
    if dense and not late_flags:
        return RouteRows(request_id, shape, rows.positions, rows.token_ids, rows.experts, rows.flags)

    out_positions = np.arange(start, end, dtype=np.int32)
    out_experts = np.zeros((n, shape.row_width), shape.dtype)
    out_flags = np.full(n, int(Flag.GAP), np.uint16)
    out_tokens = np.full(n, NO_TOKEN, np.int32)
    slots = rows.positions - start
    out_experts[slots] = rows.experts
    out_flags[slots] = rows.flags
    out_tokens[slots] = rows.token_ids
    for position, bits in late_flags.items():
        if start <= position < end:
            out_flags[position - start] |= bits
    return RouteRows(request_id, shape, out_positions, out_tokens, out_experts, out_flags)
