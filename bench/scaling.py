"""Scaling with the service's worker processes: durable ingest and one step's fetch at 1, 2, 4, 8 and 16 workers.

For each worker count N of `--workers` (default 1 2 4 8 16; made for the 16-core machine some sessions are lent,
`scripts/device_bench.sh`), one after another, each against its own `ServiceProcess(..., workers=N)` on a new data
directory (removed after):

- ingest, `bench/ingest.py`'s measurement (its bodies, its CPU accounting): `--ingest-tokens` rows of 48 x top-8
  uint8 (384 B/token) in 8192-row Arrow batches, bodies encoded before timing, posted to /v1/ingest durably (fsync)
  by W concurrent writers, one connection each, `--rounds` rounds after max(8, 2 W) untimed batches (the workers'
  first requests: numba's kernels, caches). W = max(4, N) unless `--writers` says: a writer has one body in flight,
  so fewer writers than workers would leave workers idle by construction; 4 at least, as bench/ingest.py's
  "4 writers" row, so that 1 and 2 workers read as there. Unlike there, the writers are threads of forked
  processes, at most `--writers-per-process` (4) each (1 process up to 4 workers, 4 at 16), all released by one
  barrier once their clients are made (a client's TLS context costs ~55 ms, not timed): 16 writer threads in one
  Python process would share one GIL and could set the rate at 16 workers. The service's CPU per batch (its
  processes, from /proc) and the writers' (their threads' CPU time) come with each round: the writers share the
  machine's cores, and their column shows what they took.
- the step fetch, `bench/step_fetch.py`'s measurement (its functions): one step of `--sequences` x `--tokens`
  (default 256 x 2048: 201 MB) stored as the plugin's sink ships it (4 writers, no fsync) after the step before it,
  then `--ranks` trainer-rank processes (default 64; DP x TP 2 x CP 2) ask `megatron_batch` for their slices at one
  barrier: the first fetch right after ingest, by ranks whose clients fetched the step before (one per worker
  count: a second would not be first), then `--rounds` warm rounds.

Figures: medians of the rounds (min-max) and each against the first worker count of the list ("x", 1 worker at the
defaults). Machine facts first (cores, date, Python); the last line is JSON. Asserts no time (shared, noisy
machines). The defaults take about 4-6 minutes on 16 cores (scripts/device_bench.sh says how that was estimated);
here, on 2 cores, a quick look (about 30 s):

    python bench/scaling.py [--workers 1 2 4 8 16] [--rounds 3] [--ingest-tokens 2097152] [--writers 0]
                            [--writers-per-process 4] [--ranks 64] [--sequences 256] [--tokens 2048]
    python bench/scaling.py --workers 1 2 --ingest-tokens 262144 --ranks 16 --sequences 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/scaling.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np

from bench.ingest import SHAPE, CpuPerBatch, arrow_jobs, make_batches, post_all
from bench.segment_files import PREVIOUS, RUN
from bench.service_cpu import per_gb, process_cpu_s, service_pids
from bench.step_fetch import all_at_once, loaded
from bench.stopping import exit_on_sigterm
from replay_service.ops.demo import bulk_routes
from tests.support.service import ServiceProcess

BATCH_ROWS = 8192
STEP_WRITERS = 4  # the sink shape's writers (DP ranks of the rollout), as bench/step_fetch.py's default


@dataclass
class Scaled:
    """One worker count's figures: ingest tokens/s and CPU per batch per round; the step's rows/s; the service's
    CPU-seconds per GB stored and delivered."""

    workers: int
    writers: int
    ingest: list[float]
    cpu: list[CpuPerBatch]
    first: float
    warm: list[float]
    split: list[int]
    seconds: tuple[float, float]  # the ingest part's and the step part's, services' starts included
    ingest_cpu_per_gb: list[float]  # per round
    first_cpu_per_gb: float
    warm_cpu_per_gb: list[float]  # per round

    def figures(self) -> dict:
        """The medians, for the JSON line."""
        return {"workers": self.workers, "writers": self.writers,
                "ingest_tokens_per_s": round(statistics.median(self.ingest)),
                "service_cpu_ms_per_batch": round(statistics.median(c.service_s for c in self.cpu) * 1e3, 2),
                "writers_cpu_ms_per_batch": round(statistics.median(c.writers_s for c in self.cpu) * 1e3, 2),
                "step_first_rows_per_s": round(self.first),
                "step_warm_rows_per_s": round(statistics.median(self.warm)),
                "connections_per_worker": self.split, "seconds": [round(t, 1) for t in self.seconds],
                "ingest_cpu_s_per_gb": round(statistics.median(self.ingest_cpu_per_gb), 2),
                "first_cpu_s_per_gb": round(self.first_cpu_per_gb, 2),
                "warm_cpu_s_per_gb": round(statistics.median(self.warm_cpu_per_gb), 2)}


def _writer(url: str, jobs: list, go, spans: list, errors: list) -> None:
    """One writer: a connection of its own, then at `go` its jobs posted in order; (start, end, CPU s) to `spans`,
    or what went wrong to `errors` (the barrier broken, so that no other writer waits for this one)."""
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            go.wait(timeout=120)
            started, cpu = time.monotonic(), time.thread_time()
            for path, body, headers in jobs:
                http.post(path, content=body, headers=headers).raise_for_status()
            spans.append((started, time.monotonic(), time.thread_time() - cpu))
    except Exception as exc:  # surfaced by the parent
        errors.append(repr(exc))
        go.abort()


def _writers_process(url: str, parts: list[list], go, out) -> None:
    """One process of writer threads, one per part; its spans and first error to `out`."""
    spans: list = []
    errors: list = []
    threads = [threading.Thread(target=_writer, args=(url, part, go, spans, errors)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((spans, errors[:1]))


def post_spread(url: str, jobs: list, writers: int, processes: int, pids: list[int]) -> tuple[float, CpuPerBatch]:
    """`jobs` posted by `writers` writers (writer w: jobs[w::writers] in order, as `post_all`), threads spread over
    `processes` processes, all released at once: seconds from then to the last answer, and the CPU per batch of the
    service's processes `pids` and of the writers' threads (their clients made before, not counted)."""
    ctx = mp.get_context("fork")
    go, out = ctx.Barrier(writers), ctx.Queue()
    parts = [jobs[w::writers] for w in range(writers)]
    procs = [ctx.Process(target=_writers_process, args=(url, parts[p::processes], go, out)) for p in range(processes)]
    service = process_cpu_s(pids)
    for proc in procs:
        proc.start()
    got = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    errors = [e for _, errs in got for e in errs]
    if errors or any(proc.exitcode for proc in procs):
        raise RuntimeError(f"a writer failed: {errors[:1]}, exit codes {[proc.exitcode for proc in procs]}")
    spans, n = [s for spans, _ in got for s in spans], len(jobs)
    elapsed = max(s[1] for s in spans) - min(s[0] for s in spans)
    return elapsed, CpuPerBatch((process_cpu_s(pids) - service) / n, sum(s[2] for s in spans) / n, elapsed / n)


def ingest_rounds(data: Path, workers: int, writers: int, ids: np.ndarray,
                  args: argparse.Namespace) -> tuple[list[float], list[CpuPerBatch]]:
    """Durable ingest of `ids` by `writers` into a service of `workers`, `args.rounds` times: tokens/s, CPU."""
    batches = make_batches(ids, BATCH_ROWS, args.request_tokens)
    processes = writer_processes(writers, args.writers_per_process)
    rates, cpu = [], []
    with ServiceProcess(data, workers=workers) as service:
        pids = service_pids(service)
        post_all(service.url, arrow_jobs(batches[: max(8, 2 * writers)], "warmup", writers), writers)
        for r in range(args.rounds):
            jobs = arrow_jobs(batches, f"scaling-{r}", writers)  # encoded before timing
            elapsed, used = post_spread(service.url, jobs, writers, processes, pids)
            rates.append(len(ids) / elapsed)
            cpu.append(used)
    return rates, cpu


def writer_processes(writers: int, most: int) -> int:
    """The fewest processes that share `writers` evenly with at most `most` threads each (`writers` at worst)."""
    return next(p for p in range(1, writers + 1) if writers % p == 0 and writers // p <= most)


def step_rounds(data: Path, workers: int, requests: list[str], rows: int,
                args: argparse.Namespace) -> tuple[dict, list[dict], list[int]]:
    """The previous step and the step stored sink-shaped in a service of `workers`; the ranks' first fetch of the
    step (after their fetch of the previous one) and warm rounds (`all_at_once`'s rounds); how many ranks'
    connections each worker held."""
    sequences, previous = [(RUN, r) for r in requests], [(PREVIOUS, r) for r in requests]
    with loaded("sink", data, workers, requests, rows, STEP_WRITERS) as service:
        pids = service_pids(service)
        (first,), split = all_at_once(service.url, args.ranks, sequences, None, 1, first=previous, pids=pids)
        warm, _ = all_at_once(service.url, args.ranks, sequences, None, args.rounds, first=sequences, pids=pids)
    return first, warm, split


def scaled(workers: int, tmp: Path, ids: np.ndarray, requests: list[str], args: argparse.Namespace) -> Scaled:
    """Both measurements at one worker count, each on a data directory of its own, removed after."""
    writers = args.writers or max(4, workers)
    started = time.monotonic()
    try:
        rates, cpu = ingest_rounds(tmp / f"ingest-{workers}", workers, writers, ids, args)
        middle = time.monotonic()
        first, warm, split = step_rounds(tmp / f"step-{workers}", workers, requests, args.tokens - 1, args)
    finally:
        for name in (f"ingest-{workers}", f"step-{workers}"):
            shutil.rmtree(tmp / name, ignore_errors=True)
    batch_bytes = len(ids) * SHAPE.row_width / -(-len(ids) // BATCH_ROWS)  # the mean batch's
    return Scaled(workers, writers, rates, cpu, first["rows"] / first["wall"], [w["rows"] / w["wall"] for w in warm],
                  split, (middle - started, time.monotonic() - middle),
                  [c.service_per_gb(int(batch_bytes)) for c in cpu], per_gb(first["service_cpu_s"], first["bytes"]),
                  [per_gb(w["service_cpu_s"], w["bytes"]) for w in warm])


def machine() -> dict:
    """What the figures ran on."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.machine())
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cores": len(os.sched_getaffinity(0)), "cpu": model, "python": platform.python_version(),
            "load_1min": round(os.getloadavg()[0], 2)}


def spread(values: list[float], scale: float = 1e6) -> str:
    """Median (min-max), in millions."""
    return f"{statistics.median(values) / scale:5.2f} ({min(values) / scale:.2f}-{max(values) / scale:.2f})"


def print_header(base: Scaled) -> None:
    """The table's head ("x": against the first worker count, `base`)."""
    x = f"x of {base.workers}"
    print(f"  {'workers':>7} {'writers':>7} | {'ingest M tok/s':<18} {'service CPU ms/batch':>20} "
          f"{'writers CPU ms/batch':>20} {x:>7} | {'first M rows/s':>14} {x:>7} {'warm M rows/s':<18} {x:>7} | "
          f"{'service CPU-s/GB: ingest':>24} {'first':>6} {'warm':>6} | {'s':>4} | connections per worker")


def print_row(row: Scaled, base: Scaled) -> None:
    """One worker count's line; each figure also against the first worker count's (`base`)."""
    service = statistics.median(c.service_s for c in row.cpu) * 1e3
    writers = statistics.median(c.writers_s for c in row.cpu) * 1e3
    ingest, warm = statistics.median(row.ingest), statistics.median(row.warm)
    print(f"  {row.workers:>7} {row.writers:>7} | {spread(row.ingest):<18} {service:>20.1f} {writers:>20.1f} "
          f"{ingest / statistics.median(base.ingest):>7.2f} | {row.first / 1e6:>14.2f} {row.first / base.first:>7.2f} "
          f"{spread(row.warm):<18} {warm / statistics.median(base.warm):>7.2f} | "
          f"{statistics.median(row.ingest_cpu_per_gb):>24.2f} {row.first_cpu_per_gb:>6.2f} "
          f"{statistics.median(row.warm_cpu_per_gb):>6.2f} | {sum(row.seconds):>4.0f} | "
          f"{':'.join(map(str, row.split))}", flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="the worker counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ingest-tokens", type=int, default=1 << 21, help="tokens per ingest round (8192-row "
                                                                             "batches)")
    parser.add_argument("--request-tokens", type=int, default=1024)
    parser.add_argument("--writers", type=int, default=0, help="ingest's writers (0: max(4, workers))")
    parser.add_argument("--writers-per-process", type=int, default=4, help="ingest's writer threads per process")
    parser.add_argument("--ranks", type=int, default=64, help="trainer ranks, a multiple of 4 (TP 2 x CP 2)")
    parser.add_argument("--sequences", type=int, default=256, help="the step's sequences (a multiple of ranks / 4)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    return parser.parse_args()


def main() -> None:
    args = parse()
    facts = machine()
    step_mb = args.sequences * (args.tokens - 1) * SHAPE.row_width / 1e6
    print(f"scaling with the service's workers: {facts['date']}, {facts['cores']} cores ({facts['cpu']}), Python "
          f"{facts['python']}, 1-min load {facts['load_1min']}", flush=True)
    print(f"  ingest: {args.ingest_tokens} tokens per round, {BATCH_ROWS}-row batches, durable (fsync); step: "
          f"{args.sequences} x {args.tokens} tokens ({step_mb:.0f} MB), sink-shaped, {args.ranks} ranks at once "
          f"(TP 2 x CP 2, THD), first after the step before, then warm; medians of {args.rounds} rounds (min-max), "
          "the first fetch one per worker count",
          flush=True)
    ids = bulk_routes(args.ingest_tokens, 0)
    requests = [f"r{i:04d}" for i in range(args.sequences)]
    rows: list[Scaled] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for workers in args.workers:  # each line as soon as measured: a run cut short keeps what it had
            rows.append(scaled(workers, Path(tmp), ids, requests, args))
            if len(rows) == 1:
                print_header(rows[0])
            print_row(rows[-1], rows[0])
    print(json.dumps({**facts, "ingest_tokens": args.ingest_tokens, "ranks": args.ranks, "sequences": args.sequences,
                      "tokens": args.tokens, "rounds": args.rounds, "rows": [r.figures() for r in rows]}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
