"""restore_rows: one MoE layer's `topk_ids` on this rank -> this DP rank's rows in scheduler order.

Runs in the inference worker (torch, torch.distributed). Inverts the forward path of `capture.worker.sharding` with
real collectives: TP all-gather, PCP un-gather (padding mask gathered, padding dropped, restore index applied), then
this DP rank's span of each PCP block. Every row count comes from the sharding; the local shard's length is only
checked against it (ValueError). An engine that keeps its own PCP restore index (vLLM's Model Runner V2) is restored
with `gather_rank_rows` and `restore_pcp_order`, after `check_pcp_restore_index`.

Design: docs/design/capture.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from capture.worker.sharding import RowSharding, ShardPlan, TpSplit


def gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """All-gather `inp` from every rank of `group` into `out` (rank-major), whatever this torch calls it."""
    # all_gather_single is the torch >= 2.13 name; all_gather_into_tensor before it.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def check_group(group, size: int, rank: int, what: str, sharding: RowSharding) -> None:
    """A local check (no collective) that `group` is the `size`-rank group this rank is `rank` of."""
    if not dist.is_initialized():
        raise ValueError(f"{sharding}: {what}_size {size} needs an initialised torch.distributed {what} group")
    got_size, got_rank = dist.get_world_size(group), dist.get_rank(group)
    if got_size != size or got_rank != rank:
        raise ValueError(
            f"{sharding}: {what} group has {got_size} ranks and this is rank {got_rank}, "
            f"but the sharding says {what}_size={size}, {what}_rank={rank}"
        )


def all_gather_rows(x: torch.Tensor, sizes: tuple[int, ...], group, pad_value=0) -> torch.Tensor:
    """All-gather rows of (possibly) uneven pieces, `sizes[r]` rows from group rank r, rank-major.

    `sizes` must be the same on every rank. Each piece is padded to the largest, gathered
    with one collective, and trimmed; an even split comes back without a copy.
    """
    parts, width = len(sizes), max(sizes)
    rank = dist.get_rank(group)
    x = x.contiguous()
    if x.shape[0] != sizes[rank]:
        raise ValueError(f"piece of {x.shape[0]} rows, expected {sizes[rank]} on group rank {rank}")
    if x.shape[0] != width:
        padded = x.new_full((width, *x.shape[1:]), pad_value)
        padded[: x.shape[0]] = x
        x = padded
    out = x.new_empty((parts * width, *x.shape[1:]))
    gather_single(out, x, group)
    if min(sizes) == width:
        return out
    out = out.view(parts, width, *x.shape[1:])
    return torch.cat([out[r, : sizes[r]] for r in range(parts)])


def _undo_tp(topk_ids: torch.Tensor, sharding: RowSharding, plan: ShardPlan, tp_group) -> torch.Tensor:
    """-> the PCP-gathered rows [pcp_size * block_rows, K] (blocks rank-major)."""
    if plan.tp_split == TpSplit.NONE:
        return topk_ids
    tp, p = sharding.tp_size, sharding.pcp_size
    if plan.tp_split == TpSplit.BATCH:  # one padded batch split over TP: gather, keep the real batch
        full = topk_ids if tp == 1 else all_gather_rows(topk_ids, plan.tp_sizes, tp_group)
        return full[: plan.pcp_rows]
    # CHUNK: every PCP chunk was split evenly over TP before the PCP gather:
    # TP rank t holds [shard_t(chunk_0), ..., shard_t(chunk_{P-1})].
    s = plan.tp_sizes[0]
    if tp == 1:
        full = topk_ids.reshape(p, s, *topk_ids.shape[1:])
    else:
        full = all_gather_rows(topk_ids, (p * s,) * tp, tp_group)
        full = full.view(tp, p, s, *topk_ids.shape[1:]).transpose(0, 1).reshape(p, tp * s, *topk_ids.shape[1:])
    return full[:, : plan.chunk].reshape(p * plan.chunk, *topk_ids.shape[1:])


def gather_pcp_mask(pcp_padding: torch.Tensor, pcp_size: int, pcp_group) -> torch.Tensor:
    """The local PCP padding mask gathered rank-major over the PCP group ([P * chunk] bool)."""
    local = pcp_padding.reshape(-1).to(torch.bool).contiguous()
    if pcp_size == 1:
        return local
    out = local.new_empty(pcp_size * local.shape[0])
    gather_single(out, local, pcp_group)
    return out


def select_real_rows(
    rows: torch.Tensor, mask: torch.Tensor | None, restore_index: torch.Tensor | None, num_tokens: int,
    sharding: RowSharding,
) -> torch.Tensor:
    """Drop padding rows (mask True) and apply the restore index (gathered row of each real
    token, in sequence order); every real row must be used exactly once."""
    total = rows.shape[0]
    if mask is not None and mask.shape[0] != total:
        raise ValueError(f"{sharding}: gathered padding mask has {mask.shape[0]} rows for {total} gathered rows")
    if restore_index is None:
        if mask is None:
            out = rows
        else:
            out = rows[~mask]
        if out.shape[0] != num_tokens:
            raise ValueError(f"{sharding}: {out.shape[0]} non-padding rows, expected {num_tokens}")
        return out
    idx = restore_index.reshape(-1).to(device=rows.device, dtype=torch.long)
    if idx.shape[0] != num_tokens:
        raise ValueError(f"{sharding}: pcp_restore_index lists {idx.shape[0]} rows, expected {num_tokens}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= total):
        raise ValueError(f"{sharding}: pcp_restore_index outside 0..{total - 1}")
    uses = torch.bincount(idx, minlength=total)
    want = torch.ones(total, dtype=uses.dtype, device=uses.device) if mask is None else (~mask).to(uses.dtype)
    if not torch.equal(uses, want):
        bad = torch.nonzero(uses != want).flatten()[:8].tolist()
        raise ValueError(
            f"{sharding}: pcp_restore_index must use every non-padding gathered row exactly once "
            f"and no padding row; first bad rows {bad}"
        )
    return rows.index_select(0, idx)


def restore_rows(
    topk_ids: torch.Tensor,
    sharding: RowSharding,
    tp_group=None,
    pcp_group=None,
    pcp_padding: torch.Tensor | None = None,
    pcp_restore_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """This DP rank's rows `[num_tokens, top_k]`, scheduler order, the same on every TP/PCP rank.

    Collectives (identical sequence on every rank): a TP all-gather when the strategy
    TP-splits and tp_size > 1; a PCP all-gather of the padding mask when pcp_size > 1 and
    a mask is given. Padding rows are dropped by index, never cast. The result keeps
    `topk_ids`' dtype and device. Raises ValueError (before any collective when the
    sharding is at fault) naming the sharding and the offending count.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"{sharding}: topk_ids must be [rows, top_k], got shape {tuple(topk_ids.shape)}")
    if pcp_padding is not None and pcp_padding.dim() != 1:
        pcp_padding = pcp_padding.reshape(-1)
    chunk = None if pcp_padding is None else int(pcp_padding.shape[0])
    plan = sharding.plan(chunk)
    if topk_ids.shape[0] != plan.local_rows:
        raise ValueError(
            f"{sharding}: topk_ids has {topk_ids.shape[0]} rows but this sharding puts "
            f"{plan.local_rows} rows on this rank (strategy {sharding.strategy}, tp_rank {sharding.tp_rank})"
        )
    needs_tp = plan.tp_split != TpSplit.NONE and sharding.tp_size > 1
    needs_pcp = sharding.pcp_size > 1 and pcp_padding is not None
    if needs_tp:
        check_group(tp_group, sharding.tp_size, sharding.tp_rank, "tp", sharding)
    if needs_pcp:
        check_group(pcp_group, sharding.pcp_size, sharding.pcp_rank, "pcp", sharding)

    rows = _undo_tp(topk_ids, sharding, plan, tp_group)
    if plan.block_rows != plan.chunk or plan.block_offset:  # DP dispatch: this DP rank's span of each block
        rows = rows.reshape(sharding.pcp_size, plan.block_rows, rows.shape[1])
        rows = rows[:, plan.block_offset : plan.block_offset + plan.chunk].reshape(plan.pcp_rows, rows.shape[2])
    mask = gather_pcp_mask(pcp_padding, sharding.pcp_size, pcp_group) if pcp_padding is not None else None
    if mask is not None:
        mask = mask.to(rows.device)
    return select_real_rows(rows, mask, pcp_restore_index, sharding.num_tokens, sharding)


def gather_rank_rows(local: torch.Tensor, pcp_size: int, pcp_group) -> torch.Tensor:
    """Every PCP rank's `local` rows (the same count on each: padded to the largest rank's), gathered rank-major.

    One all-gather over `pcp_group`; `[pcp_size * rows, ...]`. Without PCP, `local` itself."""
    if pcp_size == 1:
        return local
    return all_gather_rows(local, (local.shape[0],) * pcp_size, pcp_group)


def check_pcp_restore_index(restore_index: torch.Tensor, padding: torch.Tensor, num_tokens: int) -> None:
    """ValueError unless `restore_index` picks `num_tokens` distinct rows of the gathered batch, none of them padding.

    `padding` is the gathered padding mask (`[P * rows]` bool, rank-major, True = padding): it says how
    many rows there are. Rows the index leaves out are a replicated request's copies on the other ranks."""
    idx = restore_index.reshape(-1)
    mask = padding.reshape(-1).to(device=idx.device, dtype=torch.bool)
    total = mask.shape[0]
    if idx.shape[0] != num_tokens:
        raise ValueError(f"PCP restore index lists {idx.shape[0]} rows, the step has {num_tokens} tokens")
    if not num_tokens:
        return
    if int(idx.min()) < 0 or int(idx.max()) >= total:
        raise ValueError(f"PCP restore index outside the {total} gathered rows (0..{total - 1})")
    uses = torch.bincount(idx.to(torch.long), minlength=total)
    bad = torch.nonzero((uses > 1) | ((uses > 0) & mask)).flatten()
    if bad.numel():
        raise ValueError(f"PCP restore index reads a gathered row twice or a padding row; first bad rows "
                         f"{bad[:8].tolist()}")


def restore_pcp_order(gathered: torch.Tensor, restore_index: torch.Tensor) -> torch.Tensor:
    """The engine's token order from PCP-gathered rows: `gathered[restore_index]` (`check_pcp_restore_index` first).

    `gathered` is `[P * rows, K]`, rank-major; the result is `[len(restore_index), K]` in `gathered`'s dtype
    and device. The index is moved to that device (a no-op where it already is)."""
    if gathered.dim() != 2:
        raise ValueError(f"gathered rows must be [rows, top_k], got shape {tuple(gathered.shape)}")
    idx = restore_index.reshape(-1).to(device=gathered.device, dtype=torch.long)
    return gathered.index_select(0, idx)
