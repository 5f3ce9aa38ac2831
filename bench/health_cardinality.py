"""Series and scrape time of /metrics as runs pile up: run health is exported per run for the capped newest only.

A real service (no fsync: throwaway data) is given N runs, each one small ingest batch (one request of 8 rows;
every tenth run holds a ZERO row, so it fails); then, for each cap (REPLAY_METRICS_MAX_RUNS), the service is
started again on those runs and /metrics is scraped K times: series exported (all, and those with a `run`
label), exposition bytes and scrape time (median, min-max). Every run is judged at each scrape, so the time grows
with the runs while the series stay bounded by the cap.

    python bench/health_cardinality.py [--runs 1000] [--caps 0,100,1000] [--scrapes 7] [--writers 4]

Asserts nothing (shared, noisy machines); the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/health_cardinality.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.stopping import exit_on_sigterm
from replay_client.client import ReplayClient
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess

ENV = {"REPLAY_FSYNC": "0"}


def fill(url: str, runs: int, writers: int) -> float:
    """`runs` runs of one 8-row request each (every tenth with a ZERO row); the seconds it took."""
    rows = routes(np.random.default_rng(7), 8)
    zero = rows.copy()
    zero[3] = 0
    bodies = [batch_bytes(f"run-{i:05d}", "w", 0, ["r"] * 8, np.arange(8), zero if i % 10 == 0 else rows)
              for i in range(runs)]
    started = time.perf_counter()

    def send(part: list[bytes]) -> None:
        with ReplayClient(url) as client:
            for body in part:
                client.ingest(body)

    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(send, [bodies[w::writers] for w in range(writers)]))
    return time.perf_counter() - started


def scrape(url: str, scrapes: int) -> dict:
    """Scrape /metrics `scrapes` times: series (all, per run), bytes, times (ms)."""
    times, text = [], ""
    with httpx.Client() as http:
        for _ in range(scrapes):
            started = time.perf_counter()
            answer = http.get(f"{url}/metrics", timeout=60.0)
            times.append((time.perf_counter() - started) * 1000)
            answer.raise_for_status()
            text = answer.text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    per_run = [s for s in samples if "run" in s.labels]
    not_exported = [s.value for s in samples if s.name == "replay_runs_not_exported"]
    return {"series": len(samples), "per_run_series": len(per_run),
            "exported_runs": len({s.labels["run"] for s in per_run}),
            "not_exported": int(not_exported[0]) if not_exported else None, "bytes": len(text),
            "scrape_ms_median": round(statistics.median(times), 1), "scrape_ms_min": round(min(times), 1),
            "scrape_ms_max": round(max(times), 1)}


def main() -> None:
    """Fill a store, then scrape it once per cap; a table, then JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--caps", default="0,100,1000", help="REPLAY_METRICS_MAX_RUNS values, comma-separated")
    parser.add_argument("--scrapes", type=int, default=7)
    parser.add_argument("--writers", type=int, default=4, help="concurrent ingest connections while filling")
    args = parser.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="replay-bench-health-") as tmp:
        data = Path(tmp) / "data"
        with ServiceProcess(data, env=ENV) as service:
            fill_s = fill(service.url, args.runs, args.writers)
        print(f"{args.runs} runs stored in {fill_s:.1f} s")
        print(f"{'cap':>6} {'series':>7} {'per-run':>8} {'runs out':>9} {'bytes':>9} "
              f"{'scrape ms (median, min-max)':>30}")
        for cap in caps:
            with ServiceProcess(data, env={**ENV, "REPLAY_METRICS_MAX_RUNS": str(cap)}) as service:
                scrape(service.url, 1)  # warm: the index's pages, the app's first answer
                found = scrape(service.url, args.scrapes)
            results.append({"runs": args.runs, "cap": cap, **found})
            print(f"{cap:>6} {found['series']:>7} {found['per_run_series']:>8} {found['not_exported']!s:>9} "
                  f"{found['bytes']:>9} {found['scrape_ms_median']:>14.1f} ({found['scrape_ms_min']:.1f}-"
                  f"{found['scrape_ms_max']:.1f})")
    print(json.dumps({"bench": "health_cardinality", "fill_s": round(fill_s, 2), "results": results}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
