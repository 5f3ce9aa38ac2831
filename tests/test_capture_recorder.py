"""StepRecorder: write stamps, STALE flags, out-of-range ids, and the seed-002 scenario on gloo.

Each test runs on both recorder paths: the CPU stage (numpy, what CPU engines use) and
the torch buffers with write stamps (what a GPU engine uses, here on CPU tensors).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from capture import RowSharding, StepRecorder, restore_rows
from replay_format import Flag, RunShape
from replay_format.rows import RowsMeta, experts_view
from tests.support.gloo import gloo_pool, groups


@pytest.fixture(autouse=True, params=["cpu-stage", "torch-buffers"])
def recorder_path(request, monkeypatch):
    staged = request.param == "cpu-stage"
    monkeypatch.setitem(globals(), "StepRecorder", functools.partial(_StepRecorder, staged=staged))


_StepRecorder = StepRecorder
L, K = 4, 8
SHAPE = RunShape(num_moe_layers=L, top_k=K, num_experts=128)


def ids(seed: int, n: int, e: int = 128, dtype=torch.int32) -> torch.Tensor:
    return torch.randint(0, e, (n, K), generator=torch.Generator().manual_seed(seed)).to(dtype)


def full_step(rec: _StepRecorder, n: int, seed: int) -> list[torch.Tensor]:
    rec.begin_step()
    layers = [ids(seed * 10 + l_, n) for l_ in range(L)]
    for l_, rows in enumerate(layers):
        rec.record(l_, rows)
    return layers


def test_clean_rows_equal_and_unflagged():
    rec = StepRecorder(SHAPE, max_tokens=64)
    layers = full_step(rec, 50, seed=1)
    out = rec.end_step(["a"] * 30 + ["b"] * 20, np.arange(50), token_ids=np.arange(50) + 7)
    assert out.experts.dtype == np.uint8 and out.experts.shape == (50, L, K)
    assert np.array_equal(out.experts, torch.stack(layers, 1).numpy())
    assert not out.flags.any() and out.stale_rows == 0 and out.invalid_rows == 0


def test_uint16_and_narrow_input_dtypes():
    rec = StepRecorder(RunShape(L, K, 300), max_tokens=16)
    rec.begin_step()
    layers = [ids(l_, 10, e=300, dtype=torch.int64) for l_ in range(L - 1)] + [ids(9, 10, e=128, dtype=torch.uint8)]
    for l_, rows in enumerate(layers):
        rec.record(l_, rows)
    out = rec.end_step(["r"] * 10, np.arange(10))
    assert out.experts.dtype == np.uint16
    assert np.array_equal(out.experts, torch.stack([x.long() for x in layers], 1).numpy())
    assert not out.flags.any()


def test_never_written_and_leftover_rows_are_stale():
    rec = StepRecorder(SHAPE, max_tokens=64)
    rec.begin_step()
    rec.record(0, ids(1, 20))  # layers 1..3 never written: all-zero rows
    out = rec.end_step(["r"] * 20, np.arange(20))
    assert (out.flags == Flag.STALE).all() and out.stale_rows == 20

    old = full_step(rec, 40, seed=2)
    rec.end_step(["r"] * 40, np.arange(40))
    # Next step: 40 rows again, but layer 2 only wrote 25 (rows 25..39 still hold the old ids).
    rec.begin_step()
    new = [ids(30 + l_, 40) for l_ in range(L)]
    for l_ in range(L):
        rec.record(l_, new[l_] if l_ != 2 else new[l_][:25])
    out = rec.end_step(["r"] * 40, np.arange(40))
    assert not out.flags[:25].any()
    assert (out.flags[25:] == Flag.STALE).all()
    assert np.array_equal(out.experts[25:, 2], old[2][25:].numpy())  # leftover data, but flagged
    assert np.array_equal(out.experts[:25], torch.stack(new, 1)[:25].numpy())


def test_out_of_range_ids_never_wrap_silently():
    rec = StepRecorder(SHAPE, max_tokens=16)
    rec.begin_step()
    layers = [ids(l_, 10) for l_ in range(L)]
    layers[1][3, 5] = -1  # padding id
    layers[2][7, 0] = 200  # >= num_experts
    for l_, rows in enumerate(layers):
        rec.record(l_, rows)
    out = rec.end_step(["r"] * 10, np.arange(10))
    assert out.flags[3] == Flag.STALE and out.flags[7] == Flag.STALE
    assert out.invalid_rows == 2 and out.stale_rows == 2
    assert not np.delete(out.flags, [3, 7]).any()
    assert out.experts[3, 1, 5] == 255 and out.experts[7, 2, 0] == 255  # >= 128: the service flags OUT_OF_RANGE too
    assert out.experts[3, 1, 4] == layers[1][3, 4]  # the rest of the row is kept
    rec16 = StepRecorder(RunShape(L, K, 300), max_tokens=4)
    rec16.begin_step()
    for l_ in range(L):
        rec16.record(l_, torch.full((2, K), -1, dtype=torch.int64))
    out = rec16.end_step(["r", "r"], [0, 1])
    assert (out.experts == 65535).all() and (out.flags == Flag.STALE).all()


def test_more_rows_than_the_step_flags_the_step():
    rec = StepRecorder(SHAPE, max_tokens=64)
    full_step(rec, 30, seed=3)
    out = rec.end_step(["r"] * 20, np.arange(20))  # rows do not line up with the scheduler's
    assert (out.flags == Flag.STALE).all()


def test_copy_survives_the_next_step_and_builds_a_batch():
    rec = StepRecorder(SHAPE, max_tokens=32)
    layers = full_step(rec, 12, seed=4)
    out = rec.end_step(["q"] * 12, np.arange(12), token_ids=np.arange(12))
    full_step(rec, 12, seed=5)
    rec.end_step(["q"] * 12, np.arange(12))
    assert np.array_equal(out.experts, torch.stack(layers, 1).numpy())
    batch = out.to_batch(RowsMeta(run_id="run1", writer_id="w0", seq=0, shape=SHAPE, source="vllm-plugin"))
    assert np.array_equal(experts_view(batch.column("experts"), SHAPE), out.experts)
    assert batch.column("flags").to_pylist() == [0] * 12


def test_misuse_raises():
    rec = StepRecorder(SHAPE, max_tokens=8)
    with pytest.raises(RuntimeError):
        rec.record(0, ids(0, 2))
    rec.begin_step()
    with pytest.raises(ValueError, match="layer_idx"):
        rec.record(L, ids(0, 2))
    with pytest.raises(ValueError, match=r"\[n, 8\]"):
        rec.record(0, torch.zeros((2, 3), dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        rec.record(0, torch.zeros((2, K)))
    with pytest.raises(ValueError, match="max_tokens"):
        rec.record(0, ids(0, 9))
    with pytest.raises(ValueError, match="positions"):
        rec.end_step(["a"], [0, 1])


# ---- seed 002 on real collectives: All2All, TP=2, DP=1 ---------------------------------------


def run_seed_002(n: int) -> dict | None:
    gr = groups(1, 1, 2)
    if not gr.active:
        return None
    t = gr.tp_rank
    warm = [ids(900 + l_, n) for l_ in range(L)]  # an earlier batch (warm-up) left in the buffer
    batch = [ids(100 + l_, n) for l_ in range(L)]  # this step's whole batch, per layer
    sharding = RowSharding(num_tokens=n, strategy="alltoall", tp_size=2, tp_rank=t)

    def shard(x):  # vllm-ascend All2All.prepare: pad to tp only if smaller, tensor_split
        x = torch.cat([x, torch.full((max(0, 2 - n), K), -1, dtype=x.dtype)])
        return torch.tensor_split(x, 2)[t]

    res = {}
    for name, fixed in (("buggy", False), ("fixed", True)):
        rec = StepRecorder(SHAPE, max_tokens=max(n, 8))
        rec.begin_step()
        for l_ in range(L):
            rec.record(l_, warm[l_])
        rec.end_step(["w"] * n, np.arange(n))
        rec.begin_step()
        for l_ in range(L):
            local = shard(batch[l_])
            rec.record(l_, restore_rows(local, sharding, tp_group=gr.tp_group) if fixed else local)
        out = rec.end_step(["r"] * n, np.arange(n))
        res[name] = {
            "flags": out.flags.tolist(),
            "equal": np.array_equal(out.experts, torch.stack(batch, 1).numpy()),
            "rows_equal": [bool(np.array_equal(out.experts[i], torch.stack(batch, 1)[i].numpy())) for i in range(n)],
            "shard": shard(batch[0]).shape[0],
        }
    return res


@pytest.mark.parametrize("n", [1, 6, 241])
def test_seed_002_only_shard_written_is_flagged(n):
    for t, r in enumerate(gloo_pool(8).run(run_seed_002, n)[:2]):
        fixed, buggy = r["fixed"], r["buggy"]
        assert fixed["equal"] and not any(fixed["flags"])  # gathered: every row clean and right
        s = min(buggy["shard"], n)
        # The shard-only capture: rows past the shard hold the warm-up batch, flagged STALE.
        assert all(f == Flag.STALE for f in buggy["flags"][s:])
        assert not buggy["equal"] or n == 1 and t == 0
        stale_rows = [i for i, f in enumerate(buggy["flags"]) if f]
        wrong_rows = [i for i, ok in enumerate(buggy["rows_equal"]) if not ok]
        if t == 0:  # TP rank 0 (the rank that reports): every wrong row is flagged
            assert set(wrong_rows) <= set(stale_rows)
        if n > 1:
            assert stale_rows  # the failure arrives flagged instead of as data


# ---- keep(): rows by reference, copied at end_step (the CPU engine hook's path) -------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kept_layers_equal_recorded_layers(dtype):
    n, padded = 5, 8  # the engine may hand over padding rows past the step's count
    layers = [ids(40 + l_, padded, dtype=dtype) for l_ in range(L)]
    kept, recorded = StepRecorder(SHAPE, max_tokens=16), StepRecorder(SHAPE, max_tokens=16)
    for rec in (kept, recorded):
        rec.begin_step()
    for l_, rows in enumerate(layers):
        kept.keep(l_, rows)
        recorded.record(l_, rows[:n])
    a, b = kept.end_step(["r"] * n, np.arange(n)), recorded.end_step(["r"] * n, np.arange(n))
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.experts, torch.stack(layers, 1)[:n].numpy())
    assert not a.flags.any() and a.experts.flags.c_contiguous


def test_kept_rows_checked_like_recorded_rows():
    rec = StepRecorder(SHAPE, max_tokens=16)
    n = 4
    # A layer never kept: every row STALE.
    rec.begin_step()
    for l_ in range(L - 1):
        rec.keep(l_, ids(l_, n))
    assert (rec.end_step(["r"] * n, np.arange(n)).flags == Flag.STALE).all()
    # A layer kept twice in one step (two micro-batches?): rows do not line up, the step is STALE.
    rec.begin_step()
    for l_ in list(range(L)) + [0]:
        rec.keep(l_, ids(l_, n))
    assert (rec.end_step(["r"] * n, np.arange(n)).flags == Flag.STALE).all()
    # A -1 in int32 ids (negative, so huge once unsigned): that row only, stored as the sentinel.
    rec.begin_step()
    layers = [ids(l_, n) for l_ in range(L)]
    layers[2][1, 3] = -1
    for l_, rows in enumerate(layers):
        rec.keep(l_, rows)
    out = rec.end_step(["r"] * n, np.arange(n))
    assert out.flags.tolist() == [0, Flag.STALE, 0, 0] and out.invalid_rows == 1 and out.experts[1, 2, 3] == 255
