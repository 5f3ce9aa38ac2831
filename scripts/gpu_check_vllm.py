#!/usr/bin/env python3
"""GPU end-to-end check for the routing-replay vLLM plugin (see scripts/gpu_check_vllm.sh for what it needs).

1. Builds the tiny Qwen3-MoE (tests/support/vllm_model.py), starts a replay service process.
2. Engine A: vLLM (GPU) with the plugin on, its default runner (V2) and CUDA graphs (the graph-safe capture),
   float32, prefix caching off; generates for several prompts; waits for the routes; every stored route must
   equal transformers' float32 router top-k (as sets), no row flagged, positions complete.
3. Engine B: the same generation with vLLM's own `enable_return_routed_experts=True` and the plugin still on (it
   tees the rows vLLM commits to run "gpu-check-tee"); vLLM's `routed_experts` per request must equal (as sets per
   layer) the teed rows, the plugin's stored routes and transformers.
Exit 0 when every check passes; prints one JSON summary line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def sets(a) -> np.ndarray:
    return np.sort(np.asarray(a, dtype=np.int64), axis=-1)


def main() -> int:
    from replay_client.client import ReplayClient
    from tests.support.service import ServiceProcess
    from tests.support.vllm_model import build_model, hf_reference, prompts
    from tests.test_vllm_e2e import check_against_reference, generate, start_engine, stop_engine, wait_finished

    work = tempfile.mkdtemp(prefix="rr_gpu_")
    model_dir = build_model(os.path.join(work, "model"))
    summary = {"ok": False}
    with ServiceProcess(os.path.join(work, "data")) as svc:
        env = {"ROUTING_REPLAY_URL": svc.url, "ROUTING_REPLAY_RUN_ID": "gpu-check",
               "ROUTING_REPLAY_SPILL_DIR": os.path.join(work, "spill")}
        llm = start_engine(model_dir, 1, env, gpu_memory_utilization=0.3, enforce_eager=False)
        seqs = generate(llm, prompts())
        stop_engine(llm)
        with ReplayClient(svc.url) as c:
            sums = wait_finished(c, "gpu-check", seqs)
            summary["plugin_vs_transformers_cells"] = check_against_reference(c, "gpu-check", model_dir, seqs, sums)
            stored = {rid: c.get_route("gpu-check", rid, strict=True).experts for rid in seqs}

        os.environ.update(env, ROUTING_REPLAY_RUN_ID="gpu-check-tee")  # the plugin on again: it tees
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=128, seed=0,
                  enable_prefix_caching=False, enable_return_routed_experts=True, gpu_memory_utilization=0.3)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()],
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
        ref, _ = hf_reference(model_dir, seqs)
        by_prompt = {tuple(s[: len(p)]): rid for rid, s in seqs.items() for p in prompts() if s[: len(p)] == p}
        stop_engine(llm)  # the tee's sink sends what it holds
        teed = {}
        with ReplayClient(svc.url) as c:
            wait_finished(c, "gpu-check-tee", {o.request_id: [] for o in outs})
            teed = {o.request_id: c.get_route("gpu-check-tee", o.request_id, strict=True).experts for o in outs}
        n = 0
        for o in outs:
            rid = by_prompt[tuple(o.prompt_token_ids)]
            re = getattr(o.outputs[0], "routed_experts", None)
            if re is None:
                re = getattr(o, "routed_experts", None)
            assert re is not None, "vLLM returned no routed_experts"
            re = np.asarray(re)
            assert re.shape[0] == len(seqs[rid]) - 1, (re.shape, len(seqs[rid]))
            assert (sets(re) == sets(stored[rid])).all(), f"{rid}: plugin != vLLM routed_experts"
            assert (sets(re) == sets(teed[o.request_id][: len(re)])).all(), f"{rid}: teed rows != vLLM routed_experts"
            assert (sets(re) == sets(ref[rid])).all(), f"{rid}: vLLM routed_experts != transformers"
            n += re.shape[0] * re.shape[1]
        summary["vllm_routed_experts_cells"] = n
    summary["ok"] = True
    print("GPU_CHECK " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
