"""routing-replay vLLM plugin: capture MoE routing inside vLLM workers and stream it to the service.

Entry point (pyproject.toml): `[project.entry-points."vllm.general_plugins"]
routing_replay = "capture.vllm:register"`. vLLM calls `register()` in every process
(front end, engine core, each worker). It does nothing unless `ROUTING_REPLAY_URL` is
set (see `capture.vllm.config` for the variables). When active it checks the vLLM
version and every symbol it hooks (`capture.vllm.version`), patches the scheduler
(finish/abort events) and the V1 model runner (`capture.vllm.worker`), and each worker
logs one line once its routers are bound. Errors are raised, not logged: vLLM does not
catch exceptions from a plugin's function, so a misconfigured or unsupported setup
stops at startup instead of recording garbage.
"""

from __future__ import annotations

_STATE = {"registered": False, "config": None}


def register() -> None:
    """`vllm.general_plugins` entry point; idempotent."""
    if _STATE["registered"]:
        return
    from capture.vllm.config import PluginConfig

    config = PluginConfig.from_env()
    _STATE["registered"] = True
    if config is None:
        return
    from capture.vllm.version import check_supported

    check_supported()
    from capture.vllm.scheduler import patch_scheduler
    from capture.vllm.worker import patch_v1_runner

    patch_scheduler()
    patch_v1_runner(config)
    _STATE["config"] = config


__all__ = ["register"]
