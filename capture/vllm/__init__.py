"""routing-replay vLLM plugin: capture MoE routing inside vLLM workers and stream it to the service.

Entry point `capture.vllm:register` (`vllm.general_plugins` in pyproject.toml), which vLLM calls in every process
(front end, engine core, each worker). It does nothing unless `ROUTING_REPLAY_URL` is set (`capture.vllm.config`);
when active it checks every hook point by name and parameters (`capture.vllm.hook_points`), then patches what that
process runs: the scheduler (`capture.vllm.engine_core`) and the model runners (`capture.vllm.worker`), or, with
vLLM's own `enable_return_routed_experts` on, the engine core's tee of the rows vLLM commits. Errors are raised, not
logged (vLLM does not catch a plugin's exceptions), so an unsupported setup stops at startup.

Design: docs/design/vllm_plugin.md.
"""

from __future__ import annotations

_registered = False  # per process: vLLM may call register() more than once


def register() -> None:
    """`vllm.general_plugins` entry point; idempotent."""
    global _registered
    if _registered:
        return
    from capture.vllm.config import PluginConfig

    config = PluginConfig.from_env()
    _registered = True
    if config is None:
        return
    from capture.vllm.hook_points import check_supported

    check_supported()
    from capture.vllm.engine_core.routed_experts_tee import patch_tee
    from capture.vllm.engine_core.scheduler import patch_scheduler
    from capture.vllm.worker.runner import patch_runners

    patch_scheduler()
    patch_tee(config)  # with vLLM's enable_return_routed_experts on: tee its rows, no second capture
    patch_runners(config)


__all__ = ["register"]
