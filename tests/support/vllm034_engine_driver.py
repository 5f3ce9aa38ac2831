"""Driver, run in the vLLM 0.34 environment: vLLM's own engine on the CPU, routed-experts output on, one set of prompts.

`python tests/support/vllm034_engine_driver.py OUT.json` builds a Qwen3-MoE config (no weights: the worker,
`tests/support/toy_moe_worker.py`, draws its own), starts vLLM's `LLMEngine` with `enable_return_routed_experts`
and prefix caching (`BLOCK`-token blocks, a `BUDGET`-token step budget: longer prompts prefill in chunks), and
runs `REQUESTS` under those request ids to their end, then `LATER` together, which share the first prompt's
first blocks (prefix-cache hits) or not. Where the engine core runs is vLLM's choice from the environment
(`VLLM_ENABLE_V1_MULTIPROCESSING`); the plugin is whatever vLLM loads (its `vllm.general_plugins` entry point with
`ROUTING_REPLAY_URL` set). At the end the engine core is shut down (the plugin's tee closes there).

OUT.json: `{"client": the engine-core client's class, "requests": {id: {"prompt", "output", "num_cached_tokens",
"routed_experts" (nested lists), "dtype"}}}`, what vLLM returned per request.
"""

from __future__ import annotations

import json
import sys
import tempfile

BLOCK, BUDGET = 16, 32
LAYERS, DENSE, EXPERTS, TOP_K = 3, [0], 8, 2  # MoE layers 1 and 2; layer 0 dense
MAX_TOKENS = 6


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (7 * i + 11 * salt) % 120 for i in range(n)]


FIRST = _prompt(40, 1)
REQUESTS = [("first", FIRST)]  # (request id, prompt), run alone to its end
# then together: one shares its first two blocks, one repeats it whole, one shares none of it, one extends it
LATER = [("shares-prefix", FIRST[:2 * BLOCK] + _prompt(9, 2)), ("repeats", FIRST), ("fresh", _prompt(21, 3)),
         ("extends", FIRST + _prompt(12, 4))]


def write_config(path: str) -> str:
    """A Qwen3-MoE config of `LAYERS` layers (`DENSE` dense), `EXPERTS` experts, top-`TOP_K`: what vLLM reads."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=DENSE,
                   max_position_embeddings=256, torch_dtype="float32",
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    return path


def run(engine, requests: list[tuple[str, list[int]]]) -> dict[str, dict]:
    """Add `requests` under their ids, step the engine until they end; what vLLM returned for each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    for rid, prompt in requests:
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    done: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            routes = out.outputs[0].routed_experts
            done[out.request_id] = {"prompt": list(out.prompt_token_ids), "output": list(out.outputs[0].token_ids),
                                    "num_cached_tokens": int(out.num_cached_tokens or 0),
                                    "routed_experts": routes.tolist(), "dtype": str(routes.dtype)}
    return done


def main(out_path: str) -> None:
    """Run the engine over `REQUESTS` then `LATER`; write what vLLM returned to `out_path`."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as model:
        args = EngineArgs(model=write_config(model), runner="generate", skip_tokenizer_init=True, dtype="float32",
                          seed=0, worker_cls="tests.support.toy_moe_worker.ToyMoEWorker", enforce_eager=True,
                          enable_return_routed_experts=True, enable_prefix_caching=True, block_size=BLOCK,
                          num_gpu_blocks_override=64, max_num_batched_tokens=BUDGET, max_num_seqs=8,
                          max_model_len=128, async_scheduling=False, disable_log_stats=True)
        engine = LLMEngine.from_engine_args(args)
        try:
            done = run(engine, REQUESTS)
            done.update(run(engine, LATER))
        finally:
            engine.engine_core.shutdown()
    with open(out_path, "w") as f:
        json.dump({"client": type(engine.engine_core).__name__, "requests": done}, f)


if __name__ == "__main__":
    main(sys.argv[1])
