"""A read's fixed costs, cut without changing what it answers.

- A route read asks the index for the request's row and spans only: the weight-version spans of its summary are
  the summary's (`request_summary`), not the read's (`request_to_read`). A record made for a read cannot be
  answered as a summary.
- `.npy` headers are numpy's own, kept per (dtype, shape); the body is always C order, and the header says so.
- A `weight_version` column with no known version (every Arrow answer and batch of a writer that sends none) is
  read as unknown rows without folding its dictionary.
- A slice's rows are copied a run at a time (THD: one run per sequence, two under zigzag CP), BSHD's scattered
  tokens a sequence at a time, with the same answer as copying each token by itself.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest

from replay_format import FormatError, RunShape
from replay_format.rows import Rows, RowsMeta
from replay_format.trainer_query import CpSplit, MegatronQuery, Packing, SequenceRef, StageLayers
from replay_format.trainer_slice import MissingPolicy
from replay_format.weight_versions import INDEX_TYPE, MAX_LABELS, UNKNOWN, RecomputeRule, WeightVersions
from replay_service.api.encode import npy_header, npy_parts
from replay_service.app import open_store
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.trainer.gather import DenseIds, RowsRead, gather_rows, held_layers, row_runs
from replay_service.trainer.layouts import SequenceSpec
from replay_service.trainer.plans import SliceLimits, planner
from replay_service.trainer.reads import micro_batch_runs, stored_sequences
from replay_service.trajectory import read_trajectory
from tests.support.data import many_routes

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16)


def _versioned_rows(n: int) -> Rows:
    experts = many_routes(np.random.default_rng(11), n, SHAPE).reshape(n, -1)
    versions = WeightVersions.of_labels(["v1"] * (n // 2) + ["v2"] * (n - n // 2))
    return Rows(RowsMeta("costs", "w", 0, SHAPE), ["a"], np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                np.arange(n, dtype=np.int32), experts, np.zeros(n, np.uint16), versions)


def test_reads_do_not_look_up_version_spans(tmp_path, monkeypatch):
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        rows = _versioned_rows(40)
        pipeline.ingest(rows)
        store.finish("costs", "a", 41, "finished")
        summary = store.request_summary("costs", "a").to_json()
        assert summary["weight_versions"] == [{"version": "v1", "start": 0, "end": 20},
                                              {"version": "v2", "start": 20, "end": 40}]

        def looked_up(*_args):
            raise AssertionError("a read looked up the summary's version spans")

        monkeypatch.setattr(store.index, "version_spans", looked_up)
        route = store.read_route("costs", "a")
        assert np.array_equal(route.experts, rows.experts) and route.weight_versions is not None
        assert [s.to_json() for s in route.weight_versions.spans(route.positions)] == summary["weight_versions"]
        record = store.request_to_read(store.run_to_read("costs"), "a")
        assert record.expected_rows == 40 and record.weight_versions is None
        with pytest.raises(ValueError, match="no weight-version spans"):
            record.to_json()
        refs = (SequenceRef("costs", "a"),)
        assert stored_sequences(store, refs, micro_batch_runs(store, refs))[0].spec.rows == 40
        assert read_trajectory(store, "costs", ["a"], RecomputeRule.FIRST, 8).route.num_rows == 40
    finally:
        store.close()


@pytest.mark.parametrize("array", [
    np.arange(384, dtype=np.uint8).reshape(1, 48, 8),
    np.arange(24, dtype=np.uint16).reshape(2, 3, 4),
    np.zeros((0, 48, 8), np.uint8),
    np.arange(12, dtype=np.int32).reshape(3, 4).T,  # Fortran-ordered: sent in C order, and said so
], ids=["uint8", "uint16", "empty", "fortran"])
def test_npy_answers_are_what_numpy_saves(array):
    body = b"".join(bytes(p) for p in npy_parts(array))
    saved = io.BytesIO()
    np.save(saved, np.ascontiguousarray(array))
    assert body == saved.getvalue()
    back = np.load(io.BytesIO(body))
    assert back.dtype == array.dtype and np.array_equal(back, array)


def test_npy_headers_are_kept_per_dtype_and_shape():
    one = np.zeros((4, 48, 8), np.uint8)
    assert npy_parts(one)[0] is npy_parts(one.copy())[0]
    assert npy_header(np.dtype(np.uint8), (5, 48, 8)) != npy_header(np.dtype(np.uint8), (4, 48, 8))
    assert npy_header(np.dtype(np.uint16), (4, 48, 8)) != npy_header(np.dtype(np.uint8), (4, 48, 8))


def test_a_column_of_no_known_version_reads_as_unknown_rows():
    """The all-null `weight_version` column (a writer that sends no versions) takes a short way; a column with one
    known row among nulls, and a dictionary naming too many versions, take the long one as before."""
    none_known = pa.DictionaryArray.from_arrays(pa.array([None] * 5, INDEX_TYPE), pa.array(["v1", "v2"]))
    read = WeightVersions.from_arrow(none_known)
    assert read.labels == () and read.index.tolist() == [UNKNOWN] * 5 and read.index.dtype == np.int16
    assert WeightVersions.from_arrow(pa.array([None] * 3, pa.utf8())).index.tolist() == [UNKNOWN] * 3
    one_known = pa.DictionaryArray.from_arrays(pa.array([None, None, 1, None, None], INDEX_TYPE),
                                               pa.array(["v1", "v2"]))
    read = WeightVersions.from_arrow(one_known)
    assert read.labels == ("v2",) and read.index.tolist() == [UNKNOWN, UNKNOWN, 0, UNKNOWN, UNKNOWN]
    too_many = pa.DictionaryArray.from_arrays(pa.array([None] * 2, INDEX_TYPE),
                                              pa.array([f"v{i}" for i in range(MAX_LABELS + 1)]))
    with pytest.raises(FormatError, match="at most"):
        WeightVersions.from_arrow(too_many)


def test_each_read_takes_its_run_once(tmp_path, monkeypatch):
    """A trainer slice looks each run up once, however many of its sequences name it, and a route or trajectory
    read or a health report once: with several workers every lookup is an index query (`Index.shared`). A slice
    looked each sequence's run up three times (the shape check, the run its rows are read under, the request's
    record), a route read and a health report twice."""
    from replay_format.trainer_query import MegatronQuery
    from replay_service.health.gather import run_health
    from replay_service.trainer.plans import SliceLimits
    from replay_service.trainer.reads import read_slice

    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        rows = _versioned_rows(40)
        pipeline.ingest(rows)
        store.finish("costs", "a", 41, "finished")
        looked_up: list[str] = []
        get = store.registry.get

        def counted(run_id):
            looked_up.append(run_id)
            return get(run_id)

        monkeypatch.setattr(store.registry, "get", counted)
        query = MegatronQuery(sequences=(SequenceRef("costs", "a"),) * 3)
        answer = read_slice(store, query, SliceLimits.of(store.settings))
        assert answer.valid == 3 * 40 and looked_up == ["costs"]
        looked_up.clear()
        assert store.read_route("costs", "a").num_rows == 40 and looked_up == ["costs"]
        looked_up.clear()
        assert read_trajectory(store, "costs", ["a"], RecomputeRule.FIRST, 8).route.num_rows == 40
        assert looked_up == ["costs"]
        looked_up.clear()
        assert run_health(store, "costs").run_id == "costs" and looked_up == ["costs"]
    finally:
        store.close()


_LAYOUTS = {
    "thd zigzag cp2 sp2": MegatronQuery(sequences=(), cp_size=2, cp_rank=1, tp_size=2, tp_rank=1),
    "thd contiguous cp2": MegatronQuery(sequences=(), cp_size=2, cp_rank=0, cp_split=CpSplit.CONTIGUOUS),
    "thd, two of three MoE layers": MegatronQuery(sequences=(), layers=StageLayers(moe_ordinals=(0, 2))),
    "bshd cp2 sp2": MegatronQuery(sequences=(), packing=Packing.BSHD, cp_size=2, cp_rank=0, tp_size=2, tp_rank=1),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_a_slice_copied_run_by_run_is_each_token_copied_by_itself(layout):
    """`gather_rows` copies a run of tokens (plan index and offset both stepping by one) in one go, a flagged row
    cutting its run, and a sequence scattered over more runs than that pays (BSHD) token by token: the ids, masks
    and versions are those of copying each token on its own."""
    rng = np.random.default_rng(7)
    lengths = [37, 260, 5, 128, 300]
    specs = [SequenceSpec(0, n, n - 1) for n in lengths]  # the last token of each has no row
    experts = [many_routes(rng, n - 1, SHAPE).reshape(n - 1, -1) for n in lengths]
    clean = [rng.random(n - 1) > 0.05 for n in lengths]
    query = _LAYOUTS[layout]
    plan = planner(query, SliceLimits.of(ServiceSettings()))(specs)
    held = held_layers(SHAPE, query.layers)

    def read_rows(i: int, lo: int, hi: int) -> RowsRead:
        return RowsRead(DenseIds(experts[i][lo:hi], SHAPE), clean[i][lo:hi], np.full(hi - lo, i, np.int16))

    got = gather_rows(plan, specs, read_rows, held, MissingPolicy.ROUTER)
    needs_row, runs = row_runs(plan, specs)
    tokens = [(t, int(s), int(o)) for t, (s, o) in enumerate(zip(plan.sequence, plan.offset)) if s >= 0]
    assert needs_row.tolist() == [s >= 0 and o < specs[s].rows for s, o in zip(plan.sequence, plan.offset)]
    assert sorted(d + j for d, n in zip(runs.dst.tolist(), runs.count.tolist()) for j in range(n)) == \
        np.flatnonzero(needs_row).tolist()
    expect_valid = np.zeros(plan.num_tokens, np.uint8)
    ids = got.experts.reshape(plan.num_tokens, len(held.moe_ordinals), SHAPE.top_k)
    for t, s, o in tokens:
        if o < specs[s].rows and clean[s][o]:
            expect_valid[t] = 1
            row = experts[s][o].reshape(SHAPE.num_moe_layers, SHAPE.top_k)[held.moe_ordinals]
            assert np.array_equal(ids[t], row) and got.version[t] == s, (t, s, o)
    assert np.array_equal(got.valid, expect_valid)
    assert got.broken.tolist() == [t for t, s, o in tokens if o < specs[s].rows and not clean[s][o]]
    assert np.array_equal(got.fallback[got.broken], np.ones(len(got.broken), np.uint8))
    assert len(runs.dst) < needs_row.sum() / 8 if query.packing is Packing.THD else len(runs.dst) > 64


def test_a_slice_of_one_token_sequences_reads_no_rows():
    """A one-token sequence has no row (its last token's has none): the plan has no run and nothing is read."""
    specs = [SequenceSpec(0, 1, 0), SequenceSpec(0, 1, 0)]
    plan = planner(_LAYOUTS["thd zigzag cp2 sp2"], SliceLimits.of(ServiceSettings()))(specs)

    def read_rows(i: int, lo: int, hi: int) -> RowsRead:
        raise AssertionError(f"sequence {i} was read")

    got = gather_rows(plan, specs, read_rows, held_layers(SHAPE, StageLayers()), MissingPolicy.STRICT)
    assert not got.valid.any() and not got.broken.size


def test_a_location_that_alternates_between_segments_is_copied_whole():
    """Rows that alternate between two segments every row are gathered per segment (more pieces than a copy each
    pays for), by a run or by scattered tokens, with the ids each token's own row holds; GAP rows are left alone."""
    from replay_service.store.requests.rows import Located

    rng = np.random.default_rng(9)
    n, width = 300, SHAPE.row_width
    sources = [many_routes(rng, n, SHAPE).reshape(n, -1) for _ in range(2)]
    span = np.arange(n, dtype=np.int64) % 2
    span[7] = -1  # a GAP row
    row = rng.permutation(n).astype(np.int64)
    located = Located("alt", SHAPE, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint16),
                      None, sources, span, row)
    expected = np.stack([sources[s][r] if s >= 0 else np.full(width, 255, SHAPE.dtype) for s, r in zip(span, row)])
    whole = np.full((n + 5, width), 255, SHAPE.dtype)
    located.copy_run(whole, 5, 0, n)
    assert np.array_equal(whole[5:], expected)
    picked = np.arange(0, n, 3)
    scattered = np.full((len(picked), width), 255, SHAPE.dtype)
    located.copy_ids(scattered, np.arange(len(picked))[::-1].copy(), picked)
    assert np.array_equal(scattered[::-1], expected[picked])
