"""Trainer side, megatron-core: make `RouterReplay` replay what it is given, or refuse (torch, megatron-core lazily).

Contract (megatron-core 0.16.1): `check_config` / `check_model` raise `RouterReplayError` naming each setting under
which replay would silently do nothing (fused router, sinkhorn, ...) and its fix. `install_router_fallback`
(idempotent; `router_fallback()` for a block) routes a replayed row of -1 by the router's own top-k and refuses a
tensor that is not `[router tokens, top_k]`. `plan_for_model` (a built model) / `plan_for_rank` (a config) give a
`ReplayPlan`: this rank's routers in construction order over every VPP chunk, MTP routers fed rows of -1; its
`moe_ordinals` go to `megatron_batch(moe_ordinals=...)`, and its `set_replay_data` hands each router its tensor.
Design: docs/design/trainer_client.md ("megatron-core's RouterReplay").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from replay_client.trainer import MISSING_ROUTE  # a whole row of it: no recorded route (NeMo-RL's sentinel)

_PATCHED = "_routing_replay_router_fallback"  # marks the installed wrapper (and holds nothing else)
_UPSTREAM_PARAMS = ["scores", "topk", "num_groups", "group_topk", "default_compute_topk"]


class RouterReplayError(ValueError):
    """Replay would not do what it says: a megatron-core setting, a model, or replay data; the message names the fix."""


# ---- the router's own choice where a route is missing --------------------------------------------------


def _megatron_replay() -> tuple[Any, Any]:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def router_fallback_installed() -> bool:
    """Whether `install_router_fallback` is in effect."""
    replay_cls, _ = _megatron_replay()
    return bool(getattr(replay_cls.get_replay_topk, _PATCHED, False))


def _replay_ids(target, scores, topk: int, num_groups, group_topk, default_compute_topk):
    """The ids to route by: `target`, with the router's own top-k on its all -1 rows; None when it has none.

    One device sync per layer call (the counts of missing and malformed rows), as NeMo-RL's fallback.
    """
    import torch

    if target.dim() != 2 or target.shape[0] != scores.shape[0] or target.shape[1] != topk:
        # megatron-core gathers what it is given: fewer rows leave the router's other tokens with no expert
        raise RouterReplayError(
            f"replay tensor of shape {tuple(target.shape)} for a router of {scores.shape[0]} tokens x top-{topk}: "
            "the replay data must have one row per token this router sees (this rank's CP/SP slice, padding "
            "included) and top_k ids per row")
    target = target.to(scores.device, torch.int64)  # gather takes int64 indices
    missing = target.eq(MISSING_ROUTE)
    whole = missing.all(dim=1)
    malformed = target.lt(0).any(dim=1) & ~whole
    n_whole, n_malformed = torch.stack((whole.sum(), malformed.sum())).tolist()
    if n_malformed:
        rows = malformed.nonzero().flatten()[:5].tolist()
        raise RouterReplayError(
            f"{n_malformed} replay rows mix negative and real ids (first rows {rows}, e.g. "
            f"{target[rows[0]].tolist()}): a missing route is a whole row of {MISSING_ROUTE}")
    if not n_whole:
        return None
    if default_compute_topk is None:
        raise RouterReplayError("megatron-core passed no default_compute_topk: the router's own choice is unknown")
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    return torch.where(whole.unsqueeze(1), own, target)


def install_router_fallback() -> None:
    """Make megatron-core's `RouterReplay` route a token itself where its replayed row is all -1.

    Wraps `RouterReplay.get_replay_topk` (moe/router_replay.py:116-161, the one place replayed ids are
    consumed) for every instance: in REPLAY_FORWARD / REPLAY_BACKWARD the replayed row is kept where it is a
    route and the router's own top-k (the `default_compute_topk` megatron-core passes: group-limited, with
    expert bias, as configured) is taken on rows of -1; the forward's choice is what the backward recompute
    replays. It also refuses a replay tensor whose shape is not `[router tokens, top_k]` and rows that mix
    -1 with ids. RECORD mode and no action are untouched. Idempotent.
    """
    replay_cls, action = _megatron_replay()
    original = replay_cls.get_replay_topk
    if getattr(original, _PATCHED, False):
        return
    params = list(inspect.signature(original).parameters)[1:]
    if params != _UPSTREAM_PARAMS:
        raise RouterReplayError(
            f"RouterReplay.get_replay_topk takes {params} in this megatron-core, not {_UPSTREAM_PARAMS} "
            "(0.16.1): the fallback does not know where replayed ids are consumed here")

    @functools.wraps(original)
    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        mode = self.router_replay_action
        if mode == action.REPLAY_FORWARD:
            target = self.target_topk_idx
        elif mode == action.REPLAY_BACKWARD:
            target = self.replay_backward_list[0] if self.replay_backward_list else None
        else:
            target = None
        if target is None:  # RECORD, no action, or no data: upstream's own behaviour and errors
            return original(self, scores, topk, num_groups, group_topk, default_compute_topk)
        ids = _replay_ids(target, scores, topk, num_groups, group_topk, default_compute_topk)
        if ids is None:
            return original(self, scores, topk, num_groups, group_topk, default_compute_topk)
        if mode == action.REPLAY_BACKWARD:
            self.replay_backward_list.pop(0)
        else:
            # the recompute in backward pops this forward's entry: it must route as the forward did, not
            # recompute the router's choice from activations that may differ in the last bit
            for i, entry in enumerate(self.replay_backward_list):
                if entry is target:
                    self.replay_backward_list[i] = ids.detach()
                    break
        return scores.gather(1, ids), ids

    setattr(get_replay_topk, _PATCHED, True)
    replay_cls.get_replay_topk = get_replay_topk


def uninstall_router_fallback() -> None:
    """Restore megatron-core's own `RouterReplay.get_replay_topk`."""
    replay_cls, _ = _megatron_replay()
    current = replay_cls.get_replay_topk
    if getattr(current, _PATCHED, False):
        replay_cls.get_replay_topk = current.__wrapped__


@contextmanager
def router_fallback() -> Iterator[None]:
    """`install_router_fallback` for a `with` block; restores megatron-core's method after, if it installed it."""
    installed_here = not router_fallback_installed()
    install_router_fallback()
    try:
        yield
    finally:
        if installed_here:
            uninstall_router_fallback()


# ---- settings under which replay silently does nothing --------------------------------------------------


def config_problems(config: Any) -> list[str]:
    """Each setting of a megatron-core `TransformerConfig` that defeats routing replay, with its fix."""
    problems = []
    if getattr(config, "num_moe_experts", None) is None:
        problems.append("num_moe_experts is None: the model has no MoE layer, there is nothing to replay")
    if not getattr(config, "moe_enable_routing_replay", False):
        problems.append(
            "moe_enable_routing_replay=False: TopKRouter builds no RouterReplay (moe/router.py:206), so replay "
            "data has nowhere to go; set moe_enable_routing_replay=True")
    if getattr(config, "moe_router_fusion", False):
        problems.append(
            "moe_router_fusion=True: the fused top-k returns before RouterReplay is consulted "
            "(moe/moe_utils.py:652-666), so replay silently does nothing; set moe_router_fusion=False")
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        problems.append(
            "moe_router_load_balancing_type='sinkhorn': TopKRouter.routing takes sinkhorn_load_balancing, which "
            "never consults RouterReplay (moe/router.py:570); use a top-k type ('aux_loss', 'seq_aux_loss', "
            "'global_aux_loss' or 'none')")
    if getattr(config, "moe_router_force_load_balancing", False):
        problems.append(
            "moe_router_force_load_balancing=True: TopKRouter.forward replaces the logits with random ones "
            "(moe/router.py:655), so replayed experts get random weights; set it False (a benchmark setting)")
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        problems.append(
            f"moe_expert_capacity_factor={capacity}: tokens over an expert's capacity are dropped after replay "
            "(moe/router.py:587), so a token can miss its recorded expert, which the rollout engine (dropless) "
            "did not; set moe_expert_capacity_factor=None")
    return problems


def check_config(config: Any) -> None:
    """Raise `RouterReplayError` naming every setting of `config` under which replay would not replay, and its fix."""
    problems = config_problems(config)
    if problems:
        raise RouterReplayError("routing replay would not work with this megatron-core config:\n- "
                                + "\n- ".join(problems))


@dataclass(frozen=True)
class _Router:
    router: Any  # megatron-core TopKRouter
    mtp: bool  # inside a MultiTokenPredictionBlock


def _chunks(model: Any) -> list:
    return list(model) if isinstance(model, list | tuple) else [model]


def _routers(model: Any) -> list[_Router]:
    """Every TopKRouter of `model` (a module or its VPP chunks, wrappers included), in construction order."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    out = []
    for chunk in _chunks(model):
        mtp = {id(m) for block in chunk.modules() if isinstance(block, MultiTokenPredictionBlock)
               for m in block.modules()}
        out += [_Router(m, id(m) in mtp) for m in chunk.modules() if isinstance(m, TopKRouter)]
    return out


def check_model(model: Any) -> None:
    """`check_config` on the config of every router of `model` (a GPTModel, its VPP chunks, or a wrapper of them)."""
    routers = _routers(model)
    if not routers:
        raise RouterReplayError("no megatron-core TopKRouter in this model: a dense model, or pass the model "
                                "chunks themselves")
    seen: set[int] = set()
    for r in routers:
        if id(r.router.config) not in seen:
            seen.add(id(r.router.config))
            check_config(r.router.config)


# ---- which recorded layer feeds which router --------------------------------------------------------------


@dataclass(frozen=True)
class ReplayPlan:
    """Which of the run's MoE layers each `RouterReplay` of this rank replays, in construction order.

    `slots[i]` is the run's MoE ordinal for router i, or None for an MTP router: no engine records MTP
    routes, so it takes its own top-k (rows of -1 through `install_router_fallback`). `instances` are the
    routers' `RouterReplay` objects when the plan was read from a built model.
    """

    slots: tuple[int | None, ...]
    moe_layers: tuple[int, ...]  # the run's MoE layers: the model layer of each MoE ordinal
    top_k: int
    instances: tuple = field(default=(), compare=False, repr=False)

    @property
    def moe_ordinals(self) -> list[int]:
        """The decoder routers' MoE ordinals, in order: `megatron_batch(moe_ordinals=...)` for this rank."""
        return [s for s in self.slots if s is not None]

    @property
    def model_layers(self) -> list[int]:
        """The decoder routers' model layers (0-based), in order."""
        return [self.moe_layers[s] for s in self.moe_ordinals]

    @property
    def mtp_routers(self) -> int:
        """How many MTP routers follow (or sit among) the decoder routers."""
        return sum(s is None for s in self.slots)

    def replay_data(self, per_layer: Sequence, num_tokens: int | None = None) -> list:
        """The list `RouterReplay.set_replay_data` takes, from one `[tokens, top_k]` tensor per `moe_ordinals` entry.

        MTP routers get a `[tokens, top_k]` of -1 (`num_tokens` when this rank has no decoder router).
        """
        import torch

        if len(per_layer) != len(self.moe_ordinals):
            raise RouterReplayError(f"{len(per_layer)} replay tensors for this rank's {len(self.moe_ordinals)} "
                                    f"decoder routers (MoE ordinals {self.moe_ordinals})")
        if not self.mtp_routers:
            return list(per_layer)
        if not router_fallback_installed():
            raise RouterReplayError(f"{self.mtp_routers} MTP routers have no recorded route and take their own "
                                    "top-k through rows of -1: call install_router_fallback() first")
        if num_tokens is None and not per_layer:
            raise RouterReplayError("this rank has only MTP routers: give num_tokens")
        rows = num_tokens if num_tokens is not None else per_layer[0].shape[0]
        device = per_layer[0].device if per_layer else None
        own = torch.full((rows, self.top_k), MISSING_ROUTE, dtype=torch.int64, device=device)
        layers = iter(per_layer)
        return [next(layers) if s is not None else own for s in self.slots]

    def set_replay_data(self, per_layer: Sequence, num_tokens: int | None = None) -> None:
        """Give each router its tensor: straight to the model's own instances when known (other models' routers
        in the process-wide list are left alone), else through `RouterReplay.set_replay_data`."""
        data = self.replay_data(per_layer, num_tokens)
        if self.instances:
            for instance, tensor in zip(self.instances, data):
                instance.set_target_indices(tensor)
        else:
            replay_cls, _ = _megatron_replay()
            replay_cls.set_replay_data(data)


def _ordinals(moe_layers: Sequence[int]) -> dict[int, int]:
    return {int(layer): i for i, layer in enumerate(moe_layers)}


def plan_for_model(model: Any, moe_layers: Sequence[int] | None = None) -> ReplayPlan:
    """The plan of a built model (a GPTModel or this rank's list of VPP chunks): each router's `layer_number`
    as megatron-core set it, MTP routers recognised by their block. `moe_layers`: the run's (e.g.
    `RunShape.moe_layers`); default the model config's MoE pattern. Checks the config first."""
    check_model(model)
    routers = _routers(model)
    config = routers[0].router.config
    run_layers = tuple(int(x) for x in moe_layers) if moe_layers is not None else _config_moe_layers(config)
    ordinal = _ordinals(run_layers)
    slots: list[int | None] = []
    for r in routers:
        if r.mtp:
            slots.append(None)
            continue
        if r.router.layer_number is None:
            raise RouterReplayError("a TopKRouter has no layer_number (built outside a TransformerLayer?)")
        layer = int(r.router.layer_number) - 1  # megatron-core numbers layers from 1
        if layer not in ordinal:
            raise RouterReplayError(f"the router of model layer {layer} is not among the run's MoE layers "
                                    f"{list(run_layers)}: the run was recorded from another model layout")
        slots.append(ordinal[layer])
    if len(set(s for s in slots if s is not None)) != len(slots) - slots.count(None):
        raise RouterReplayError(f"two routers of this model replay the same MoE layer: slots {slots}")
    return ReplayPlan(tuple(slots), run_layers, int(config.moe_router_topk),
                      tuple(r.router.router_replay for r in routers))


def _config_moe_layers(config: Any) -> tuple[int, ...]:
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern

    return tuple(i for i, moe in enumerate(get_moe_layer_pattern(config)) if moe)


def stage_layers(config: Any, pp_rank: int, vp_stage: int | None = None) -> range:
    """The model layers (0-based) megatron-core builds in pipeline rank `pp_rank`, virtual chunk `vp_stage`.

    From `get_transformer_layer_offset` and `get_num_layers_to_build` (the helpers TransformerLayer and
    the block spec use), uneven first/last stages and embedding/loss accounting included.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        # 0.16.1 drops pp_rank for layouts (megatron/core/transformer/transformer_block.py:92,
        # megatron/core/transformer/transformer_layer.py:52) and asks the
        # process's own pipeline rank: only the built model knows
        raise RouterReplayError("a custom pipeline_model_parallel_layout: use plan_for_model(model), which reads "
                                "the layers megatron-core built")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def plan_for_rank(config: Any, pp_rank: int = 0, moe_layers: Sequence[int] | None = None) -> ReplayPlan:
    """The plan of pipeline rank `pp_rank` from its config alone (before the model is built): its VPP chunks
    in order, each chunk's MoE layers, then the MTP routers in the last chunk of the last rank (the MTP layer
    copies the chunk's last layer spec, megatron/core/models/gpt/gpt_layer_specs.py:700, so it has a router when that
    layer is MoE).

    `moe_layers`: the run's; it must equal the config's MoE pattern.
    """
    check_config(config)
    pattern = _config_moe_layers(config)
    run_layers = tuple(int(x) for x in moe_layers) if moe_layers is not None else pattern
    if run_layers != pattern:
        raise RouterReplayError(f"the run's MoE layers {list(run_layers)} are not this config's {list(pattern)} "
                                "(moe_layer_freq): the run was recorded from another model layout")
    ordinal = _ordinals(run_layers)
    pp_size = int(config.pipeline_model_parallel_size)
    vp_size = config.virtual_pipeline_model_parallel_size if pp_size > 1 else None
    stages: list[int | None] = list(range(vp_size)) if vp_size else [None]
    slots: list[int | None] = []
    for vp_stage in stages:
        layers = stage_layers(config, pp_rank, vp_stage)
        slots += [ordinal[layer] for layer in layers if layer in ordinal]
        last_chunk = pp_rank == pp_size - 1 and vp_stage == stages[-1]
        if last_chunk and config.mtp_num_layers and layers and layers[-1] in ordinal:
            slots += [None] * int(config.mtp_num_layers)
    return ReplayPlan(tuple(slots), run_layers, int(config.moe_router_topk))
