"""routing-replay vLLM plugin: capture MoE routing inside vLLM workers and stream it to the service.

Entry point (pyproject.toml): `[project.entry-points."vllm.general_plugins"]
routing_replay = "capture.vllm:register"`. vLLM calls `register()` in every process
(front end, engine core, each worker). It does nothing unless `ROUTING_REPLAY_URL` is
set (see `capture.vllm.config` for the variables). When active it checks every hook point
by name and parameters (`capture.vllm.hook_points`; the version number decides nothing), patches the
scheduler (`capture.vllm.engine_core`: finish/abort events) and the model runners this vLLM ships (V1 in
0.32/0.33, V2 always: `capture.vllm.worker`), and each worker logs one line once its routers are bound. When the
user turned on vLLM's own `enable_return_routed_experts`, the workers bind nothing and the
engine core tees the rows vLLM's aux-output connector commits instead
(`capture.vllm.engine_core.routed_experts_tee`; one log line says which path runs).
Errors are raised, not logged: vLLM does not catch exceptions from a plugin's function,
so a misconfigured or unsupported setup stops at startup instead of recording garbage.

By process: `config.py`, `log.py` and `hook_points.py` run in every vLLM process; `engine_core/` in
the engine core; `worker/` in each worker; `sink/` in the sink process each sending
worker (or the engine core's tee) starts (no torch, no vLLM), and its client (`sink/handoff.py`,
`sink/launch.py`) in the process that starts it. Engine core and worker are siblings: neither imports
the other; what the engine core tells the workers travels as `scheduler_notes.SchedulerNotes`.
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
