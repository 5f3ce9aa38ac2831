"""How long a rank waits for each step's routes on the R3 example's loop, with and without the next step's slice
fetched while this step trains.

The loop of examples/r3_step.py, step after step: the rank takes its slice (`megatron_batch(seqs, packing="bshd")`,
what its `Megatron.lay_out` asks for), then trains for `--compute-s` seconds: a sleep, as a GPU step leaves the host
CPU free (the service, on this machine, shares its cores). `inline` asks for step n's slice when step n starts and
waits for all of it; `in_background` asks for step n+1's as step n starts (`ReplayClient.in_background`) and waits
only for what is left when step n+1 starts; `async task` does the same with `AsyncReplayClient` and
`asyncio.create_task`. Printed per shape and way: the wait per step (median and max over the steps after the first,
which no way can hide) and the fetch's own time. Shapes: `example`, the example's step (16 sequences of ~170 tokens, 3
MoE layers top-4 of 16 experts), and `large` (64 x 2048 tokens, 48 x top-8 of 128: 50 MB a step). Asserts no time.

    python bench/prefetch.py [--steps 8] [--compute-s 0.5] [--shapes example large]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from replay_client import AsyncReplayClient, ReplayClient  # noqa: E402
from replay_format import RunShape  # noqa: E402
from replay_format.rows import RowsMeta, build_rows, encode_stream  # noqa: E402
from tests.support.data import routes  # noqa: E402
from tests.support.service import ServiceProcess  # noqa: E402

SHAPES = {  # sequences per step, tokens per sequence, the run's shape
    "example": (16, 170, RunShape(num_moe_layers=3, top_k=4, num_experts=16)),
    "large": (64, 2048, RunShape(num_moe_layers=48, top_k=8, num_experts=128)),
}


def store_steps(client: ReplayClient, run: str, steps: int, sequences: int, tokens: int, shape: RunShape) -> None:
    """`steps` steps of `sequences` finished requests each (`s<step>-<i>`), random clean routes, 8 requests a batch."""
    rng = np.random.default_rng(0)
    for step in range(steps):
        names = [f"s{step}-{i}" for i in range(sequences)]
        for seq, lo in enumerate(range(0, sequences, 8)):
            chunk = names[lo:lo + 8]
            experts = routes(rng, len(chunk) * (tokens - 1), shape)
            meta = RowsMeta(run, f"w{step}", seq, shape)
            client.ingest(encode_stream(build_rows(meta, [n for n in chunk for _ in range(tokens - 1)],
                                                   np.tile(np.arange(tokens - 1), len(chunk)), experts)))
        for name in names:
            client.finish(run, name, tokens)


def step_sequences(run: str, step: int, sequences: int) -> list[tuple[str, str]]:
    return [(run, f"s{step}-{i}") for i in range(sequences)]


def inline(client: ReplayClient, run: str, steps: int, sequences: int, compute_s: float) -> list[float]:
    """The wait per step when each step asks for its own slice when it starts."""
    waits = []
    for step in range(steps):
        started = time.perf_counter()
        client.megatron_batch(step_sequences(run, step, sequences), packing="bshd")
        waits.append(time.perf_counter() - started)
        time.sleep(compute_s)
    return waits


def in_background(client: ReplayClient, run: str, steps: int, sequences: int, compute_s: float) -> list[float]:
    """The wait per step when step n+1's slice is asked for as step n starts (`in_background`)."""
    waits = []
    upcoming = client.in_background(client.megatron_batch, step_sequences(run, 0, sequences), packing="bshd")
    for step in range(steps):
        started = time.perf_counter()
        upcoming.result()
        waits.append(time.perf_counter() - started)
        if step + 1 < steps:
            upcoming = client.in_background(client.megatron_batch, step_sequences(run, step + 1, sequences),
                                            packing="bshd")
        time.sleep(compute_s)
    return waits


def async_task(url: str, run: str, steps: int, sequences: int, compute_s: float) -> list[float]:
    """The same with `AsyncReplayClient`: step n+1's slice is a task started as step n starts."""

    async def loop() -> list[float]:
        waits = []
        async with AsyncReplayClient(url) as client:
            upcoming = asyncio.create_task(client.megatron_batch(step_sequences(run, 0, sequences), packing="bshd"))
            for step in range(steps):
                started = time.perf_counter()
                await upcoming
                waits.append(time.perf_counter() - started)
                if step + 1 < steps:
                    upcoming = asyncio.create_task(client.megatron_batch(step_sequences(run, step + 1, sequences),
                                                                        packing="bshd"))
                await asyncio.sleep(compute_s)  # the GPU's step: the loop (and the fetch) go on
        return waits

    return asyncio.run(loop())


def figures(waits: list[float]) -> dict[str, float]:
    later = waits[1:] or waits  # the first step's wait is the same for every way: nothing ran before it
    return {"median_ms": round(statistics.median(later) * 1e3, 2), "max_ms": round(max(later) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compute-s", type=float, default=0.5, help="each step's training time (a sleep)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    summary: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            ServiceProcess(Path(tmp) / "data", env={"REPLAY_FSYNC": "false"}) as service, \
            ReplayClient(service.url) as client:
        for name in args.shapes:
            sequences, tokens, shape = SHAPES[name]
            store_steps(client, name, args.steps, sequences, tokens, shape)
            client.megatron_batch(step_sequences(name, 0, sequences), packing="bshd")  # connections and caches warm
            ways: dict[str, Callable[[str, int], list[float]]] = {
                "inline": lambda run, n: inline(client, run, args.steps, n, args.compute_s),
                "in_background": lambda run, n: in_background(client, run, args.steps, n, args.compute_s),
                "async task": lambda run, n: async_task(service.url, run, args.steps, n, args.compute_s),
            }
            result = {way: figures(measure(name, sequences)) for way, measure in ways.items()}
            megabytes = sequences * tokens * shape.num_moe_layers * shape.top_k / 1e6
            print(f"{name}: {args.steps} steps of {sequences} x {tokens} tokens ({megabytes:.2f} MB of routes), "
                  f"{args.compute_s:g} s of training each; wait for the step's routes (median, max over steps 2..):")
            for way, got in result.items():
                print(f"  {way:14s} {got['median_ms']:9.2f} ms {got['max_ms']:9.2f} ms")
            summary[name] = result
    print(json.dumps({"bench": "prefetch", "compute_s": args.compute_s, "steps": args.steps, "shapes": summary}))


if __name__ == "__main__":
    main()
