"""Locating a request's rows (store/requests/rows.py): the span-by-span layout of a plain read against the
row-by-row decision, on requests stored every way a store holds them.

A plain read (FIRST, no weight version named) whose spans each hold consecutive positions is laid out span by
span, a span's rows found by arithmetic (`_painted`); every other read decides row by row (`_located_by_rows`).
Both must locate the same row for every position, with the same flags, tokens and versions: here on random
requests whose rows came in many segments, resent, recomputed, conflicting, with gaps, weight versions known or
not, and late CONFLICT flags. A span holding a position twice, or skipping one, is never laid out by arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_format import Flag, RunShape
from replay_format.weight_versions import UNKNOWN, RecomputeRule, WeightVersions
from replay_service.store.requests.rows import (
    Located,
    Pieces,
    Span,
    _locate,
    _located_by_rows,
    _painted,
    _sources,
)

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16)
LABELS = ("v1", "v2", "v3")


def _segment(rng: np.random.Generator, positions: np.ndarray, versions_known: bool) -> Pieces:
    """A segment's columns holding `positions` (sorted, as a segment keeps a request's rows), other requests' rows
    around them: its rows for this request are `[pad, pad + len(positions))`."""
    pad = int(rng.integers(0, 4))
    n = pad + len(positions) + int(rng.integers(0, 4))
    all_positions = np.concatenate([np.full(pad, 10_000, np.int32), positions.astype(np.int32),
                                    np.full(n - pad - len(positions), 20_000, np.int32)])
    flags = np.where(rng.random(n) < 0.15, rng.choice([int(Flag.ZERO), int(Flag.CONFLICT), int(Flag.STALE)], n),
                     0).astype(np.uint16)
    if versions_known:
        labels = tuple(rng.permutation(LABELS)[: int(rng.integers(1, 4))])
        index = rng.integers(-1, len(labels), n).astype(np.int16)
        versions = WeightVersions(labels, index)
    else:
        versions = WeightVersions.unknown(n)
    return Pieces(all_positions, rng.integers(0, 1000, n).astype(np.int32),
                  rng.integers(0, SHAPE.num_experts, (n, SHAPE.row_width)).astype(SHAPE.dtype), flags, versions)


def _request(rng: np.random.Generator, length: int, dense_only: bool) -> list[Span]:
    """A request's spans in the order it came to hold them: runs of positions (a batch's decode steps or a prefill),
    some resent or recomputed later, some positions never sent; unless `dense_only`, some spans hold a position twice
    (a resend inside one batch) or skip one."""
    spans = []
    at = 0
    while at < length:
        count = int(rng.integers(1, 12))
        positions = np.arange(at, min(at + count, length))
        if rng.random() < 0.2:  # a gap: these positions never arrive
            at += count
            continue
        if not dense_only and rng.random() < 0.2:
            positions = np.sort(np.concatenate([positions, positions[: int(rng.integers(1, len(positions) + 1))]]))
        if not dense_only and rng.random() < 0.1 and len(positions) > 2:
            positions = np.delete(positions, 1)
        source = _segment(rng, positions, versions_known=bool(rng.random() < 0.6))
        pad = int(np.flatnonzero(source.positions == positions[0])[0])
        spans.append(Span(source, pad, len(positions)))
        at += count
    for _ in range(int(rng.integers(0, 4))):  # resends and recomputes of earlier positions, held after them
        lo = int(rng.integers(0, length))
        positions = np.arange(lo, min(lo + int(rng.integers(1, 8)), length))
        source = _segment(rng, positions, versions_known=bool(rng.random() < 0.6))
        pad = int(np.flatnonzero(source.positions == positions[0])[0])
        spans.append(Span(source, pad, len(positions)))
    order = rng.permutation(len(spans)) if rng.random() < 0.3 else np.arange(len(spans))
    return [spans[i] for i in order]


def _same(a: Located, b: Located) -> None:
    assert a.positions.tolist() == b.positions.tolist()
    assert a.flags.tolist() == b.flags.tolist()
    assert a.token_ids.tolist() == b.token_ids.tolist()
    if a.versions is None or b.versions is None:
        assert a.versions is None and b.versions is None
    else:
        assert a.versions.labels == b.versions.labels
        assert a.versions.index.tolist() == b.versions.index.tolist()
    assert a.ids().tobytes() == b.ids().tobytes()
    served = a.span >= 0
    assert a.span[served].tolist() == b.span[served].tolist() and a.row[served].tolist() == b.row[served].tolist()


@pytest.mark.parametrize("seed", range(300))
def test_a_plain_read_laid_out_span_by_span_locates_what_row_by_row_does(seed):
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 80))
    spans = _request(rng, length, dense_only=bool(seed % 2))
    start = int(rng.integers(0, length))
    end = int(rng.integers(start + 1, length + 3))
    late = {int(p): int(Flag.CONFLICT) for p in rng.integers(0, length + 2, int(rng.integers(0, 3)))}
    sources, index = _sources(spans)
    by_rows = _located_by_rows("r", SHAPE, spans, sources, index, start, end, late, RecomputeRule.FIRST, None)
    painted = _painted("r", SHAPE, spans, sources, index, start, end, late)
    every_span_dense = all(span.source.dense(span.start, span.count) for span in spans)
    assert (painted is not None) == every_span_dense
    if seed % 2:
        assert painted is not None  # a store's common case: never left to the row-by-row decision
    if painted is not None:
        _same(painted, by_rows)
    _same(_locate("r", SHAPE, spans, start, end, late, RecomputeRule.FIRST, None), by_rows)


def test_dense_counts_a_span_holding_a_position_twice_or_skipping_one_as_not_consecutive():
    positions = np.array([5, 6, 7, 7, 8, 10, 11, 12], np.int32)
    n = len(positions)
    pieces = Pieces(positions, np.zeros(n, np.int32), np.zeros((n, SHAPE.row_width), SHAPE.dtype),
                    np.zeros(n, np.uint16), WeightVersions.unknown(n))
    assert pieces.dense(0, 3) and pieces.dense(3, 2) and pieces.dense(5, 3) and pieces.dense(4, 1)
    assert not pieces.dense(0, 4)  # 7 twice
    assert not pieces.dense(4, 2)  # 8 then 10
    assert not pieces.dense(0, n)


def test_a_position_held_first_by_a_later_span_keeps_the_first_span_s_row():
    """Spans are laid out last to first: where two hold a position, the one the request held first is served."""
    first = Pieces(np.arange(0, 4, dtype=np.int32), np.arange(4, dtype=np.int32),
                   np.full((4, SHAPE.row_width), 1, SHAPE.dtype), np.zeros(4, np.uint16), WeightVersions.single("a", 4))
    again = Pieces(np.arange(2, 6, dtype=np.int32), np.arange(4, dtype=np.int32) + 100,
                   np.full((4, SHAPE.row_width), 2, SHAPE.dtype), np.zeros(4, np.uint16), WeightVersions.single("b", 4))
    spans = [Span(first, 0, 4), Span(again, 0, 4)]
    sources, index = _sources(spans)
    got = _painted("r", SHAPE, spans, sources, index, 0, 7, {})
    assert got is not None
    assert got.ids()[:, 0].tolist() == [1, 1, 1, 1, 2, 2, 0]
    assert got.flags.tolist() == [0, 0, 0, 0, 0, 0, int(Flag.GAP)]
    assert got.versions is not None and got.versions.labels == ("a", "b")
    assert got.versions.index.tolist() == [0, 0, 0, 0, 1, 1, UNKNOWN]
