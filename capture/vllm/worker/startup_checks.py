"""Runs in each vLLM worker at load_model: the engine settings the capture refuses, and what it reads of the config.

Every refusal is a `StartupError` naming the fix (vLLM does not catch a plugin's exceptions, so the
engine stops at start-up instead of recording garbage). `check_config` runs before any router is
bound; `recorder_choice.choose_recorder` refuses what only the bound layers tell.
"""

from __future__ import annotations

from typing import Any

from capture.vllm.config import CaptureMode
from capture.vllm.kv_connectors import connector_problems


class StartupError(RuntimeError):
    """The engine's configuration would make the capture record garbage; refused at load_model."""


def cuda_graphs(vcfg: Any) -> object | None:
    """vLLM's cudagraph_mode when CUDA graphs are on (anything but NONE), else None."""
    graphs = getattr(getattr(vcfg, "compilation_config", None), "cudagraph_mode", None)
    return graphs if graphs is not None and getattr(graphs, "name", str(graphs)) != "NONE" else None


def check_config(vcfg: Any, mode: CaptureMode) -> None:
    """StartupError naming the fix for each setting a capture in `mode` (as asked for) cannot work with."""
    if vcfg is None:
        return
    problems = connector_problems(getattr(vcfg, "kv_transfer_config", None))
    graphs = cuda_graphs(vcfg)
    if graphs is not None and mode == CaptureMode.EAGER:
        problems.append(
            f"CUDA graphs are on ({graphs}) and {mode} capture was asked for: a replayed "
            "graph runs the MoE kernels without calling the router's capture callback, so every row would "
            "arrive STALE; start vLLM with enforce_eager=True (--enforce-eager), or unset "
            "ROUTING_REPLAY_CAPTURE_MODE (graph-safe capture on a GPU)"
        )
    par = getattr(vcfg, "parallel_config", None)
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        problems.append("pipeline parallelism is not supported (each stage holds only its layers)")
    if problems:
        raise StartupError("routing-replay: refusing to start: " + "; ".join(problems))


def model_num_hidden_layers(vcfg: Any, moe_layers: tuple[int, ...]) -> int:
    """The model's layer count, dense layers included, as vLLM's own `routed_experts` counts it; 0 when unknown.

    vLLM sizes its routed-experts buffer by `model_config.get_total_num_hidden_layers()`
    (`routed_experts_capturer._get_routed_experts_shape`); without it, the HF text config's
    `num_hidden_layers`. A count that cannot hold the routers' layer ids (e.g. MTP layers numbered past
    it) is not used: 0 lets the service derive `max(moe_layers) + 1`.
    """
    model_config: Any = getattr(vcfg, "model_config", None)
    count = 0
    try:
        count = int(model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - an older or a stand-in config: fall back to the HF config
        for name in ("hf_text_config", "hf_config"):
            value = getattr(getattr(model_config, name, None), "num_hidden_layers", None)
            if isinstance(value, int) and not isinstance(value, bool):
                count = value
                break
    return count if moe_layers and count > moe_layers[-1] else 0
