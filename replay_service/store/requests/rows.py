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
import weakref
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from replay_format import NO_TOKEN, Flag, LayerAxis, RunShape
from replay_format.core import token_ids
from replay_format.segment import segment_versions
from replay_format.weight_versions import UNKNOWN, RecomputeRule, WeightVersions
from replay_service.store.index import Index, RequestSpans
from replay_service.store.requests.kept import Keep, Kept, KeptLocations
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
    _steps: np.ndarray | None = field(default=None, repr=False, compare=False)  # `dense`'s count, made on first use
    _versions_known: bool | None = field(default=None, repr=False, compare=False)

    def dense(self, start: int, count: int) -> bool:
        """Whether rows `[start, start + count)` hold consecutive positions, one row each (O(1): a running count of
        the rows whose position is not one past the row before's, made once)."""
        if self._steps is None:
            steps = np.zeros(len(self.positions), np.int64)
            np.cumsum(np.diff(self.positions) != 1, out=steps[1:])
            self._steps = steps
        return bool(self._steps[start + count - 1] == self._steps[start])

    @property
    def versions_known(self) -> bool:
        """Whether some row's weight version is known (`WeightVersions.all_unknown`, decided once)."""
        if self._versions_known is None:
            self._versions_known = not self.versions.all_unknown
        return self._versions_known

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


@dataclass(slots=True)
class Span:
    """A span of a request: rows `[start, start + count)` of the columns holding them (a whole local segment's, or
    the rows fetched from a bucket); `segment`: the local segment's path, "" for rows fetched by themselves."""

    source: Pieces
    start: int
    count: int
    segment: str = ""

    def rows(self) -> Pieces:
        """The span's rows as their own columns (views)."""
        return self.source.take(slice(self.start, self.start + self.count))


@dataclass
class KnownSpans:
    """Every span of some requests of one run, read from the index at once (`RouteStore.spans_of_requests`: a
    trainer slice's sequences), and the local segments their reads opened: each decoded once per slice, not per
    span."""

    by_request: dict[str, RequestSpans]
    opened: dict[str, Pieces] = field(default_factory=dict)
    not_read: frozenset[str] = frozenset()  # requests whose kept location was to serve: their spans not read

    def spans_of(self, request_id: str) -> RequestSpans | None:
        """The request's spans (None: it has none); KeyError when they were not read (`not_read`)."""
        if request_id in self.not_read:
            raise KeyError(request_id)
        return self.by_request.get(request_id)


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

    def __init__(self, index: Index, cache: SegmentCache, kept_bytes: int = 0) -> None:
        """`kept_bytes`: the locations of whole requests kept for the trainer reads that follow (`kept.py`; local
        segments only: a bucket's are read by the blocks a read needs)."""
        self.index = index
        self.cache = cache
        self.kept: KeptLocations[Located] = KeptLocations(0 if cache.store.remote else kept_bytes)
        # An opened segment's columns as arrays (views of the mapping; token ids and versions decoded once), by
        # path, with the batch they came from: a read asks the cache for the batch first (its checks, a deleted
        # run's refusal) and uses these only while the cache still hands out that same batch.
        self._columns: dict[str, tuple[pa.RecordBatch, Pieces]] = {}
        self._columns_lock = threading.Lock()  # reads run in many threads

    def _spans(self, run_id: str, request_id: str, lo: int, hi: int, width: int,
               known: KnownSpans | None = None) -> list[Span]:
        """The request's stored rows in spans touching positions `[lo, hi]`, in the order it came to hold them
        (`known`: the spans of it and others, read from the index already)."""
        try:
            spans = None if known is None else known.spans_of(request_id)
        except KeyError:  # its kept location did not serve after all
            known = None
        if known is None:
            return [self.span_of(s["path"], s["row_start"], s["row_count"], width)
                    for s in self.index.spans(run_id, request_id, lo, hi)]
        if spans is None:
            return []
        return [self.span_of(spans.path[i], spans.row_start[i], spans.row_count[i], width, known.opened)
                for i in spans.touching(lo, hi)]

    def span_of(self, path: str, start: int, count: int, width: int,
                opened: dict[str, Pieces] | None = None) -> Span:
        """Rows `[start, start + count)` of a segment with their weight versions (`width`: ids per row): fetched
        and checked by themselves where the store reads ranges (an object store: only their blocks travel), else
        in the whole segment, opened and checked once, its columns decoded once (`opened`: the whole segments a
        read took already, by path; one it takes now is added)."""
        whole = None if opened is None else opened.get(path)
        if whole is None:
            try:
                rows = self.cache.store.read_rows(path, start, start + count)
            except FileNotFoundError:
                rows = None  # the segment cache says what a missing segment means (its run deleted, or damage)
            if rows is not None:  # the blocks read carry the segment's versions, over the segment's rows
                versions = segment_versions(rows.schema.metadata, None)
                return Span(_piece(rows, width, None if versions is None else
                                   versions.take(slice(start, start + count))), 0, count)
            whole = self._whole(path, width)
            if opened is not None:
                opened[path] = whole
        return Span(whole, start, count, path)

    def rows_of(self, path: str, start: int, count: int, width: int) -> Pieces:
        """`span_of`'s rows as their own columns."""
        return self.span_of(path, start, count, width).rows()

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
        for span in self._spans(run_id, request_id, int(positions[0]), int(positions[-1]), shape.row_width):
            piece = span.rows()
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
        return self.locate(run_id, request_id, shape, start, end, late_flags, rule, weight_version).rows()

    def locate(self, run_id: str, request_id: str, shape: RunShape, start: int, end: int,
               late_flags: dict[int, int], rule: RecomputeRule = RecomputeRule.FIRST,
               weight_version: str | None = None, known_spans: KnownSpans | None = None,
               keep: Keep | None = None) -> Located:
        """`route`'s rows located, their ids not yet copied (`Located`); `known_spans`: the request's spans read
        already, with others (`Index.spans_of_requests`); `keep`: a plain read's request as the read took it, its
        whole location then kept for the reads that follow and reused while it holds (`kept.py`)."""
        if keep is not None and self.kept.max_bytes and not late_flags and rule == RecomputeRule.FIRST \
                and weight_version is None and 0 <= start < end <= keep.rows:
            return self._whole_request(run_id, request_id, shape, keep, known_spans).cut(start, end)
        spans = self._spans(run_id, request_id, start, end - 1, shape.row_width, known_spans) if end > start else []
        return _locate(request_id, shape, spans, start, end, late_flags, rule, weight_version)

    def keeps(self, run_id: str, request_id: str, keep: Keep) -> bool:
        """Whether a location of the request is kept under `keep` (its segments not checked yet: `locate` does)."""
        return self.kept.get(run_id, request_id, keep) is not None

    def _whole_request(self, run_id: str, request_id: str, shape: RunShape, keep: Keep,
                       known: KnownSpans | None) -> Located:
        """The plain location of the request's rows `[0, keep.rows)`: the kept one while it holds (`kept.py`), else
        made and kept (once, while other reads of it wait)."""
        opened = {} if known is None else known.opened
        kept = self._kept(run_id, request_id, shape, keep, opened)
        if kept is not None:
            return kept
        other = self.kept.making(run_id, request_id)
        if other is not None:  # another read makes it: take it when made, or make it after all
            other.wait()
            return self._kept(run_id, request_id, shape, keep, opened) or \
                self._make_kept(run_id, request_id, shape, keep, known)
        try:  # (kept meanwhile by a read that was done before this one asked)
            return self._kept(run_id, request_id, shape, keep, opened) or \
                self._make_kept(run_id, request_id, shape, keep, known)
        finally:
            self.kept.made(run_id, request_id)

    def _kept(self, run_id: str, request_id: str, shape: RunShape, keep: Keep,
              opened: dict[str, Pieces]) -> Located | None:
        """The request's kept location over its segments as opened now, while it holds."""
        kept = self.kept.get(run_id, request_id, keep)
        if kept is None:
            return None
        columns = [self._opened(path, shape.row_width, opened) for path in kept.paths]
        return kept.located.with_sources([c.experts for c in columns]) if kept.holds(columns) else None

    def _make_kept(self, run_id: str, request_id: str, shape: RunShape, keep: Keep,
                   known: KnownSpans | None) -> Located:
        """Locate the whole request and keep it (`_whole_request`; local segments only: every span names its
        segment)."""
        spans = self._spans(run_id, request_id, 0, keep.rows - 1, shape.row_width, known)
        located = _locate(request_id, shape, spans, 0, keep.rows, {}, RecomputeRule.FIRST, None)
        for array in (located.positions, located.token_ids, located.flags, located.span, located.row,
                      located.steps()):
            array.flags.writeable = False  # shared by the reads that follow
        segments: dict[int, Span] = {}  # each source's first span, in source order (`_sources`)
        for span in spans:
            segments.setdefault(id(span.source), span)
        self.kept.put(run_id, request_id, Kept(keep, tuple(s.segment for s in segments.values()),
                                               tuple(weakref.ref(s.source) for s in segments.values()),
                                               located.with_sources([]), located.nbytes))
        return located

    def _opened(self, path: str, width: int, opened: dict[str, Pieces]) -> Pieces:
        """A local segment's columns, once per read (`opened`)."""
        whole = opened.get(path)
        if whole is None:
            whole = opened[path] = self._whole(path, width)
        return whole


def assemble_route(request_id: str, shape: RunShape, spans: list[pa.RecordBatch], start: int, end: int,
                   late_flags: dict[int, int], versions: list[WeightVersions] | None = None,
                   rule: RecomputeRule = RecomputeRule.FIRST, weight_version: str | None = None) -> RouteRows:
    """A request's spans (in the order it came to hold them; `versions`: their rows' weight versions, unknown when
    not given) as a dense route over `[start, end)` with `late_flags`: per position the row `rule` serves, of
    `weight_version` only when one is named (positions without a row of it read as GAP)."""
    pieces = [_piece(span, shape.row_width, None if versions is None else versions[i]) for i, span in enumerate(spans)]
    return _assemble(request_id, shape, [Span(p, 0, len(p.positions)) for p in pieces], start, end, late_flags, rule,
                     weight_version)


def _assemble(request_id: str, shape: RunShape, spans: list[Span], start: int, end: int,
              late_flags: dict[int, int], rule: RecomputeRule, weight_version: str | None) -> RouteRows:
    return _locate(request_id, shape, spans, start, end, late_flags, rule, weight_version).rows()


@dataclass
class Located:
    """Rows `[start, end)` of one request, dense by position, with the ids not yet copied: per position the span
    serving it (`span`, an index into `sources`; -1 for a GAP row) and its row there; the small columns dense already.

    `rows()` materialises the `RouteRows` (a view of the one span where one serves the range in order);
    `copy_ids` copies the ids of some positions only, straight from their spans (a trainer slice's rows)."""

    request_id: str
    shape: RunShape
    positions: np.ndarray  # int32 (n,)
    token_ids: np.ndarray  # int32 (n,)
    flags: np.ndarray  # uint16 (n,)
    versions: WeightVersions | None  # None: none known
    sources: list[np.ndarray]  # each span's ids (rows, L*K): views of the mapped segments
    span: np.ndarray  # int64 (n,)
    row: np.ndarray  # int64 (n,)
    _steps: np.ndarray | None = field(default=None, repr=False, compare=False)  # `steps()`, made on first use

    def rows(self) -> RouteRows:
        """The located rows as a `RouteRows`."""
        return RouteRows(self.request_id, self.shape, self.positions, self.token_ids, self.ids(), self.flags,
                         self.versions)

    def cut(self, start: int, end: int) -> Located:
        """Positions `[start, end)` of a location made from position 0 (views)."""
        part = slice(start, end)
        versions = None if self.versions is None else self.versions.take(part)
        steps = self.steps()
        steps = steps[np.searchsorted(steps, start, "right"): np.searchsorted(steps, end - 1, "right")] - start
        return Located(self.request_id, self.shape, self.positions[part], self.token_ids[part], self.flags[part],
                       versions, self.sources, self.span[part], self.row[part], steps)

    @property
    def nbytes(self) -> int:
        """Bytes of the location's own arrays (not of the ids it points at)."""
        arrays = [self.positions, self.token_ids, self.flags, self.span, self.row, self.steps()]
        if self.versions is not None:
            arrays.append(self.versions.index)
        return sum(a.nbytes for a in arrays)

    def with_sources(self, sources: list[np.ndarray]) -> Located:
        """This location over other ids arrays (the same segments' columns, as opened now)."""
        return Located(self.request_id, self.shape, self.positions, self.token_ids, self.flags, self.versions,
                       sources, self.span, self.row, self._steps)

    def ids(self) -> np.ndarray:
        """Every position's ids `(n, L*K)`: a view when one span serves them all in order, else a copy (GAP rows
        zero)."""
        n = len(self.positions)
        if n and self.span[0] >= 0 and (self.span == self.span[0]).all() and \
                self.row[-1] - self.row[0] == n - 1 and (n < 3 or (np.diff(self.row) == 1).all()):
            return self.sources[int(self.span[0])][self.row[0]: self.row[0] + n]
        out = np.zeros((n, self.shape.row_width), self.shape.dtype)
        self.copy_ids(out, np.arange(n), np.arange(n))
        return out

    def copy_ids(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray,
                 ordinals: np.ndarray | None = None) -> None:
        """`out[dst[j]] = ` the ids at position `start + offsets[j]`, of the MoE layers `ordinals` (None: all;
        `out` is then `(m, L*K)`, else `(m, len(ordinals), K)`); a GAP row's slot is left as it is. Rows that follow
        each other in one span and in `out` go in one copy (a request's rows come in a few runs per span)."""
        runs = contiguous_runs(dst, offsets)
        if runs is None:  # scattered in `out` (a run cut at many of the location's own steps: `copy_run` gathers it)
            self._gather(out, dst, offsets, ordinals)
            return
        for a, b in runs:
            self.copy_run(out, int(dst[a]), int(offsets[a]), b - a, ordinals)

    def copy_run(self, out: np.ndarray, dst: int, offset: int, count: int,
                 ordinals: np.ndarray | None = None) -> None:
        """`copy_ids` of offsets `[offset, offset + count)` to `out[dst:dst + count]`: cut where the location's own
        runs end (`steps`), one copy per piece."""
        steps = self.steps()
        end = offset + count
        cuts = steps[np.searchsorted(steps, offset, "right"): np.searchsorted(steps, end - 1, "right")].tolist()
        if len(cuts) > max(64, count // 4):
            self._gather(out, np.arange(dst, dst + count), np.arange(offset, end), ordinals)
            return
        for lo, hi in zip([offset, *cuts], [*cuts, end]):
            s = int(self.span[lo])
            if s >= 0:  # (a GAP run is left as it is)
                r = int(self.row[lo])
                self._put(out, slice(dst + lo - offset, dst + hi - offset), self.sources[s][r: r + hi - lo], ordinals)

    def steps(self) -> np.ndarray:
        """Offsets where the span or the row does not follow on from the offset before (made once)."""
        if self._steps is None:
            self._steps = np.flatnonzero((np.diff(self.span) != 0) | (np.diff(self.row) != 1)) + 1
        return self._steps

    def _gather(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray, ordinals: np.ndarray | None) -> None:
        """Scattered rows: one gather per span."""
        spans, rows = self.span[offsets], self.row[offsets]
        for s in np.unique(spans[spans >= 0]).tolist():
            mine = np.flatnonzero(spans == s)
            self._put(out, dst[mine], self.sources[s][rows[mine]], ordinals)

    def _put(self, out: np.ndarray, where: slice | np.ndarray, block: np.ndarray, ordinals: np.ndarray | None) -> None:
        if ordinals is None:
            out[where] = block
        else:
            out[where] = block.reshape(len(block), self.shape.num_moe_layers, self.shape.top_k)[:, ordinals]


def contiguous_runs(dst: np.ndarray, src: np.ndarray, max_runs: int = 64) -> list[tuple[int, int]] | None:
    """[a, b) ranges where both `dst` and `src` step by one; None when there are more than `max_runs` (scattered
    rows: a gather pays off then); none for no rows."""
    if not len(dst):
        return []
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    if len(breaks) >= max_runs:
        return None
    edges = [0, *breaks.tolist(), len(dst)]
    return list(zip(edges[:-1], edges[1:]))


def _span_rows(spans: list[Span], source_index: list[int]) -> Pieces:
    """Every span's small columns, one after another, each row's ids standing in as `(source, row)` (a `(m, 2)`
    array in the `experts` slot): built with one copy per column, not per span."""
    counts = np.array([span.count for span in spans], np.int64)
    m = int(counts.sum())
    firsts = np.array([span.start for span in spans], np.int64)
    where = np.empty((m, 2), np.int64)
    where[:, 0] = np.repeat(np.asarray(source_index, np.int64), counts)
    where[:, 1] = np.arange(m, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts - firsts, counts)

    def column(name: str, dtype) -> np.ndarray:
        return np.concatenate([getattr(span.source, name)[span.start: span.start + span.count] for span in spans]) \
            if spans else np.zeros(0, dtype)

    versions = [span.source.versions for span in spans]
    if all(v.all_unknown for v in versions):
        joined = WeightVersions.unknown(m)
    else:
        joined = WeightVersions.concat(v.take(slice(span.start, span.start + span.count))
                                       for v, span in zip(versions, spans))
    return Pieces(column("positions", np.int32), column("token_ids", np.int32), where, column("flags", np.uint16),
                  joined)


def _painted(request_id: str, shape: RunShape, spans: list[Span], sources: list[np.ndarray], source_index: list[int],
             start: int, end: int, late_flags: dict[int, int]) -> Located | None:
    """`_locate` of a plain read (FIRST, no version named) whose spans each hold consecutive positions, one row each
    (a stored request's common case): each span's rows found by arithmetic and its small columns copied as slices,
    the spans laid last to first so that a position's first span wins. None when a span is not so (`_locate` then
    decides on the rows)."""
    n = end - start
    span_at = np.full(n, -1, np.int64)
    base = np.zeros(n, np.int64)  # row = base + slot
    flags = np.full(n, int(Flag.GAP), np.uint16)
    tokens = np.full(n, NO_TOKEN, np.int32)
    labels: dict[str, int] = {}  # every span's segment's labels, in span order (as `_span_rows` merges them)
    remaps: list[np.ndarray | None] = [None] * len(spans)
    if any(span.source.versions_known for span in spans):
        remaps = [np.array([labels.setdefault(label, len(labels)) for label in span.source.versions.labels]
                           + [UNKNOWN], np.int16) for span in spans]
    version = np.full(n, UNKNOWN, np.int16) if labels else None
    for k in range(len(spans) - 1, -1, -1):
        span = spans[k]
        source, first, count = span.source, span.start, span.count
        if not source.dense(first, count):
            return None
        at = int(source.positions[first])
        lo, hi = max(at, start) - start, min(at + count, end) - start
        if lo >= hi:
            continue
        row = first + lo + start - at
        span_at[lo:hi] = source_index[k]
        base[lo:hi] = row - lo
        flags[lo:hi] = source.flags[row: row + hi - lo]
        tokens[lo:hi] = source.token_ids[row: row + hi - lo]
        remap = remaps[k]
        if version is not None and remap is not None:
            version[lo:hi] = remap[source.versions.index[row: row + hi - lo]]
    for position, bits in late_flags.items():
        if start <= position < end:
            flags[position - start] |= bits
    versions = None if version is None or bool(np.all(version == UNKNOWN)) else WeightVersions(tuple(labels), version)
    return Located(request_id, shape, np.arange(start, end, dtype=np.int32), tokens, flags, versions, sources,
                   span_at, base + np.arange(n))


def _sources(spans: list[Span]) -> tuple[list[np.ndarray], list[int]]:
    """The ids arrays the spans read (spans of one segment share its ids), and each span's index into them."""
    sources: list[np.ndarray] = []
    source_of: dict[int, int] = {}  # id(columns) -> index into sources
    for span in spans:
        source_of.setdefault(id(span.source), len(sources))
        if len(sources) < len(source_of):
            sources.append(span.source.experts)
    return sources, [source_of[id(span.source)] for span in spans]


def _locate(request_id: str, shape: RunShape, spans: list[Span], start: int, end: int,
            late_flags: dict[int, int], rule: RecomputeRule, weight_version: str | None) -> Located:
    """Which span and row serves each position of `[start, end)` (module docstring), decided on the small columns
    alone: each span's ids stay where they are. A plain read of spans that each hold consecutive positions is laid
    out span by span (`_painted`), any other decided row by row (`_located_by_rows`)."""
    sources, source_index = _sources(spans)
    if rule == RecomputeRule.FIRST and weight_version is None:
        painted = _painted(request_id, shape, spans, sources, source_index, start, end, late_flags)
        if painted is not None:
            return painted
    return _located_by_rows(request_id, shape, spans, sources, source_index, start, end, late_flags, rule,
                            weight_version)


def _located_by_rows(request_id: str, shape: RunShape, spans: list[Span], sources: list[np.ndarray],
                     source_index: list[int], start: int, end: int, late_flags: dict[int, int], rule: RecomputeRule,
                     weight_version: str | None) -> Located:
    """`_locate` on every span's rows one after another: sorted by position, the row `rule` serves of each kept."""
    rows = _span_rows(spans, source_index)
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
    if len(rows.positions) == n and not late_flags:
        return Located(request_id, shape, rows.positions, rows.token_ids, rows.flags, served_versions, sources,
                       rows.experts[:, 0], rows.experts[:, 1])

    out_positions = np.arange(start, end, dtype=np.int32)
    out_span = np.full(n, -1, np.int64)
    out_row = np.zeros(n, np.int64)
    out_flags = np.full(n, int(Flag.GAP), np.uint16)
    out_tokens = np.full(n, NO_TOKEN, np.int32)
    slots = rows.positions - start
    out_span[slots] = rows.experts[:, 0]
    out_row[slots] = rows.experts[:, 1]
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
    return Located(request_id, shape, out_positions, out_tokens, out_flags, out_versions, sources, out_span, out_row)
