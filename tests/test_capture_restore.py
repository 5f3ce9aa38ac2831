"""restore_rows against real gloo collectives: every strategy, DP {1,2} x PCP {1,2} x TP {1,2,4}.

Each worker builds, from the whole batch (every DP rank's tokens, generated
deterministically), what its rank's `topk_ids` look like after the engine's forward path
(DP dispatch, PCP gather, TP split as vLLM / vllm-ascend do them, written here with
torch.tensor_split and F.pad, not with capture.worker.sharding), restores them with real
collectives, and compares with that DP rank's tokens. The seeds' buggy logic runs on
the same inputs and must differ from the reference on some rank.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from capture import RowSharding, restore_rows
from capture.worker.restore import all_gather_rows
from capture.worker.sharding import split_sizes
from tests.support.gloo import gloo_pool, groups

K, E = 8, 256
STRATEGIES = ("local", "naive_dp", "padded_dp", "sequence_parallel", "alltoall", "mc2", "fused_mc2")
COMBOS = [(dp, pcp, tp) for dp in (1, 2) for pcp in (1, 2) for tp in (1, 2, 4) if dp * pcp * tp <= 8]
TP_SHARDED = ("alltoall", "mc2", "fused_mc2", "sequence_parallel")


def token_counts(tp: int) -> list[int]:
    return sorted({1, tp - 1, 241, 4099})


def other_dp_count(n: int) -> int:
    return n * 7 // 5 + 3


# ---- the whole batch and the engine's forward path (test side) -------------------------


def dp_tokens(seed: int, d: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + d)
    return torch.randint(0, E, (n, K), generator=g).to(dtype)


def pcp_chunks(tokens: torch.Tensor, pcp: int, seed: int, shuffle: bool, extra: int):
    """Split one DP rank's tokens over PCP ranks, as equal chunks carrying padding.

    Padding rows hold -1 or a garbage id (they must be dropped, never cast). Returns
    chunks [P][C, K], masks [P][C] and the restore index (gathered row of each token)."""
    n = tokens.shape[0]
    chunk = math.ceil(n / pcp) + extra
    slots = pcp * chunk
    gathered = torch.full((slots, K), -1, dtype=tokens.dtype)
    gathered[1::2] = 60000  # garbage on odd padding rows
    if shuffle:
        g = torch.Generator().manual_seed(seed + 17)
        index = torch.randperm(slots, generator=g)[:n]
    else:  # in order: PCP rank p holds its tensor_split piece, padding at the chunk's end
        index = torch.cat(
            [torch.arange(p * chunk, p * chunk + r) for p, r in enumerate(split_sizes(n, pcp))]
        ).long() if n else torch.zeros(0, dtype=torch.long)
    gathered[index] = tokens
    mask = torch.ones(slots, dtype=torch.bool)
    mask[index] = False
    pieces = lambda x: [x[q * chunk : (q + 1) * chunk] for q in range(pcp)]  # noqa: E731
    return pieces(gathered), pieces(mask), index, chunk


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, rows - x.shape[0]), value=-1) if rows > x.shape[0] else x


def engine_topk_ids(strategy, all_chunks, d, p, t, tp, pcp, padded_num_tokens):
    """This rank's topk_ids after dispatch -> PCP gather -> TP split (vLLM order)."""
    dp = len(all_chunks)
    if strategy == "naive_dp":
        return torch.cat([torch.cat([all_chunks[e][q] for e in range(dp)]) for q in range(pcp)])
    if strategy == "padded_dp":
        m = max(c[0].shape[0] for c in all_chunks)
        return torch.cat([torch.cat([pad_rows(all_chunks[e][q], m) for e in range(dp)]) for q in range(pcp)])
    mine = all_chunks[d]
    if strategy == "local":
        return torch.cat(mine)
    if strategy == "sequence_parallel":  # model-level SP: each chunk padded to a multiple of tp, split, then PCP gather
        c = mine[0].shape[0]
        return torch.cat([torch.tensor_split(pad_rows(x, math.ceil(c / tp) * tp), tp)[t] for x in mine])
    batch = torch.cat(mine)  # PCP-gathered batch entering prepare()
    if strategy == "alltoall":  # vllm-ascend All2All.prepare: pad_size = tp - n
        batch = pad_rows(batch, tp)
    else:  # MC2.prepare: pad to padded_num_tokens
        batch = pad_rows(batch, padded_num_tokens)
    return torch.tensor_split(batch, tp)[t]


# ---- the seeds' buggy logic, on the same inputs ------------------------------------------


def bug_no_tp_gather(topk_ids, n):
    """seed 002: the local shard taken as the whole batch; other buffer rows stay zero."""
    buf = torch.zeros((n, K), dtype=topk_ids.dtype)
    m = min(n, topk_ids.shape[0])
    buf[:m] = topk_ids[:m]
    return buf


def bug_skip_gather_when_full(topk_ids, n, sizes, tp_group):
    """The `n != full_num_tokens` guard: skip the gather when the shard looks like a batch."""
    if topk_ids.shape[0] == n:  # decided from the local shard: a 1-token batch padded to tp looks full
        return topk_ids
    return all_gather_rows(topk_ids, sizes, tp_group, pad_value=-1)[:n]


def bug_shard_times_tp(topk_ids, tp, sizes, tp_group):
    """seed 002's rejected row count: shard rows * tp_size (242 on rank 0 and 240 on rank 1 for 241)."""
    gathered = all_gather_rows(topk_ids, sizes, tp_group, pad_value=-1)
    count = topk_ids.shape[0] * tp
    return gathered[:count] if count <= gathered.shape[0] else pad_rows(gathered, count)


def bug_local_mask(rows, local_mask, pcp):
    """seed 000: the rank-local mask applied to the PCP-gathered rows (tiled to fit)."""
    return rows[~local_mask.repeat(pcp)]


# ---- the worker case -------------------------------------------------------------------


def run_grid(strategy: str, dp: int, pcp: int, tp: int) -> list[dict] | None:
    gr = groups(dp, pcp, tp)
    if not gr.active:
        return None
    out = []
    cases = [(n, mode) for n in token_counts(tp) for mode in ((0, 0), (1, 1)) if pcp > 1 or mode == (0, 0)]
    cases += [(241, (0, 2))]  # P=1 too: a local padding mask (2 extra rows per chunk)
    for i, (n0, (shuffle, extra)) in enumerate(cases):
        seed = zlib.crc32(repr((strategy, dp, pcp, tp, n0, shuffle, extra)).encode()) % 10_000
        dtype = torch.int32 if i % 2 == 0 else torch.int64
        counts = [n0 if e == 0 else other_dp_count(n0) for e in range(dp)]
        toks = [dp_tokens(seed, e, counts[e], dtype) for e in range(dp)]
        use_mask = pcp > 1 or extra > 0
        parts = [pcp_chunks(toks[e], pcp, seed + e, bool(shuffle), extra) for e in range(dp)]
        all_chunks = [pt[0] for pt in parts]
        chunk_rows = tuple(pt[3] for pt in parts)
        d, p, t = gr.dp_rank, gr.pcp_rank, gr.tp_rank
        dispatched = strategy in ("naive_dp", "padded_dp") or (strategy in ("mc2", "fused_mc2") and dp > 1)
        tad = chunk_rows if dispatched else None
        explicit_pad = strategy == "mc2" and dp == 1 and i % 3 == 2
        padded = None
        if strategy in ("mc2", "fused_mc2"):
            largest = max(chunk_rows if tad else (chunk_rows[d],))
            padded = math.ceil(pcp * largest / tp) * tp + (tp if explicit_pad else 0)
        topk_ids = engine_topk_ids(strategy, all_chunks, d, p, t, tp, pcp, padded)
        sharding = RowSharding(
            num_tokens=counts[d],
            strategy=strategy,
            tokens_across_dp=tad,
            dp_rank=d,
            tp_size=tp,
            tp_rank=t,
            padded_num_tokens=padded if explicit_pad else None,
            pcp_size=pcp,
            pcp_rank=p,
        )
        mask = parts[d][1][p] if use_mask else None
        index = parts[d][2] if shuffle else None
        got = restore_rows(topk_ids, sharding, tp_group=gr.tp_group, pcp_group=gr.pcp_group,
                           pcp_padding=mask, pcp_restore_index=index)
        ref = toks[d]
        ok = got.dtype == ref.dtype and torch.equal(got, ref)
        res = {"case": (n0, shuffle, extra, counts[d]), "ok": ok, "bugs": {}}
        n = counts[d]
        if strategy in TP_SHARDED and tp > 1 and pcp == 1 and not use_mask and n > 0:
            if strategy == "sequence_parallel":
                sizes = (math.ceil(n / tp),) * tp
            else:
                sizes = split_sizes(max(n, tp) if strategy == "alltoall" else max(n, padded), tp)
            res["bugs"]["no_tp_gather"] = not torch.equal(bug_no_tp_gather(topk_ids, n), ref)
            # Each guard below is wrong only where it fires: judge those cases (None elsewhere).
            skip = not torch.equal(bug_skip_gather_when_full(topk_ids, n, sizes, gr.tp_group), ref)
            res["bugs"]["skip_gather_when_full"] = skip if topk_ids.shape[0] == n else None
            times = not torch.equal(bug_shard_times_tp(topk_ids, tp, sizes, gr.tp_group), ref)
            res["bugs"]["shard_times_tp"] = times if topk_ids.shape[0] * tp != n else None
        if pcp > 1 and strategy == "local" and not shuffle:
            masks_differ = not all(torch.equal(m_, parts[d][1][0]) for m_ in parts[d][1])
            buggy = bug_local_mask(torch.cat(all_chunks[d]), mask, pcp)
            res["bugs"]["local_mask"] = (not torch.equal(buggy, ref)) if masks_differ else None
        out.append(res)
    return out


@pytest.mark.parametrize("dp,pcp,tp", COMBOS, ids=[f"dp{a}-pcp{b}-tp{c}" for a, b, c in COMBOS])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restore_matches_whole_batch(strategy, dp, pcp, tp):
    results = [r for r in gloo_pool(8).run(run_grid, strategy, dp, pcp, tp) if r is not None]
    assert len(results) == dp * pcp * tp
    fired: dict[str, int] = {}
    for per_case in zip(*results, strict=True):
        bad = [rank for rank, r in enumerate(per_case) if not r["ok"]]
        where = f"{strategy} dp{dp} pcp{pcp} tp{tp} case {per_case[0]['case']}"
        assert not bad, f"{where}: ranks {bad} differ from the reference"
        for name in per_case[0]["bugs"]:
            verdicts = [r["bugs"][name] for r in per_case if r["bugs"][name] is not None]
            if verdicts:  # the buggy logic, run on the same inputs, must differ on some rank
                where = f"{strategy} dp{dp} pcp{pcp} tp{tp} case {per_case[0]['case']}"
                assert any(verdicts), f"seed bug {name} went unnoticed: {where}"
                fired[name] = fired.get(name, 0) + 1
    expected = set()
    if strategy in TP_SHARDED and tp > 1 and pcp == 1:  # seed 002 (no PCP there)
        expected.add("no_tp_gather")
        if dp == 1 or strategy not in ("mc2", "fused_mc2"):  # MC2 pads to the largest DP rank's batch
            expected.add("skip_gather_when_full")
        if strategy != "sequence_parallel":
            expected.add("shard_times_tp")
    if strategy == "local" and pcp > 1:
        expected.add("local_mask")
    assert expected <= set(fired), f"buggy logic never exercised: {expected - set(fired)}"


# ---- row counts the sharding cannot produce, wrong groups, bad restore index --------------


def run_errors() -> dict | None:
    gr = groups(1, 2, 2)
    if not gr.active:
        return None
    t, p = gr.tp_rank, gr.pcp_rank
    seen = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            seen[name] = str(e)
        else:
            seen[name] = None

    lay = RowSharding(num_tokens=1, strategy="alltoall", tp_size=2, tp_rank=t, pcp_size=2, pcp_rank=p)
    full = torch.zeros((2, K), dtype=torch.int32)  # the padded 1-token batch passed as if it were the shard
    mask = torch.tensor([p == 1])
    expect("full_batch_as_shard", lambda: restore_rows(full, lay, gr.tp_group, gr.pcp_group, mask))
    lay1 = RowSharding(num_tokens=1, strategy="alltoall", tp_size=4, tp_rank=t, pcp_size=2, pcp_rank=p)
    one = torch.zeros((1, K), dtype=torch.int32)
    expect("wrong_tp_group", lambda: restore_rows(one, lay1, gr.tp_group, gr.pcp_group, mask))
    # restore index: a duplicate (and so one real row unused), and one pointing at padding
    lay2 = RowSharding(num_tokens=3, strategy="local", pcp_size=2, pcp_rank=p, tp_size=2, tp_rank=t)
    rows = torch.arange(4 * K, dtype=torch.int64).reshape(4, K)  # the PCP-gathered rows, same on every rank
    mask2 = torch.tensor([False, p == 1])  # gathered: real, real, real, padding
    groups_ = (gr.tp_group, gr.pcp_group)
    expect("duplicate_index", lambda: restore_rows(rows, lay2, *groups_, mask2, torch.tensor([0, 0, 2])))
    expect("index_on_padding", lambda: restore_rows(rows, lay2, *groups_, mask2, torch.tensor([0, 1, 3])))
    good = restore_rows(rows, lay2, gr.tp_group, gr.pcp_group, mask2, torch.tensor([2, 0, 1]))
    seen["good_index"] = good[:, 0].tolist()
    return seen


def test_errors_name_sharding_and_count():
    for r in (x for x in gloo_pool(8).run(run_errors) if x is not None):
        full = r["full_batch_as_shard"]
        assert full and "RowSharding(" in full and "2 rows" in full
        assert r["wrong_tp_group"] and "tp group has 2 ranks" in r["wrong_tp_group"]
        assert r["duplicate_index"] and "exactly once" in r["duplicate_index"]
        assert r["index_on_padding"] and "exactly once" in r["index_on_padding"]
        assert r["good_index"] == [16, 0, 8]


# ---- sharding arithmetic (no collectives) -------------------------------------------------


def test_plan_row_counts():
    assert split_sizes(241, 2) == (121, 120)
    p = [RowSharding(241, "alltoall", tp_size=2, tp_rank=r).plan() for r in (0, 1)]
    assert [x.local_rows for x in p] == [121, 120]
    assert [RowSharding(1, "alltoall", tp_size=2, tp_rank=r).plan().local_rows for r in (0, 1)] == [1, 1]
    assert RowSharding(3, "alltoall", tp_size=4, tp_rank=3).plan().local_rows == 1  # padded 3 -> 4
    mc2 = RowSharding(5, "mc2", tokens_across_dp=(5, 9), dp_rank=0, tp_size=4, tp_rank=0).plan()
    assert mc2.tp_sizes == (3, 3, 3, 3)  # ceil(9 / 4) * 4 = 12
    assert RowSharding(5, "mc2", tp_size=4, tp_rank=0, padded_num_tokens=16).plan().tp_sizes == (4,) * 4
    assert RowSharding(241, "sequence_parallel", tp_size=4, tp_rank=3).plan().local_rows == 61
    pd = RowSharding(7, "padded_dp", tokens_across_dp=(9, 7), dp_rank=1).plan()
    assert (pd.local_rows, pd.block_offset) == (18, 9)
    nd = RowSharding(7, "naive_dp", tokens_across_dp=(9, 7), dp_rank=1, pcp_size=2, pcp_rank=1).plan(7)
    assert (nd.local_rows, nd.block_rows, nd.block_offset) == (32, 16, 9)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_tokens=4, strategy="ring"), "unknown strategy"),
        (dict(num_tokens=4, strategy="naive_dp"), "needs tokens_across_dp"),
        (dict(num_tokens=4, strategy="alltoall", tp_size=2, tp_rank=2), "tp_rank"),
        (dict(num_tokens=4, strategy="alltoall", padded_num_tokens=8), "only to mc2"),
    ],
)
def test_sharding_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RowSharding(**kwargs)


def test_row_count_mismatch_raises_before_any_collective():
    # A 1-token batch padded to TP size is a shard: the 2-row padded batch is not a valid shard.
    lay = RowSharding(num_tokens=1, strategy="alltoall", tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"RowSharding\(num_tokens=1.*has 2 rows.*puts 1 rows"):
        restore_rows(torch.zeros((2, K), dtype=torch.int32), lay)
    lay = RowSharding(num_tokens=9, strategy="naive_dp", tokens_across_dp=(9, 4), dp_rank=0)
    with pytest.raises(ValueError, match="13 rows on this rank"):
        restore_rows(torch.zeros((9, K), dtype=torch.int32), lay)
    with pytest.raises(ValueError, match="tokens_across_dp"):
        restore_rows(torch.zeros((13, K)), RowSharding(8, "naive_dp", tokens_across_dp=(9, 4)))


def test_single_rank_strategies_without_groups():
    ids = torch.randint(0, E, (241, K))
    for strategy in ("local", "alltoall", "mc2", "sequence_parallel"):
        assert torch.equal(restore_rows(ids, RowSharding(241, strategy)), ids)
    both = torch.cat([ids[:5], ids])
    got = restore_rows(both, RowSharding(241, "naive_dp", tokens_across_dp=(5, 241), dp_rank=1))
    assert torch.equal(got, ids)
    # A local PCP-style padding mask with pcp_size=1: padding rows (-1) dropped, never cast.
    padded = torch.cat([ids, torch.full((3, K), -1)])
    mask = torch.tensor([False] * 241 + [True] * 3)
    assert torch.equal(restore_rows(padded, RowSharding(241), pcp_padding=mask), ids)
