"""A batch's request counters are counted for every request at once (`ingest.commit.served_counts`) and written in
one statement per kind (`IndexTransaction.add_counts`, `insert_spans`): the same counts as request by request.

The reference is `RequestCounts.of_rows`, the per-request form (what `add_served` computed before, and what the
prefix-cache resolver still uses for one mirrored span).
"""

from __future__ import annotations

import numpy as np

from replay_format import Flag, RunShape
from replay_format.rows import Rows, RowsMeta
from replay_service.app import open_store
from replay_service.checks.check import check
from replay_service.ingest.commit import served_counts
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.store.index import RequestCounts
from tests.support.data import many_routes

SHAPE = RunShape(num_moe_layers=2, top_k=2, num_experts=8)


def _rows(rng: np.random.Generator, seq: int = 0) -> Rows:
    """Five requests, one of them padding only, rows out of order, every kind of flag among them."""
    request_ids = ["a", "b", "c", "d", "pad"]
    index = np.repeat(np.arange(4, dtype=np.int32), [40, 1, 25, 30])
    positions = np.concatenate([np.arange(40), [7], np.arange(100, 125), np.arange(30)]).astype(np.int32)
    experts = many_routes(rng, len(index), SHAPE).reshape(len(index), -1)
    experts[[3, 50]] = 0  # ZERO
    experts[60] = experts[59]  # a DUPLICATE candidate
    experts[10, 0] = SHAPE.num_experts + 1  # OUT_OF_RANGE
    flags = np.zeros(len(index), np.uint16)
    flags[[5, 6, 70]] = Flag.STALE  # the writer's own STALE
    flags[[12, 80, 81]] = Flag.PADDING  # writer padding: dropped, counted
    index = np.concatenate([index, np.full(3, 4, np.int32)])  # "pad": padding rows only
    positions = np.concatenate([positions, np.arange(3, dtype=np.int32)])
    experts = np.concatenate([experts, np.zeros((3, experts.shape[1]), experts.dtype)])
    flags = np.concatenate([flags, np.full(3, Flag.PADDING, np.uint16)])
    order = rng.permutation(len(index))  # the check sorts by (request, position)
    return Rows(RowsMeta("counts", "w", seq, SHAPE), request_ids, index[order], positions[order],
                np.arange(len(index), dtype=np.int32), experts[order], flags[order])


def _one_by_one(checked, shadowed) -> list[RequestCounts]:
    rows = checked.rows
    counts, with_rows = [], set()
    for lo, hi in checked.request_spans():
        index = int(rows.request_index[lo])
        with_rows.add(index)
        served = ~shadowed[lo:hi]
        counts.append(RequestCounts.of_rows(rows.request_ids[index], rows.positions[lo:hi][served],
                                            checked.flags[lo:hi][served], pos_max=int(rows.positions[hi - 1]),
                                            padding=int(checked.padding_dropped[index])))
    for index in np.flatnonzero(checked.padding_dropped).tolist():
        if index not in with_rows:
            counts.append(RequestCounts(rows.request_ids[index], rows=0, pos_max=-1,
                                        counts={Flag.PADDING: int(checked.padding_dropped[index])}))
    return counts


def _plain(counts: list[RequestCounts]) -> list[tuple]:
    return [(c.request_id, c.rows, c.pos_max, c.flag_bits, c.first_flagged, c.referenced, c.unclean,
             {f: n for f, n in c.counts.items() if n}) for c in counts]


def test_counted_at_once_as_one_by_one():
    rng = np.random.default_rng(3)
    checked = check(_rows(rng), SHAPE)
    assert np.any(checked.flags & Flag.ZERO) and np.any(checked.flags & Flag.OUT_OF_RANGE)
    assert np.any(checked.flags & Flag.STALE) and checked.padding_dropped.sum() == 6
    for shadowed in (np.zeros(checked.num_rows, np.bool_), rng.random(checked.num_rows) < 0.3,
                     np.ones(checked.num_rows, np.bool_)):
        at_once = served_counts(checked, shadowed, checked.request_spans())
        assert _plain(at_once) == _plain(_one_by_one(checked, shadowed))
        assert [c.request_id for c in at_once] == ["a", "b", "c", "d", "pad"]


def test_a_stored_batch_counts_as_its_rows_say(tmp_path):
    """Through the store: each request's summary counts the batch's served rows and flags; a resend counts nothing
    more; a batch whose positions are held already (the spans found by one query) shadows them."""
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        rng = np.random.default_rng(5)
        rows = _rows(rng)
        checked = check(rows, SHAPE)
        pipeline.ingest(rows)
        pipeline.ingest(rows)  # a retry: a duplicate, nothing counted twice
        expected = {c.request_id: c for c in served_counts(checked, checked.shadowed, checked.request_spans())}
        for request_id, want in expected.items():
            got = store.index.request("counts", request_id)
            assert got["rows"] == want.rows, request_id
            assert got["n_padding"] == want.counts.get(Flag.PADDING, 0), request_id
            assert got["n_zero"] == want.counts.get(Flag.ZERO, 0) and got["n_stale"] == want.counts.get(Flag.STALE, 0)
            assert got["unclean"] == want.unclean and got["flag_bits"] == want.flag_bits
        resent = _rows(np.random.default_rng(5), seq=1)  # the same rows under a new seq: every position held
        pipeline.ingest(resent)
        again = {r: store.index.request("counts", r)["rows"] for r in expected}
        assert again == {r: c.rows for r, c in expected.items()}
    finally:
        store.close()
