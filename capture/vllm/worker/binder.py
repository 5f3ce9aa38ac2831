"""Bind a capture callback to every MoE router of a loaded vLLM model.

`bind_model(model, ours)` sets each `MoERunner`'s `router.capture_fn` (vLLM's `BaseRouter` slot: the
*logical* top-k ids, before the EPLB remap) to a `ChainedCapture` that calls ours, then whatever was there (vLLM's
own capturer), and `install_set_hook` makes a later `set_capture_fn` chain too. Refused with `BindError` at startup:
a monolithic quant method (the kernel routes internally: nothing to capture), a router that is not a `BaseRouter`,
or a model with no MoE layer.

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capture.vllm.patching import is_patched, patch


class BindError(RuntimeError):
    """A model whose routing the capture cannot see (module docstring)."""


class ChainedCapture:
    """router.capture_fn: ours first, then the previously installed callback."""

    __slots__ = ("ours", "prev", "runner")

    def __init__(self, ours: Callable, prev: Callable | None, runner) -> None:
        self.ours = ours
        self.prev = prev
        self.runner = runner

    def __call__(self, topk_ids) -> None:
        try:
            self.ours(self.runner, topk_ids)
        finally:
            if self.prev is not None:
                self.prev(topk_ids)


@dataclass(frozen=True)
class BoundLayer:
    """One MoE layer the capture is bound to."""

    layer_id: int  # model layer index
    runner: Any  # the MoERunner
    router: Any  # its BaseRouter


def _router_base():
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    return BaseRouter


def _runner_class():
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return MoERunner


def install_set_hook() -> None:
    """Patch BaseRouter.set_capture_fn so setting a callback over ours chains it (idempotent)."""
    base = _router_base()
    if is_patched(base.set_capture_fn):
        return
    orig = base.set_capture_fn

    def set_capture_fn(self, capture_fn):
        current = getattr(self, "capture_fn", None)
        if isinstance(current, ChainedCapture) and not isinstance(capture_fn, ChainedCapture):
            current.prev = capture_fn  # keep ours, chain (or drop, if None) theirs
            return
        orig(self, capture_fn)

    patch(base, "set_capture_fn", set_capture_fn)


def is_monolithic(runner) -> bool:
    flag = getattr(runner, "is_monolithic", None)
    if flag is None:
        quant = getattr(getattr(runner, "routed_experts", None), "quant_method", None)
        flag = getattr(quant, "is_monolithic", False)
    return bool(flag() if callable(flag) else flag)


def find_moe_runners(model, runner_cls=None) -> list:
    runner_cls = runner_cls or _runner_class()
    return [m for m in model.modules() if isinstance(m, runner_cls)]


def bind_model(model, ours: Callable, runner_cls=None, router_base=None) -> list[BoundLayer]:
    """Install `ours(runner, topk_ids)` on every MoE router of `model` (see module docstring)."""
    runners = find_moe_runners(model, runner_cls)
    router_base = router_base or _router_base()
    if not runners:
        raise BindError(
            f"routing-replay: {type(model).__name__} has no vLLM MoERunner layers; nothing to capture "
            "(unset ROUTING_REPLAY_URL for dense models)"
        )
    bad = []
    for r in runners:
        if is_monolithic(r):
            quant = type(getattr(getattr(r, "routed_experts", None), "quant_method", None)).__name__
            bad.append(f"{getattr(r, 'layer_name', '?')}: monolithic MoE kernel ({quant}) routes inside the kernel")
        elif not isinstance(getattr(r, "router", None), router_base):
            bad.append(f"{getattr(r, 'layer_name', '?')}: router {type(r.router).__name__} has no capture slot")
    if bad:
        raise BindError(
            "routing-replay: cannot capture routing from these MoE layers (refusing rather than recording "
            "zeros): " + "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
            + ". Use a modular (non-monolithic) MoE backend or unset ROUTING_REPLAY_URL."
        )
    bound = []
    for r in runners:
        current = r.router.capture_fn
        if isinstance(current, ChainedCapture):  # re-bind (model reloaded): keep what was chained
            current.ours, current.runner = ours, r
            chained = current
        else:
            chained = ChainedCapture(ours, current, r)
            r.router.capture_fn = chained
        bound.append(BoundLayer(int(r.layer_id), r, r.router))
        assert r.router.capture_fn is chained
    return bound
