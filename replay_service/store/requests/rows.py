"""Reading stored rows back: one request's route, and every row it holds at some positions.

Contract: per position a read serves one row by `RecomputeRule` (FIRST: the first the request came to hold, in span
order; LATEST: the last), of one `weight_version` when named; a position without such a row is a GAP row. A read
decides no flag but GAP: CONFLICT and recomputes were decided at ingest. One span and nothing to add stays a
zero-copy view of the mapped segment; from a bucket only the blocks holding the rows are fetched and checked
(`SegmentStore.read_rows`, segments/ranges.py).
Design: docs/design/store.md ("Which row a read serves").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import NO_TOKEN, Flag, LayerAxis, RunShape
from replay_format.core import token_ids
from replay_format.segment import segment_versions
from replay_format.weight_versions import RecomputeRule, WeightVersions
from replay_service.store.index import Index
from replay_service.store.segments.cache import SegmentCache


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
class Pieces:
    """Stored rows of one request, concatenated in stored order (not yet one per position)."""

    positions: np.ndarray
    token_ids: np.ndarray
    experts: np.ndarray
    flags: np.ndarray
    versions: WeightVersions

    def take(self, index: np.ndarray | slice) -> Pieces:
        """These rows at `index` (a mask, row numbers or a slice: a slice keeps views)."""
        return Pieces(self.positions[index], self.token_ids[index], self.experts[index], self.flags[index],
                       self.versions.take(index))

    def by_position(self) -> Pieces:
        """Sorted by position, stably (the order held within one position kept)."""
        p = self.positions
        if len(p) > 1 and np.any(p[1:] < p[:-1]):  # one span is sorted already: no sort on the common path
            return self.take(np.argsort(p, kind="stable"))
        return self

    def one_per_position(self, rule: RecomputeRule = RecomputeRule.FIRST) -> Pieces:
        """Sorted by position, the row `rule` serves of each position only: the first held, or the last."""
        rows = self.by_position()
        p = rows.positions
        if len(p) > 1:
            if rule == RecomputeRule.FIRST:
                keep = np.concatenate(([True], p[1:] != p[:-1]))
            else:
                keep = np.concatenate((p[1:] != p[:-1], [True]))
            if not keep.all():
                return rows.take(keep)
        return rows

    def of_version(self, label: str) -> Pieces:
        """The rows computed with the weights labelled `label` only."""
        if label not in self.versions.labels:
            return self.take(np.zeros(len(self.positions), np.bool_))
        return self.take(self.versions.index == self.versions.labels.index(label))


@dataclass(frozen=True)
class StoredRows:
    """Every row a request holds at some positions, in the order it came to hold them (not one per position)."""

    positions: np.ndarray  # int32 (m,)
    experts: np.ndarray  # (m, L*K)
    versions: WeightVersions  # each row's weight version


def _piece(batch: pa.RecordBatch, width: int, versions: WeightVersions | None = None) -> Pieces:
    positions = batch.column("position").to_numpy()
    experts = batch.column("experts").flatten().to_numpy(zero_copy_only=True).reshape(len(positions), width)
    return Pieces(positions, token_ids(batch.column("token_id")), experts, batch.column("flags").to_numpy(),
                   WeightVersions.unknown(len(positions)) if versions is None else versions)


def _read_only(pieces: Pieces) -> Pieces:
    """`pieces` with every array read-only: shared by every read of its segment, never written through."""
    for array in (pieces.positions, pieces.token_ids, pieces.experts, pieces.flags, pieces.versions.index):
        array.flags.writeable = False
    return pieces


def _concat(pieces: list[Pieces], shape: RunShape) -> Pieces:
    if len(pieces) == 1:
        return pieces[0]
    if not pieces:
        return Pieces(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, shape.row_width), shape.dtype),
                       np.zeros(0, np.uint16), WeightVersions.unknown(0))
    positions, tokens, experts, flags = (np.concatenate([getattr(p, name) for p in pieces])
                                         for name in ("positions", "token_ids", "experts", "flags"))
    return Pieces(positions, tokens, experts, flags, WeightVersions.concat(p.versions for p in pieces))


class RowReader:
    """Stored rows by (run, request, positions), through the index's spans and the segment cache."""

    def __init__(self, index: Index, cache: SegmentCache) -> None:
        self.index = index
        self.cache = cache
        # An opened segment's columns as arrays (views of the mapping; token ids and versions decoded once), by
        # path, with the batch they came from: a read asks the cache for the batch first (its checks, a deleted
        # run's refusal) and uses these only while the cache still hands out that same batch.
        self._columns: dict[str, tuple[pa.RecordBatch, Pieces]] = {}
        self._columns_lock = threading.Lock()  # reads run in many threads

    def _spans(self, run_id: str, request_id: str, lo: int, hi: int, width: int) -> list[Pieces]:
        """The request's stored rows in spans touching positions `[lo, hi]`, in the order it came to hold them."""
        return [self.rows_of(s["path"], s["row_start"], s["row_count"], width)
                for s in self.index.spans(run_id, request_id, lo, hi)]

    def rows_of(self, path: str, start: int, count: int, width: int) -> Pieces:
        """Rows `[start, start + count)` of a segment with their weight versions (`width`: ids per row): fetched
        and checked by themselves where the store reads ranges (an object store: only their blocks travel), else
        a slice of the whole segment, opened and checked once, its columns decoded once."""
        try:
            rows = self.cache.store.read_rows(path, start, start + count)
        except FileNotFoundError:
            rows = None  # the segment cache says what a missing segment means (its run deleted, or damage)
        if rows is not None:  # the blocks read carry the segment's versions, over the segment's rows
            versions = segment_versions(rows.schema.metadata, None)
            return _piece(rows, width, None if versions is None else versions.take(slice(start, start + count)))
        return self._whole(path, width).take(slice(start, start + count))

    def _whole(self, path: str, width: int) -> Pieces:
        """A local segment's columns, from the cache's opened batch (decoded once per opened batch)."""
        whole = self.cache.get(path)
        with self._columns_lock:
            kept = self._columns.get(path)
        if kept is not None and kept[0] is whole:
            return kept[1]
        pieces = _read_only(_piece(whole, width, segment_versions(whole.schema.metadata, whole.num_rows)))
        with self._columns_lock:
            self._columns[path] = (whole, pieces)
            while len(self._columns) > self.cache.capacity:
                del self._columns[next(iter(self._columns))]  # the oldest decoded: the cache holds as many
        return pieces

    def stored_rows(self, run_id: str, request_id: str, shape: RunShape, positions: np.ndarray) -> StoredRows:
        """Every row the request holds at any of sorted `positions`, in the order it came to hold them."""
        found = []
        for piece in self._spans(run_id, request_id, int(positions[0]), int(positions[-1]), shape.row_width):
            hit = np.isin(piece.positions, positions)
            if hit.any():
                found.append(piece.take(hit))
        rows = _concat(found, shape)
        return StoredRows(rows.positions, rows.experts, rows.versions)

    def served_rows(self, run_id: str, request_id: str, shape: RunShape,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of sorted `positions`, those already served and the ids served there by the default rule:
        `(positions, experts)`."""
        stored = self.stored_rows(run_id, request_id, shape, positions)
        served = Pieces(stored.positions, np.zeros(len(stored.positions), np.int32), stored.experts,
                         np.zeros(len(stored.positions), np.uint16), stored.versions).one_per_position()
        return served.positions, served.experts

    def route(self, run_id: str, request_id: str, shape: RunShape, start: int, end: int,
              late_flags: dict[int, int], rule: RecomputeRule = RecomputeRule.FIRST,
              weight_version: str | None = None) -> RouteRows:
        """Rows `[start, end)` of a request: the row `rule` serves per position (of `weight_version` only, when
        given), GAP rows where none is stored."""
        spans = self._spans(run_id, request_id, start, end - 1, shape.row_width) if end > start else []
        return _assemble(request_id, shape, spans, start, end, late_flags, rule, weight_version)


def assemble_route(request_id: str, shape: RunShape, spans: list[pa.RecordBatch], start: int, end: int,
                   late_flags: dict[int, int], versions: list[WeightVersions] | None = None,
                   rule: RecomputeRule = RecomputeRule.FIRST, weight_version: str | None = None) -> RouteRows:
    """A request's spans (in the order it came to hold them; `versions`: their rows' weight versions, unknown when
    not given) as a dense route over `[start, end)` with `late_flags`: per position the row `rule` serves, of
    `weight_version` only when one is named (positions without a row of it read as GAP)."""
    pieces = [_piece(span, shape.row_width, None if versions is None else versions[i]) for i, span in enumerate(spans)]
    return _assemble(request_id, shape, pieces, start, end, late_flags, rule, weight_version)


def _assemble(request_id: str, shape: RunShape, spans: list[Pieces], start: int, end: int,
              late_flags: dict[int, int], rule: RecomputeRule, weight_version: str | None) -> RouteRows:
    rows = _concat(spans, shape)
    if len(spans) == 1:
        lo, hi = np.searchsorted(rows.positions, [start, end])  # a span's rows are sorted by position
        rows = rows.take(slice(lo, hi))
    else:
        rows = rows.take((rows.positions >= start) & (rows.positions < end))
    plain = rule == RecomputeRule.FIRST and weight_version is None
    conflicted = None if plain else rows.positions[(rows.flags & Flag.CONFLICT) != 0]
    if weight_version is not None:
        rows = rows.of_version(weight_version)
    rows = rows.one_per_position(rule)
    if conflicted is not None and len(conflicted):  # the position's verdict, whichever of its rows is served
        rows.flags = np.where(np.isin(rows.positions, conflicted), rows.flags | np.uint16(Flag.CONFLICT), rows.flags)
    served_versions = None if rows.versions.all_unknown else rows.versions
    n = end - start
    dense = len(rows.positions) == n
    if dense and not late_flags:
        return RouteRows(request_id, shape, rows.positions, rows.token_ids, rows.experts, rows.flags, served_versions)

    out_positions = np.arange(start, end, dtype=np.int32)
    out_experts = np.zeros((n, shape.row_width), shape.dtype)
    out_flags = np.full(n, int(Flag.GAP), np.uint16)
    out_tokens = np.full(n, NO_TOKEN, np.int32)
    slots = rows.positions - start
    out_experts[slots] = rows.experts
    out_flags[slots] = rows.flags
    out_tokens[slots] = rows.token_ids
    held = np.zeros(n, np.bool_)
    held[slots] = True
    for position, bits in late_flags.items():
        if start <= position < end and (plain or held[position - start]):  # a selection's GAP stays a plain GAP
            out_flags[position - start] |= bits
    out_versions = None
    if served_versions is not None:
        index = np.full(n, -1, np.int16)
        index[slots] = served_versions.index
        out_versions = WeightVersions(served_versions.labels, index)
    return RouteRows(request_id, shape, out_positions, out_tokens, out_experts, out_flags, out_versions)
