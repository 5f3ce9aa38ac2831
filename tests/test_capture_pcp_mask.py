"""PcpPaddingMask against real gloo collectives (the seed-000 reviewer's nine findings).

The engine side is played with real collectives and different primitives from the code
under test: the naive DP dispatch broadcasts each DP rank's rows in turn (as vLLM's naive
all2all manager does), the PCP gather is `dist.all_gather` of hidden states and logits.
Every hidden-state row carries its own padding bit and sequence position, so the gathered
mask is checked against the rows the router actually routes, not against a mock.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from capture import NaiveDispatch, PcpPaddingMask, RowSharding, restore_rows
from capture.worker.pcp_mask import gather_padding_mask
from tests.support.gloo import CollectiveCounter, gloo_pool, groups

H, E, TOPK = 6, 16, 4
# dp, pcp, tp, padded dispatch
CONFIGS = [(1, 2, 1, False), (1, 4, 1, False), (2, 2, 1, False), (2, 2, 2, False), (2, 2, 1, True)]


def chunk_rows(d: int) -> int:
    return 5 + 2 * d  # rows per PCP rank of DP rank d (DP ranks differ)


def pad_of(d: int, p: int, pcp: int) -> torch.Tensor:
    """Rank (d, p)'s local padding mask; the count and places differ per rank."""
    c = chunk_rows(d)
    g = torch.Generator().manual_seed(1000 * d + p)
    pad = torch.zeros(c, dtype=torch.bool)
    pad[torch.randperm(c, generator=g)[: (p + d) % 3 + (1 if p == pcp - 1 else 0)]] = True
    return pad


def local_batch(d: int, p: int, pcp: int):
    """Rank (d, p)'s rows before any gather: hidden [C, H] with col 0 = padding bit and
    col 1 = sequence position (-1 on padding; real tokens dealt over PCP ranks shuffled)."""
    pad = pad_of(d, p, pcp)
    hidden = torch.randn((pad.shape[0], H), generator=torch.Generator().manual_seed(5000 + 1000 * d + p))
    hidden[:, 0] = pad.float()
    reals = [int((~pad_of(d, q, pcp)).sum()) for q in range(pcp)]
    order = torch.randperm(sum(reals), generator=torch.Generator().manual_seed(77 + d))
    start = sum(reals[:p])
    pos = torch.full((pad.shape[0],), -1.0)
    pos[~pad] = order[start : start + reals[p]].float()
    hidden[:, 1] = pos
    return hidden, pad


GATE = torch.randn((H, E), generator=torch.Generator().manual_seed(5))


def route(ctx, logits: torch.Tensor, skip_padding: bool) -> torch.Tensor:
    """A router as vLLM's fused top-k with VLLM_MOE_SKIP_PADDING: reads ctx.is_padding,
    checks its size against the token count (as the CUDA kernel does), masks padding to -1."""
    mask = ctx.is_padding if skip_padding else None
    if mask is not None and mask.shape[0] != logits.shape[0]:
        raise RuntimeError(f"is_padding size mismatch, expected: {logits.shape[0]}")
    ids = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1).indices.to(torch.int32)
    return ids.masked_fill(mask[:, None], -1) if mask is not None else ids


def engine_dispatch_and_gather(x: torch.Tensor, gr, dp: int, pcp: int, padded: bool = False) -> torch.Tensor:
    """Naive DP dispatch (broadcast each DP rank's rows in turn; `padded`: each padded to
    the largest with padding rows first), then the PCP all-gather."""
    if dp > 1:
        parts = []
        width = max(chunk_rows(e) for e in range(dp))
        if padded and x.shape[0] < width:
            fill = torch.zeros((width - x.shape[0], *x.shape[1:]))
            fill[:, 0], fill[:, 1] = 1.0, -1.0  # a padding row
            x = torch.cat([x, fill])
        for e in range(dp):
            rows = width if padded else chunk_rows(e)
            buf = x.clone() if e == gr.dp_rank else x.new_empty((rows, *x.shape[1:]))
            dist.broadcast(buf, src=dist.get_global_rank(gr.dp_group, e), group=gr.dp_group)
            parts.append(buf)
        x = torch.cat(parts)
    if pcp > 1:
        out = [torch.empty_like(x) for _ in range(pcp)]
        dist.all_gather(out, x.contiguous(), group=gr.pcp_group)
        x = torch.cat(out)
    return x


def run_router_case(dp: int, pcp: int, tp: int, padded: bool) -> dict | None:
    gr = groups(dp, pcp, tp)
    if not gr.active:
        return None
    d, p = gr.dp_rank, gr.pcp_rank
    hidden, local_pad = local_batch(d, p, pcp)
    gathered_hidden = engine_dispatch_and_gather(hidden, gr, dp, pcp, padded)
    logits = gathered_hidden @ GATE
    sizes = tuple(chunk_rows(e) for e in range(dp))
    dispatch = NaiveDispatch(gr.dp_group, sizes, padded=padded) if dp > 1 else None
    ctx = SimpleNamespace(is_padding=local_pad)
    masks = PcpPaddingMask(gr.pcp_group, pcp, needed=lambda: True)
    block = max(sizes) * dp if padded else sum(sizes)
    res: dict = {}

    # Seed 000 baseline: the router reads the rank-local mask and fails its size check.
    try:
        route(ctx, logits, skip_padding=True)
        res["local_mask_raises"] = False
    except RuntimeError as e:
        res["local_mask_raises"] = "size mismatch" in str(e)
    # Reviewer, major: gathering over PCP only, ignoring the naive dispatch, gives P x local rows.
    pcp_only = gather_padding_mask(local_pad, gr.pcp_group, pcp, None)
    res["pcp_only_rows"] = pcp_only.shape[0]
    try:
        route(SimpleNamespace(is_padding=pcp_only), logits, skip_padding=True)
        res["pcp_only_raises"] = False
    except RuntimeError:
        res["pcp_only_raises"] = True

    with masks.install(ctx, forward_pass=0, dispatch=dispatch) as installed:
        assert ctx.is_padding is installed
        ids = route(ctx, logits, skip_padding=True)
    res["restored_local"] = ctx.is_padding is local_pad
    truth = gathered_hidden[:, 0] == 1.0  # the padding bit each routed row carries
    res["rows"] = (installed.shape[0], logits.shape[0], pcp * block)
    res["mask_matches_rows"] = torch.equal(installed, truth)
    res["masked_rows_are_padding"] = torch.equal(ids[:, 0] == -1, truth)
    plain = torch.topk(torch.softmax(logits, -1), TOPK, -1).indices.to(torch.int32)
    res["real_rows_routed"] = torch.equal(ids[~truth], plain[~truth])

    # End to end: the router's ids through restore_rows give this DP rank's tokens in sequence order.
    pos = gathered_hidden[:, 1].long()
    off = max(sizes) * d if padded else sum(sizes[:d])
    mine = torch.cat([pos[q * block + off : q * block + off + sizes[d]] for q in range(pcp)])
    real = mine >= 0
    restore_index = torch.argsort(torch.where(real, mine, torch.iinfo(torch.int64).max))[: int(real.sum())]
    sharding = RowSharding(
        num_tokens=int(real.sum()),
        strategy=("padded_dp" if padded else "naive_dp") if dp > 1 else "local",
        tokens_across_dp=sizes if dp > 1 else None,
        dp_rank=d,
        tp_size=tp,
        tp_rank=gr.tp_rank,
        pcp_size=pcp,
        pcp_rank=p,
    )
    rows = restore_rows(ids, sharding, gr.tp_group, gr.pcp_group, pcp_padding=local_pad,
                        pcp_restore_index=restore_index)
    # Reference from the whole batch: this DP rank's real rows of every PCP rank, by position.
    whole = [local_batch(d, q, pcp)[0] for q in range(pcp)]
    whole = torch.cat(whole)
    whole = whole[whole[:, 0] == 0.0]
    whole = whole[torch.argsort(whole[:, 1])]
    ref = torch.topk(torch.softmax(whole @ GATE, -1), TOPK, -1).indices.to(torch.int32)
    res["restored_equals_reference"] = torch.equal(rows, ref) and int((rows < 0).sum()) == 0
    return res


CONFIG_IDS = [f"dp{a}-pcp{b}-tp{c}{'-padded' if e else ''}" for a, b, c, e in CONFIGS]


@pytest.mark.parametrize("dp,pcp,tp,padded", CONFIGS, ids=CONFIG_IDS)
def test_router_uses_gathered_mask(dp, pcp, tp, padded):
    for r in (x for x in gloo_pool(8).run(run_router_case, dp, pcp, tp, padded) if x is not None):
        installed, routed, expected = r["rows"]
        assert installed == routed == expected  # P x dispatched rows, dispatch accounted for
        assert r["mask_matches_rows"] and r["masked_rows_are_padding"] and r["real_rows_routed"]
        assert r["restored_local"]
        assert r["restored_equals_reference"]
        assert r["local_mask_raises"]  # the unfixed behaviour
        if dp > 1:
            assert r["pcp_only_rows"] != expected and r["pcp_only_raises"]


def expected_gather(dp: int, pcp: int, d: int, mask_of) -> torch.Tensor:
    """The router's rows' padding, computed from the whole batch: PCP-major, DP inside."""
    return torch.cat([torch.cat([mask_of(e, q) for e in range(dp)]) for q in range(pcp)])


def run_cache_case(dp: int, pcp: int) -> dict | None:
    gr = groups(dp, pcp, 1)
    if not gr.active:
        return None
    d, p = gr.dp_rank, gr.pcp_rank
    sizes = tuple(chunk_rows(e) for e in range(dp))
    dispatch = NaiveDispatch(gr.dp_group, sizes) if dp > 1 else None
    per_gather = 2 if dp > 1 else 1  # collectives per gather: dispatch group, then PCP
    local = pad_of(d, p, pcp).clone()
    ctx = SimpleNamespace(is_padding=local)
    masks = PcpPaddingMask(gr.pcp_group, pcp)
    res: dict = {}

    with CollectiveCounter() as cc:
        for _layer in range(3):  # three MoE layers of one forward pass
            with masks.install(ctx, forward_pass=1, dispatch=dispatch) as m:
                first = m
        res["one_pass_calls"] = (len(cc), masks.gathers, per_gather)
        res["first_ok"] = torch.equal(first, expected_gather(dp, pcp, d, lambda e, q: pad_of(e, q, pcp)))

        # In-place content change on every rank (different values per rank): must re-gather.
        local[0] = ~local[0]
        with masks.install(ctx, forward_pass=1, dispatch=dispatch) as m:
            flipped = lambda e, q: torch.cat([~pad_of(e, q, pcp)[:1], pad_of(e, q, pcp)[1:]])  # noqa: E731
            res["inplace_regathered"] = masks.gathers == 2 and torch.equal(m, expected_gather(dp, pcp, d, flipped))
        res["inplace_restored_obj"] = ctx.is_padding is local

        # A new mask object (model code rewrites ctx.is_padding per call): must re-gather.
        new = pad_of(d, p, pcp)
        ctx.is_padding = new
        with masks.install(ctx, forward_pass=1, dispatch=dispatch) as m:
            res["new_object_regathered"] = masks.gathers == 3 and torch.equal(
                m, expected_gather(dp, pcp, d, lambda e, q: pad_of(e, q, pcp))
            )
        # The same object in the next forward pass (a reused context): must re-gather.
        with masks.install(ctx, forward_pass=2, dispatch=dispatch):
            pass
        res["new_pass_regathered"] = masks.gathers == 4
        with masks.install(ctx, forward_pass=2, dispatch=dispatch):
            pass
        res["same_pass_cached"] = masks.gathers == 4
        res["total_calls"] = (len(cc), 4 * per_gather)

    # No reader: nothing gathered, the local mask stays.
    idle = PcpPaddingMask(gr.pcp_group, pcp, needed=lambda: False)
    with CollectiveCounter() as cc:
        with idle.install(ctx, forward_pass=3, dispatch=dispatch) as m:
            res["unneeded"] = (len(cc), idle.gathers, m is new and ctx.is_padding is new)
        # No mask at all: nothing gathered, nothing installed (the `is not None` guard).
        empty = SimpleNamespace(is_padding=None)
        with masks.install(empty, forward_pass=3, dispatch=dispatch) as m:
            res["no_mask"] = (len(cc), m is None and empty.is_padding is None)

    # Exceptional exit: the original object comes back; a nested install is refused.
    try:
        with masks.install(ctx, forward_pass=4, dispatch=dispatch):
            raise KeyError("router blew up")
    except KeyError:
        pass
    res["restored_after_exception"] = ctx.is_padding is new
    try:
        with masks.install(ctx, forward_pass=4, dispatch=dispatch):
            with masks.install(ctx, forward_pass=4, dispatch=dispatch):
                pass
        res["nested"] = "allowed"
    except RuntimeError:
        res["nested"] = "refused"
    res["restored_after_nested"] = ctx.is_padding is new
    # Without a forward-pass key nothing is cached.
    before = masks.gathers
    for _ in range(2):
        with masks.install(ctx, dispatch=dispatch):
            pass
    res["uncached"] = masks.gathers - before
    return res


@pytest.mark.parametrize("dp,pcp", [(1, 2), (2, 2)], ids=["dp1-pcp2", "dp2-pcp2"])
def test_mask_cache_restore_and_no_reader(dp, pcp):
    for r in (x for x in gloo_pool(8).run(run_cache_case, dp, pcp) if x is not None):
        calls, gathers, per_gather = r["one_pass_calls"]
        assert gathers == 1 and calls == per_gather  # one gather for three layers of a pass
        assert r["first_ok"]
        assert r["inplace_regathered"] and r["inplace_restored_obj"]
        assert r["new_object_regathered"]
        assert r["new_pass_regathered"] and r["same_pass_cached"]
        assert r["total_calls"][0] == r["total_calls"][1]
        assert r["unneeded"] == (0, 0, True)
        assert r["no_mask"] == (0, True)
        assert r["restored_after_exception"]
        assert r["nested"] == "refused" and r["restored_after_nested"]
        assert r["uncached"] == 2


def test_no_pcp_no_dispatch_is_a_no_op():
    ctx = SimpleNamespace(is_padding=torch.tensor([False, True]))
    masks = PcpPaddingMask(None, 1)
    with CollectiveCounter() as cc, masks.install(ctx, forward_pass=0) as m:
        assert m is ctx.is_padding
    assert len(cc) == 0 and masks.gathers == 0
