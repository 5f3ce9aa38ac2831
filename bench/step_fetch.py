"""One training step's fetch as training meets it: N trainer-rank processes ask for their slices at one barrier.

A step of `--sequences` x `--tokens` (default 256 x 2048: 201 MB of 48 x top-8 uint8 routes) on a grid of
DP x TP 2 x CP 2 ranks (DP = N / 4), each rank its own process calling `ReplayClient.megatron_batch` (megatron THD,
`--convention slime` for slime's rule). Two shapes of the stored step: `sink`, rows as the plugin's sink ships a
continuously batching engine's (4 writers, prompts and decodes interleaved, every request spread over many
batches), and `kind`, 8 whole requests per batch. Per shape and rank count, in one run: the ranks' first fetch
right after the requests finish (cold: their clients fetched the previous step, as a training run's ranks have;
and from fresh rank processes, a run's first step) and warm rounds; the same slices one client after another, cold
on a copy of its own (so neither warms the other) and warm; the share of one process reading the rows from the
page-cached segment files; and vLLM's in-band path (base64 `.npy` answers decoded by one process). Beside the rows/s,
the service's CPU-seconds per GB delivered (parent + workers, /proc; `bench/service_cpu.py`) of each round, the
one process's copying the rows out of the files, and the service's read path alone (`read_slice` over the same data,
in this process, one slice at a time, first and warm): the figures that carry to a many-core host. Ray's object store is
`bench/ray_step.py`. Asserts no time.

    python bench/step_fetch.py [--ranks 16 64] [--shapes sink kind] [--rounds 3] [--convention slime]
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/step_fetch.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)


import numpy as np

from bench.segment_files import PREVIOUS, RUN, SHAPE, load_store, load_store_as_sink, segment_rows
from bench.service_cpu import own_cpu_s, per_gb, process_cpu_s, service_pids
from bench.stopping import exit_on_sigterm
from replay_client import ReplayClient
from replay_client.trainer import megatron_query
from replay_format.vllm_response import encode_routed_experts, read_npy
from replay_service.api.trainer import MegatronQueryBody
from replay_service.ops.demo import bulk_routes
from replay_service.ops.workers import worker_count
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore
from replay_service.trainer.plans import SliceLimits
from replay_service.trainer.reads import read_slice
from tests.support.service import ServiceProcess

TP, CP = 2, 2


def rank_query(rank: int, ranks: int, sequences: list, convention: str | None) -> tuple[list, dict]:
    """Rank `rank`'s sequences and megatron options: DP outermost, then CP, then TP (Megatron's default order)."""
    dp_size = ranks // (TP * CP)
    dp, rest = divmod(rank, TP * CP)
    cp, tp = divmod(rest, TP)
    per = len(sequences) // dp_size
    options = {"cp_size": CP, "cp_rank": cp, "tp_size": TP, "tp_rank": tp}
    if convention:
        options["convention"] = convention
    return sequences[dp * per:(dp + 1) * per], options


def serving_pid(client: ReplayClient) -> int:
    """The worker holding this client's connection for large answers (the one `megatron_batch` uses)."""
    return int(json.loads(bytes(client._transport.fetch_bulk("GET", "/healthz", accept="application/json")))["pid"])


def _rank(url: str, rank: int, ranks: int, sequences: list, convention: str | None, rounds: int,
          barrier, results, workers, first: list | None) -> None:
    seqs, options = rank_query(rank, ranks, sequences, convention)
    with ReplayClient(url) as client:
        if first is not None:  # unmeasured: this step's slice (warm rounds) or the previous step's (a trainer's rank)
            client.megatron_batch(rank_query(rank, ranks, first, convention)[0], packing="thd", **options)
        workers.put(serving_pid(client))  # a connection, no route read
        for round_ in range(rounds):
            barrier.wait()
            started = time.monotonic()
            batch = client.megatron_batch(seqs, packing="thd", **options)
            ended = time.monotonic()
            results.put((round_, rank, started, ended, int(batch.experts.shape[0]), int(batch.experts.nbytes)))
            del batch


def all_at_once(url: str, ranks: int, sequences: list, convention: str | None, rounds: int,
                first: list | None = None, pids: list[int] | None = None) -> tuple[list[dict], list[int]]:
    """Each round: every rank's fetch, all released by one barrier, after one unmeasured fetch each of its slice of
    `first` when given (`sequences` itself: warm; the previous step's: the ranks of a training run, whose clients
    fetched a step before). Per round: wall, per-rank times, rows, bytes, and the CPU seconds the service's processes
    `pids` used from the barrier to the last answer; how many ranks' connections each worker holds."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(ranks + 1)  # the ranks and this process, which reads the service's CPU around each round
    results = ctx.Queue()
    workers = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(url, r, ranks, sequences, convention, rounds, barrier, results, workers,
                                                    first))
             for r in range(ranks)]
    for p in procs:
        p.start()
    serving = [workers.get(timeout=600) for _ in range(ranks)]
    split = sorted((serving.count(pid) for pid in set(serving)), reverse=True)
    out = []
    for _ in range(rounds):
        barrier.wait(timeout=600)
        cpu = process_cpu_s(pids or [])
        mine = [results.get(timeout=600) for _ in range(ranks)]  # a round's answers all come before the next's
        out.append({"wall": max(g[3] for g in mine) - min(g[2] for g in mine),
                    "each": sorted(g[3] - g[2] for g in mine),
                    "rows": sum(g[4] for g in mine), "bytes": sum(g[5] for g in mine),
                    "service_cpu_s": process_cpu_s(pids or []) - cpu})
    for p in procs:
        p.join()
    return out, split


def one_client_in_turn(url: str, ranks: int, sequences: list, convention: str | None,
                       previous: list | None = None) -> tuple[float, int]:
    """The same N slices fetched one after another by one client: seconds, rows (after the `previous` step's slices,
    unmeasured, when given)."""
    rows = 0
    with ReplayClient(url) as client:
        for rank in range(ranks) if previous is not None else ():
            seqs, options = rank_query(rank, ranks, previous, convention)
            client.megatron_batch(seqs, packing="thd", **options)
        started = time.monotonic()
        for rank in range(ranks):
            seqs, options = rank_query(rank, ranks, sequences, convention)
            rows += client.megatron_batch(seqs, packing="thd", **options).experts.shape[0]
        return time.monotonic() - started, rows


def read_path(data: Path, ranks: int, sequences: list, convention: str | None) -> tuple[float, float]:
    """The service's read path alone: every rank's slice built in this process, one after another, over `data` (its
    service stopped; no HTTP, nothing else on the cores), on a store opened fresh (first) and then again (warm), with
    the service's own settings and parsing. CPU-seconds per GB of ids built, first and warm: what the service's
    CPU per GB sits on, without the noise of many processes sharing the cores."""
    settings = ServiceSettings(data_dir=data, fsync=False)
    limits = SliceLimits.of(settings)
    queries = [MegatronQueryBody.model_validate(megatron_query(seqs, "thd", **options).to_json()).query()
               for seqs, options in (rank_query(rank, ranks, sequences, convention) for rank in range(ranks))]
    store = RouteStore(settings)
    try:
        figures = []
        for _ in ("first", "warm"):
            cpu, built = own_cpu_s(), 0
            for query in queries:
                built += read_slice(store, query, limits).tokens * SHAPE.row_width * np.dtype(SHAPE.dtype).itemsize
            figures.append(per_gb(own_cpu_s() - cpu, built))
    finally:
        store.close()
    return figures[0], figures[1]


def peak_memory(service: ServiceProcess) -> int:
    """VmHWM of the service's process and its children, bytes."""
    total = 0
    for pid in [service.proc.pid, *service.children()]:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


try:  # vLLM's own base64 codec (a vLLM dependency); the standard library's otherwise
    from pybase64 import b64decode
except ImportError:
    b64decode = base64.b64decode


def in_band(requests: list[str], rows: int, rounds: int) -> float:
    """vLLM's in-band path, rows per second: one rollout process decoding each request's completions JSON (one choice
    whose `routed_experts` is base64 `.npy` of int32 ids, as vLLM 0.32's capturer hands them out) into its
    `[rows, layers, K]` uint8 array, in turn, with the fastest base64 decoder installed (pybase64, vLLM's own, when
    there); the hand-off of those arrays to the ranks is not counted (a lower bound on its cost). Best of
    `rounds` over the whole step."""
    table = bulk_routes(rows * len(requests), 0).reshape(len(requests), rows, SHAPE.num_moe_layers, SHAPE.top_k)
    bodies = [json.dumps({"id": f"cmpl-{r}", "object": "text_completion", "choices": [
        {"index": 0, "text": "", "routed_experts": encode_routed_experts(table[i].astype(np.int32))}]}).encode()
        for i, r in enumerate(requests)]
    del table
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for body in bodies:
            choice = json.loads(body)["choices"][0]
            read_npy(b64decode(choice["routed_experts"])).astype(np.uint8)
        best = min(best, time.perf_counter() - started)
    return len(requests) * rows / best


@contextmanager
def loaded(shape: str, data: Path, workers: int, requests: list[str], rows: int,
           writers: int) -> Iterator[ServiceProcess]:
    """Within: a service over a new data directory holding the previous step and then the step, in `shape`, stopped
    on leaving."""
    with ServiceProcess(data, workers=workers, env={"REPLAY_FSYNC": "false"}) as service:
        clients = [ReplayClient(service.url) for _ in range(writers if shape == "sink" else 1)]
        try:
            for run in (PREVIOUS, RUN):
                if shape == "sink":
                    load_store_as_sink(clients, requests, rows, run=run)
                else:
                    load_store(clients[0], requests, rows, run=run)
        finally:
            for client in clients:
                client.close()
        yield service


def measure(shape: str, ranks: int, tmp: Path, args: argparse.Namespace, requests: list[str], rows: int) -> dict:
    """One shape at one rank count. Three copies, each ingested by its own service, each holding the previous step
    and then the step: on A the ranks, having fetched the previous step (a training run's step after the first),
    fetch the step at once right after its requests finish (first), then warm rounds of both ways; on B one client
    fetches the previous step's slices and then the step's in turn (first; B's service never served A's ranks); on
    C fresh rank processes fetch the step first (a run's first step). Then the one-process read of A's segment
    files (page-cached by then: the machine's limit)."""
    sequences, previous = [(RUN, r) for r in requests], [(PREVIOUS, r) for r in requests]
    a_dir, b_dir, c_dir = (tmp / f"{shape}-{ranks}-{copy}" for copy in "abc")
    with loaded(shape, b_dir, args.workers, requests, rows, args.writers) as b:
        cold_turn_s, turn_rows = one_client_in_turn(b.url, ranks, sequences, args.convention, previous)
    with loaded(shape, c_dir, args.workers, requests, rows, args.writers) as c:
        (fresh,), _ = all_at_once(c.url, ranks, sequences, args.convention, 1, pids=service_pids(c))
    with loaded(shape, a_dir, args.workers, requests, rows, args.writers) as a:
        (cold,), split = all_at_once(a.url, ranks, sequences, args.convention, 1, first=previous,
                                     pids=service_pids(a))
        warm, _ = all_at_once(a.url, ranks, sequences, args.convention, args.rounds, first=sequences,
                              pids=service_pids(a))
        warm_turn_s = statistics.median(one_client_in_turn(a.url, ranks, sequences, args.convention)[0]
                                        for _ in range(args.rounds))
        peak = peak_memory(a)
    read_first, read_warm = read_path(a_dir, ranks, sequences, args.convention)
    files = [_timed(segment_rows, a_dir, requests) for _ in range(args.rounds)]
    files_s = min(seconds for seconds, _ in files)
    total = cold["rows"]
    warm_s = statistics.median(r["wall"] for r in warm)
    out = {"cold_rows_per_s": total / cold["wall"], "warm_rows_per_s": total / warm_s,
           "fresh_rows_per_s": total / fresh["wall"],
           "cold_turn_rows_per_s": turn_rows / cold_turn_s, "warm_turn_rows_per_s": turn_rows / warm_turn_s,
           "files_rows_per_s": len(requests) * rows / files_s, "split": split, "service_peak_mb": peak / 1e6,
           "segments": len(list((a_dir / "runs" / RUN).glob("*.arrow"))),
           "cold_cpu_s_per_gb": per_gb(cold["service_cpu_s"], cold["bytes"]),
           "warm_cpu_s_per_gb": statistics.median(per_gb(r["service_cpu_s"], r["bytes"]) for r in warm),
           "fresh_cpu_s_per_gb": per_gb(fresh["service_cpu_s"], fresh["bytes"]),
           "files_cpu_s_per_gb": min(per_gb(cpu, len(requests) * rows * SHAPE.row_width) for _, cpu in files),
           "read_path_first_cpu_s_per_gb": read_first, "read_path_warm_cpu_s_per_gb": read_warm}
    out["cold_over_warm"] = out["cold_rows_per_s"] / out["warm_rows_per_s"]
    out["fresh_over_warm"] = out["fresh_rows_per_s"] / out["warm_rows_per_s"]
    out["cold_vs_turn"] = out["cold_rows_per_s"] / out["cold_turn_rows_per_s"]
    out["warm_vs_turn"] = out["warm_rows_per_s"] / out["warm_turn_rows_per_s"]
    out["cold_vs_files"] = out["cold_rows_per_s"] / out["files_rows_per_s"]
    out["warm_vs_files"] = out["warm_rows_per_s"] / out["files_rows_per_s"]
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=["sink", "kind"], choices=["sink", "kind"],
                        help="sink: as the plugin's sink ships a continuously batching engine's rows; kind: 8 whole "
                             "requests per batch")
    parser.add_argument("--writers", type=int, default=4, help="writers (DP ranks) of the sink shape")
    parser.add_argument("--workers", type=int, default=0, help="service workers (0: a core each)")
    parser.add_argument("--convention", default=None, help="e.g. slime (its THD rule); default megatron's")
    args = parser.parse_args()
    rows = args.tokens - 1
    requests = [f"r{i:04d}" for i in range(args.sequences)]
    step_bytes = args.sequences * rows * SHAPE.row_width
    print(f"one step: {args.sequences} sequences x {args.tokens} tokens, {step_bytes / 1e6:.0f} MB of routes; "
          f"DP x TP {TP} x CP {CP}, THD ({args.convention or 'megatron'}); {worker_count(args.workers)} workers; "
          f"{os.cpu_count()} cores, 1-min load {os.getloadavg()[0]:.2f}; M rows/s, warm: medians of {args.rounds}")
    report: dict = {"sequences": args.sequences, "tokens": args.tokens, "step_mb": round(step_bytes / 1e6),
                    "convention": args.convention or "megatron"}
    band = in_band(requests, rows, args.rounds)
    report["in_band_rows_per_s"] = round(band)
    print(f"  vLLM in-band, one rollout process decoding each answer's base64 .npy (int32) in turn, hand-off to the "
          f"ranks not counted: {band / 1e6:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for ranks in args.ranks:
                r = report[f"{shape}_r{ranks}"] = measure(shape, ranks, Path(tmp), args, requests, rows)
                print(f"  {shape:4s} ({r['segments']} segments) {ranks:3d} ranks: at once first "
                      f"{r['cold_rows_per_s'] / 1e6:.2f}, warm {r['warm_rows_per_s'] / 1e6:.2f} (first / warm "
                      f"{r['cold_over_warm']:.2f}; fresh rank processes {r['fresh_rows_per_s'] / 1e6:.2f}, "
                      f"{r['fresh_over_warm']:.2f} of warm); one client in turn first "
                      f"{r['cold_turn_rows_per_s'] / 1e6:.2f}, "
                      f"warm {r['warm_turn_rows_per_s'] / 1e6:.2f}; at once / in turn: first {r['cold_vs_turn']:.2f}, "
                      f"warm {r['warm_vs_turn']:.2f}; share of the memory read ({r['files_rows_per_s'] / 1e6:.2f}): "
                      f"first {r['cold_vs_files']:.3f}, warm {r['warm_vs_files']:.3f}; connections per worker "
                      f"{':'.join(map(str, r['split']))}; of in-band: first {r['cold_rows_per_s'] / band:.2f}, "
                      f"warm {r['warm_rows_per_s'] / band:.2f}")
                print(f"       service CPU-s per GB delivered: first {r['cold_cpu_s_per_gb']:.2f}, warm "
                      f"{r['warm_cpu_s_per_gb']:.2f}, fresh rank processes {r['fresh_cpu_s_per_gb']:.2f}; one process "
                      f"copying the rows out of the mapped segment files {r['files_cpu_s_per_gb']:.2f}; the read "
                      f"path alone in one process (no HTTP, one slice at a time): first "
                      f"{r['read_path_first_cpu_s_per_gb']:.2f}, warm {r['read_path_warm_cpu_s_per_gb']:.2f}")
    print(json.dumps(report))


def _timed(fn, *args) -> tuple[float, float]:
    """Seconds and CPU seconds of `fn(*args)` in this process."""
    started, cpu = time.monotonic(), own_cpu_s()
    fn(*args)
    return time.monotonic() - started, own_cpu_s() - cpu


if __name__ == "__main__":
    exit_on_sigterm()
    main()
