"""One training step's fetch: N trainer-rank processes ask for their slices at the same moment (issue 27).

A step of `--sequences` x `--tokens` (default 128 x 4096: 201 MB of 48 x top-8 uint8 routes) on a grid of
DP x TP 2 x CP 2 ranks (DP = N / 4). Every rank is its own process (forked, holding only the client and numpy);
at one barrier they all call `ReplayClient.megatron_batch` for their DP rank's sequences, with their CP and TP
rank (megatron THD, zigzag CP; `--convention slime` for slime's rule), and hold the answer's `[tokens, 48, 8]`
array. Printed per service (one worker, then one per core):

- the wall time until the last rank holds its array, rows delivered per second of it, per-rank p50 / p99;
- bytes on the wire (the slices' rows, summed over ranks) against the step's rows (TP ranks get the same rows);
- the service's peak memory (VmHWM, summed over its processes);
- how the ranks' connections split between the workers (the kernel hands each to one; README, "What the floors say");

beside, in the same run, two baselines: the same N slices fetched one after another by one client (one
process), and one process copying the step's rows out of the memory-mapped segment files (the machine's limit).
Ratios are rows per second against those. Asserts no time (shared, noisy machines).

    python bench/step_fetch.py [--ranks 16 64] [--sequences 128] [--tokens 4096] [--rounds 3] [--workers 1 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/step_fetch.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import numpy as np

from bench.segment_files import SHAPE, load_store, segment_rows
from bench.stopping import exit_on_sigterm
from replay_client import ReplayClient
from replay_service.ops.workers import worker_count
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
          barrier, results, workers) -> None:
    seqs, options = rank_query(rank, ranks, sequences, convention)
    with ReplayClient(url) as client:
        client.megatron_batch(seqs, packing="thd", **options)  # warm: its connection, the service's caches
        workers.put(serving_pid(client))
        for round_ in range(rounds):
            barrier.wait()
            started = time.monotonic()
            batch = client.megatron_batch(seqs, packing="thd", **options)
            ended = time.monotonic()
            results.put((round_, rank, started, ended, int(batch.experts.shape[0]), int(batch.experts.nbytes)))
            del batch


def all_at_once(url: str, ranks: int, sequences: list, convention: str | None,
                rounds: int) -> tuple[list[dict], list[int]]:
    """Each round: every rank's fetch, all released by one barrier. Per round: wall, per-rank times, rows, bytes;
    and how many ranks' connections each worker holds, most first."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(ranks)
    results = ctx.Queue()
    workers = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(url, r, ranks, sequences, convention, rounds, barrier, results, workers))
             for r in range(ranks)]
    for p in procs:
        p.start()
    pids = [workers.get(timeout=600) for _ in range(ranks)]
    split = sorted((pids.count(pid) for pid in set(pids)), reverse=True)
    got = [results.get(timeout=600) for _ in range(ranks * rounds)]
    for p in procs:
        p.join()
    out = []
    for round_ in range(rounds):
        mine = [g for g in got if g[0] == round_]
        out.append({"wall": max(g[3] for g in mine) - min(g[2] for g in mine),
                    "each": sorted(g[3] - g[2] for g in mine),
                    "rows": sum(g[4] for g in mine), "bytes": sum(g[5] for g in mine)})
    return out, split


def one_client_in_turn(url: str, ranks: int, sequences: list, convention: str | None) -> tuple[float, int]:
    """The same N slices fetched one after another by one client: seconds, rows."""
    rows = 0
    with ReplayClient(url) as client:
        started = time.monotonic()
        for rank in range(ranks):
            seqs, options = rank_query(rank, ranks, sequences, convention)
            rows += client.megatron_batch(seqs, packing="thd", **options).experts.shape[0]
        return time.monotonic() - started, rows


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 0], help="services to measure (0: a core each)")
    parser.add_argument("--convention", default=None, help="e.g. slime (its THD rule); default megatron's")
    args = parser.parse_args()
    rows = args.tokens - 1
    requests = [f"r{i:04d}" for i in range(args.sequences)]
    sequences = [("bench", r) for r in requests]
    step_bytes = args.sequences * rows * SHAPE.row_width
    report: dict = {"sequences": args.sequences, "tokens": args.tokens, "step_mb": round(step_bytes / 1e6)}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as loader, ReplayClient(loader.url) as client:
            load_store(client, requests, rows)
        started = time.monotonic()
        segment_rows(data, requests)
        read_files = time.monotonic() - started
        read_files = min(read_files, *(_timed(segment_rows, data, requests) for _ in range(args.rounds)))
        files_rate = args.sequences * rows / read_files
        print(f"one step: {args.sequences} sequences x {args.tokens} tokens, {step_bytes / 1e6:.0f} MB of routes; "
              f"DP x TP {TP} x CP {CP}, THD ({args.convention or 'megatron'}); {os.cpu_count()} cores, 1-min load "
              f"{os.getloadavg()[0]:.2f}")
        print(f"  one process reading the step's rows from the segment files: {read_files:.3f} s, "
              f"{files_rate / 1e6:.2f} M rows/s")
        report["files_rows_per_s"] = round(files_rate)
        for workers in args.workers:
            with ServiceProcess(data, workers=workers, env={"REPLAY_FSYNC": "false"}) as service:
                count = worker_count(workers)
                for ranks in args.ranks:
                    turn = [one_client_in_turn(service.url, ranks, sequences, args.convention)
                            for _ in range(args.rounds)]
                    turn_s = statistics.median(t for t, _ in turn)
                    turn_rate = turn[0][1] / turn_s
                    rounds, split = all_at_once(service.url, ranks, sequences, args.convention, args.rounds)
                    wall = statistics.median(r["wall"] for r in rounds)
                    each = [e for r in rounds for e in r["each"]]
                    rate = rounds[0]["rows"] / wall
                    p50, p99 = np.percentile(each, 50), np.percentile(each, 99)
                    key = f"w{count}_r{ranks}"
                    report[key] = {"wall_s": round(wall, 3), "rows_per_s": round(rate), "p50_s": round(p50, 3),
                                   "p99_s": round(p99, 3), "one_client_rows_per_s": round(turn_rate),
                                   "vs_one_client": round(rate / turn_rate, 2), "vs_files": round(rate / files_rate, 3),
                                   "wire_over_step": round(rounds[0]["bytes"] / step_bytes, 2),
                                   "service_peak_mb": round(peak_memory(service) / 1e6),
                                   "connections_per_worker": split}
                    r = report[key]
                    print(f"  {count} worker{'s' if count > 1 else ' '} {ranks:3d} ranks at once: last rank after "
                          f"{wall:.2f} s, {rate / 1e6:.2f} M rows/s (per rank p50 {p50:.2f} s, p99 {p99:.2f} s); "
                          f"one client in turn {turn_rate / 1e6:.2f} M rows/s -> ratio {r['vs_one_client']:.2f}; "
                          f"of the file read {r['vs_files']:.3f}; wire {r['wire_over_step']:.2f} x the step; "
                          f"service peak {r['service_peak_mb']} MB; connections per worker "
                          f"{':'.join(map(str, split))}")
    print(json.dumps(report))


def _timed(fn, *args) -> float:
    started = time.monotonic()
    fn(*args)
    return time.monotonic() - started


if __name__ == "__main__":
    exit_on_sigterm()
    main()
