"""vLLM forward context + MoE layer -> `capture.RowSharding`, and the PCP router-mask fix (in each worker).

`sharding_for(runner, ctx, par, num_tokens, num_rows)` maps what vLLM says about one router call (the MoE runner's
config, `ForwardContext.dp_metadata`, `is_padding`, the PCP restore index) to the engine-neutral `RowSharding`
(`capture/worker/sharding.py`); `restore` applies it, `restore_pcp` restores Model Runner V2's PCP rows through
vLLM's own restore index (one `PcpStep` per step), and `pcp_padding_mask` / `mask_dispatch` give the router the
gathered padding mask. A layout it cannot restore raises `ShardingError` (a naive DP dispatch before the PCP gather
is one). Rows past the real token count are padding and are dropped.

Design: docs/design/vllm_worker.md; vLLM's names: docs/design/vllm_research.md section 2 (e).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from capture.vllm.log import info
from capture.worker.pcp_mask import NaiveDispatch, PcpPaddingMask
from capture.worker.restore import (
    check_pcp_restore_index,
    gather_pcp_mask,
    gather_rank_rows,
    restore_pcp_order,
    restore_rows,
)
from capture.worker.sharding import RowSharding, Strategy


@dataclass
class Parallel:
    """This worker's place and groups (torch ProcessGroups; None = size 1)."""

    tp_size: int = 1
    tp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_group: object = None
    pcp_group: object = None
    dp_group: object = None

    @property
    def sends(self) -> bool:
        """Only one rank per TP/PCP group sends (each DP rank sends its own rows)."""
        return self.tp_rank == 0 and self.pcp_rank == 0

    @classmethod
    def from_vllm(cls) -> Parallel:
        from vllm.distributed import parallel_state as ps

        tp = _Group.of(ps.get_tp_group)
        pcp = _Group.of(ps.get_pcp_group) if hasattr(ps, "get_pcp_group") else _Group()
        dp = _Group.of(ps.get_dp_group)
        return cls(tp.size, tp.rank, pcp.size, pcp.rank, dp.size, dp.rank, tp.group, pcp.group, dp.group)


@dataclass(frozen=True)
class _Group:
    """One of vLLM's parallel groups as this rank sees it: its size, this rank in it, its device group."""

    size: int = 1
    rank: int = 0
    group: object = None

    @classmethod
    def of(cls, getter) -> _Group:
        """The group `getter` answers; a group of one where vLLM has not set it up."""
        try:
            g = getter()
        except (AssertionError, AttributeError):
            return cls()
        return cls(g.world_size, g.rank_in_group, g.device_group)


class ShardingError(RuntimeError):
    """This vLLM configuration puts rows where the capture cannot restore them."""


@dataclass(frozen=True)
class MoeLayout:
    """How one MoE layer's router gets its rows: what vLLM's runner and MoE config say."""

    naive: bool  # naive DP dispatch: the router sees every DP rank's rows, concatenated
    sp: bool  # sequence parallel
    a2a: bool  # all2all kernels
    pcp_size: int

    @classmethod
    def of(cls, runner) -> MoeLayout:
        """The layout of `runner`'s layer."""
        cfg = runner.moe_config
        return cls(naive=bool(getattr(runner, "do_naive_dispatch_combine", False)),
                   sp=bool(getattr(cfg, "is_sequence_parallel", False)),
                   a2a=bool(getattr(getattr(cfg, "moe_parallel_config", None), "use_all2all_kernels", False)),
                   pcp_size=int(getattr(cfg, "pcp_size", 1) or 1))

    @property
    def pcp_gathered(self) -> bool:
        """The router sees the PCP group's rows gathered (with padding)."""
        return self.pcp_size > 1 and not self.a2a

    @property
    def local(self) -> bool:
        """The router sees exactly this DP rank's batch (no dispatch, SP, and no PCP: a PCP rank holds part of it)."""
        return not self.naive and not (self.sp and self.a2a) and self.pcp_size == 1


def routes_local_batch(runner) -> bool:
    """True when this MoE layer's router sees exactly this DP rank's batch (no dispatch, SP or PCP gather)."""
    return MoeLayout.of(runner).local


def dispatch_sizes(ctx) -> tuple[int, ...]:
    """Rows each rank fed the naive dispatch (per DP rank; per EP rank under SP), from `ctx.dp_metadata`."""
    dpm = getattr(ctx, "dp_metadata", None)
    if dpm is None:
        raise ShardingError("routing-replay: naive MoE dispatch but the forward context has no dp_metadata")
    sizes = None
    getter = getattr(dpm, "get_chunk_sizes_across_dp_rank", None)
    if getter is not None:
        try:
            sizes = getter()
        except AssertionError:
            sizes = None
    if sizes is None:
        sizes = dpm.num_tokens_across_dp_cpu
    return tuple(int(s) for s in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes))


def pcp_restore_index_from(ctx):
    """The PCP restore index the context carries, if any (docs/design/vllm_worker.md, "What the plugin reads")."""
    extra = getattr(ctx, "additional_kwargs", None) or {}
    idx = extra.get("pcp_restore_index")
    return idx if idx is not None else getattr(ctx, "pcp_restore_index", None)


def sharding_for(runner, ctx, par: Parallel, num_tokens: int, num_rows: int) -> RowSharding:
    """The sharding of this MoE layer's `topk_ids` (`num_rows` rows on this rank) for this step."""
    layout = MoeLayout.of(runner)
    p = layout.pcp_size if layout.pcp_gathered else 1
    prank = par.pcp_rank if layout.pcp_gathered else 0
    if layout.naive:
        sizes = dispatch_sizes(ctx)
        if layout.sp:  # EP group = DP x TP, DP-major: fold each DP rank's TP pieces
            if len(sizes) != par.dp_size * par.tp_size:
                raise ShardingError(
                    f"routing-replay: {len(sizes)} dispatch sizes for DP {par.dp_size} x TP {par.tp_size}")
            per_dp = tuple(sum(sizes[d * par.tp_size : (d + 1) * par.tp_size]) for d in range(par.dp_size))
            if p > 1:
                raise ShardingError("routing-replay: sequence-parallel MoE combined with PCP is not supported")
            return RowSharding(per_dp[par.dp_rank], Strategy.NAIVE_DP, per_dp, par.dp_rank)
        real = num_tokens if p > 1 else sizes[par.dp_rank]
        return RowSharding(real, Strategy.NAIVE_DP, sizes, par.dp_rank, pcp_size=p, pcp_rank=prank)
    if layout.sp and layout.a2a:
        if p > 1:
            raise ShardingError("routing-replay: sequence-parallel MoE combined with PCP is not supported")
        # The SP shard: each TP rank holds ceil(n_pad / tp) rows; n_pad is this DP rank's padded batch.
        return RowSharding(num_rows * par.tp_size, Strategy.SEQUENCE_PARALLEL, tp_size=par.tp_size, tp_rank=par.tp_rank)
    if p > 1:
        return RowSharding(num_tokens, Strategy.LOCAL, pcp_size=p, pcp_rank=prank)
    return RowSharding(num_rows, Strategy.LOCAL)


def restore(topk_ids: torch.Tensor, runner, ctx, par: Parallel, num_tokens: int, *, local_padding=None,
            pcp_restore_index=None) -> torch.Tensor:
    """This DP rank's `[num_tokens, K]` rows in scheduler order (identical on every TP/PCP rank)."""
    layout = MoeLayout.of(runner)
    if layout.pcp_size > 1 and layout.a2a:
        raise ShardingError("routing-replay: PCP with all2all kernels: the router sees this PCP rank's rows and "
                            "this runner gives no restore index (Model Runner V2's PCPManager does)")
    if layout.pcp_gathered:
        mask = local_padding if local_padding is not None else getattr(ctx, "is_padding", None)
        idx = pcp_restore_index if pcp_restore_index is not None else pcp_restore_index_from(ctx)
        sharding = sharding_for(runner, ctx, par, num_tokens, topk_ids.shape[0])
        rows = restore_rows(topk_ids, sharding, tp_group=par.tp_group, pcp_group=par.pcp_group,
                            pcp_padding=mask, pcp_restore_index=idx)
        return rows[:num_tokens]
    if layout.local:  # the common path (and all of CPU): this rank routed the whole batch
        return topk_ids[:num_tokens]
    sharding = sharding_for(runner, ctx, par, num_tokens, topk_ids.shape[0])
    if sharding.strategy == Strategy.LOCAL:
        return topk_ids[:num_tokens]
    rows = restore_rows(topk_ids, sharding, tp_group=par.tp_group)
    return rows[:num_tokens]


@dataclass
class PcpStep:
    """One step's PCP partition, as the engine made it (V2: `PCPManager.partition_batch`; read at step open).

    `restore_index[i]` is the PCP-gathered row (rank-major, `rank_rows` per rank) of the step's global token i
    (vLLM's `_hidden_restore_idx`: global = gathered[restore_index]); a request every rank holds whole
    (`replicated_requests`) is read from one rank's copy. `padding` is the padding mask of the batch the
    model ran: `[pcp_size * rank_rows]` when vLLM already gathered it for the router, else this rank's
    `[rank_rows]`. `checked`: the index was checked against it (once per step, by its first layer).
    """

    restore_index: torch.Tensor | None  # None: the engine gave none this step (the step's rows go STALE)
    rank_rows: int
    padding: torch.Tensor
    checked: bool = False


def _pcp_block(topk_ids: torch.Tensor, layout: MoeLayout, par: Parallel, rows: int) -> torch.Tensor:
    """This DP rank's PCP-gathered rows `[P * rows, K]` out of what one MoE layer's router saw (design page)."""
    p = par.pcp_size
    if layout.a2a:  # the router saw this rank's own rows: gather them as the non-all2all path would have
        if topk_ids.shape[0] != rows:
            raise ShardingError(f"routing-replay: the router saw {topk_ids.shape[0]} rows, this PCP rank holds {rows}")
        return gather_rank_rows(topk_ids, p, par.pcp_group)
    if layout.naive:
        # MoERunner._maybe_dispatch dispatches before the PCP gather, sized by _compute_sp_num_tokens
        # (vllm/forward_context.py), which counts P x each DP rank's tokens without EP: not this rank's rows.
        raise ShardingError("routing-replay: a naive DP dispatch combined with PCP is not supported")
    if topk_ids.shape[0] != p * rows:
        raise ShardingError(f"routing-replay: the router saw {topk_ids.shape[0]} rows, PCP {p} x {rows} gathered")
    return topk_ids


def restore_pcp(topk_ids: torch.Tensor, runner, par: Parallel, step: PcpStep, num_tokens: int) -> torch.Tensor:
    """This DP rank's `[num_tokens, K]` rows in the global batch's order, from one MoE layer's `topk_ids` under PCP.

    The PCP-gathered rows (`_pcp_block`) go through vLLM's restore index; the step's first call checks
    the index against the gathered padding mask (gathered here from this rank's mask where vLLM did
    not). Collectives, the same on every rank of the PCP group: a row all-gather per layer with
    all2all kernels; a mask all-gather once per step where the mask is this rank's. Raises
    ShardingError or ValueError (a shape every PCP rank shares is checked before any collective).
    """
    layout = MoeLayout.of(runner)
    p = par.pcp_size
    if layout.pcp_size != p:
        raise ShardingError(f"routing-replay: MoE layer on PCP {layout.pcp_size}, this worker on PCP {p}")
    if layout.sp:
        raise ShardingError("routing-replay: sequence-parallel MoE combined with PCP is not supported")
    if step.restore_index is None:
        raise ShardingError("routing-replay: vLLM's PCPManager holds no restore index for this step")
    if p > 1 and (not dist.is_initialized() or dist.get_world_size(par.pcp_group) != p
                  or dist.get_rank(par.pcp_group) != par.pcp_rank):
        raise ShardingError(f"routing-replay: the PCP group is not this worker's (PCP rank {par.pcp_rank} of {p})")
    gathered = _pcp_block(topk_ids, layout, par, step.rank_rows)
    if not step.checked:
        mask = step.padding.reshape(-1)
        if mask.shape[0] == step.rank_rows and p > 1:
            mask = gather_pcp_mask(mask, p, par.pcp_group)
        if mask.shape[0] != p * step.rank_rows:
            raise ShardingError(f"routing-replay: padding mask of {mask.shape[0]} rows for PCP {p} x "
                                f"{step.rank_rows} gathered rows")
        check_pcp_restore_index(step.restore_index, mask, num_tokens)
        step.checked = True
    return restore_pcp_order(gathered, step.restore_index)


def pcp_mask_fixed_upstream() -> bool:
    """True when the running vLLM already gives the router a PCP-gathered padding mask.

    Either `MoERunner._maybe_dispatch` gathers it, or (0.33+) Model Runner V2's `PCPManager` makes the
    batch's mask the gathered one itself (`moe_is_padding`, `_moe_is_padding`; PCP runs only under V2 there)."""
    try:
        import inspect

        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        if "is_padding" in inspect.getsource(MoERunner._maybe_dispatch):
            return True
    except Exception:  # any error (no source, a renamed symbol): look at the V2 manager
        pass
    try:
        from vllm.v1.worker.gpu.pcp_manager import PCPManager
    except Exception:  # any error: no V2 manager: assume vLLM does not, install ours
        return False
    return callable(getattr(PCPManager, "moe_is_padding", None))


def mask_dispatch(runner, ctx, par: Parallel) -> NaiveDispatch | None:
    """The naive dispatch that precedes the PCP gather (its mask must be gathered the same way)."""
    if not MoeLayout.of(runner).naive:
        return None
    return NaiveDispatch(par.dp_group, dispatch_sizes(ctx))


def pcp_padding_mask(par: Parallel) -> PcpPaddingMask | None:
    """Under PCP, the padding mask the router gets, aligned with the gathered rows (seed 000); None without PCP.

    None too where vLLM gathers the mask itself. The runner wraps the router's call in it
    (`runner.patch_apply_quant_method`)."""
    if par.pcp_size <= 1:
        return None
    if pcp_mask_fixed_upstream():
        info("routing-replay: this vLLM gathers the PCP padding mask itself; not installing ours")
        return None
    needed = None  # without vLLM's switch: always gather
    try:
        import vllm.envs as envs

        def needed() -> bool:
            return bool(envs.VLLM_MOE_SKIP_PADDING)
    except Exception:  # any error: keep gathering (the switch only saves a collective)
        pass
    return PcpPaddingMask(par.pcp_group, par.pcp_size, needed=needed)
