"""Durable ingest throughput through a real server, beside raw Arrow-IPC-write-plus-fsync of the same batches.

Ours: Arrow IPC record batches (48 x top-8 uint8 rows, 384 B/row) posted to /v1/ingest by W concurrent
writers (threads, one connection each), every answer an acknowledgement that the rows are durable.
Configurations, each run in rounds (medians, min-max):

- 8192-row batches, 1 writer and 4 concurrent writers (a sender with a short flush interval, many DP ranks);
- 32768-row batches, 2 writers (large batches).

Raw baseline, in the same run and between our rounds: this one process writes the same record batches as
Arrow IPC files into a temp folder on the data directory's filesystem, each fsynced and then its folder
fsynced (what the service does before it acknowledges); no service, no HTTP, no checks, no index.

The HTTP floor, in the same rounds: the same bodies posted by the same writers to a server that receives each
body, drops it and answers a few bytes (`bench/http_floor.py`): what sending alone costs here, with the writers
and that server on the same cores as the service. No service that receives its bodies over HTTP is above it.
The uvicorn floor, also in the same rounds: the same bodies to uvicorn with the service's HTTP options and as
many workers, running a bare app that receives each body through ASGI and drops it: what the service's HTTP
stack costs before the service does anything. Its CPU-seconds per GB received (its processes, from /proc) is the
floor of the service's own CPU per GB stored: the bytes' cost through the same HTTP stack.

Where the CPU went, in the service's rounds: CPU per batch of the service's processes (from /proc) and of the
writers (this process), the service's CPU-seconds per GB stored beside the raw write's (`bench/service_cpu.py`:
the figure that carries to a many-core host), and the bound they set on this machine: were every core busy all the
round, a batch could take no less than (service + writers) / cores, which caps the ratio to raw at raw's time per
batch over that (the "CPU bound" column); "cores busy" is how much of that the round used.

Request bodies are encoded BEFORE the timed region: a sender encodes on its own machine, and here the client
shares the service's cores, so only sending, the service's work and receiving the answer are timed.

The STALE table per host against per worker, in the same rounds: a second service on its own data directory with
`REPLAY_STALE_TABLE_SCOPE=worker` (each worker's own table in memory, what the service did before issue 41) takes
the same batches; "shared / per worker" is the ratio of the two services' rates (the shared table's cost: the
file's lock per batch and its cache misses).

Also kept: today's transport in the same run (each request's route as int32 ids, base64 inside JSON, as
SGLang's `meta_info["routed_experts"]`, posted per request to the service's own upload endpoint, so both end
in the same durable store); its bodies are also encoded before timing.

    python bench/ingest.py [--rounds 3] [--small-tokens 262144] [--large-tokens 1048576] [--json-tokens 131072]
                           [--workers 0]   (the service's worker processes; 0, the default: one per core)

Each transport first sends a few untimed batches to another run (the server's buffers, connections and page
cache warm up, as in a long-running service). Asserts nothing (shared, noisy machines); the last line is JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/ingest.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np
import pyarrow as pa

from bench.http_floor import BytesServer, uvicorn_floor
from bench.service_cpu import own_cpu_s, per_gb, process_cpu_s, service_pids
from bench.stopping import exit_on_sigterm
from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.ops.demo import bulk_routes
from replay_service.ops.workers import worker_count
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)
ARROW_HEADERS = {"content-type": ARROW_STREAM_MEDIA_TYPE}
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class Config:
    """One measured configuration: batch size and concurrent writers."""

    name: str
    batch_rows: int
    writers: int
    tokens: int


def post_all(url: str, jobs: list[tuple[str, bytes, dict]], writers: int) -> float:
    """POST every `(path, body, headers)` of `jobs`, split across `writers` threads; seconds elapsed."""
    return post_parts([url], [jobs[w::writers] for w in range(writers)])


def post_parts(urls: list[str], parts: list[list[tuple[str, bytes, dict]]]) -> float:
    """Writer w POSTs its part's `(path, body, headers)` in order to urls[w mod n], all writers at once; seconds
    until the last answer (bench/scale_out.py spreads writers over replicas with it)."""
    errors: list[BaseException] = []
    clients = [httpx.Client(base_url=urls[w % len(urls)], timeout=300) for w in range(len(parts))]
    go = threading.Barrier(len(parts) + 1)

    def worker(http: httpx.Client, part: list) -> None:
        go.wait()
        for path, body, headers in part:
            try:
                http.post(path, content=body, headers=headers).raise_for_status()
            except Exception as exc:  # surfaced after the run
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(clients[w], part)) for w, part in enumerate(parts)]
    for t in threads:
        t.start()
    go.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    for http in clients:
        http.close()
    if errors:
        raise errors[0]
    return elapsed


@dataclass
class CpuPerBatch:
    """Where one round's CPU went, per batch: the service's processes and the writers (this process)."""

    service_s: float
    writers_s: float
    wall_s: float

    def bound_ratio(self, raw_s: float, cores: int) -> float:
        """The most a round with this CPU per batch could reach against raw's `raw_s` per batch, every core busy."""
        return raw_s / ((self.service_s + self.writers_s) / cores)

    def busy(self, cores: int) -> float:
        """The share of the cores' time the round used."""
        return (self.service_s + self.writers_s) / (cores * self.wall_s)

    def service_per_gb(self, batch_bytes: int) -> float:
        """The service's CPU seconds per GB stored (`batch_bytes`: the ids of one batch)."""
        return per_gb(self.service_s, batch_bytes)


def measured_post(url: str, jobs: list[tuple[str, bytes, dict]], writers: int, pids: list[int]) -> tuple[float,
                                                                                                       CpuPerBatch]:
    """`post_all`, with the CPU per batch of the service's processes `pids` and of the writers."""
    service, own = process_cpu_s(pids), own_cpu_s()
    elapsed = post_all(url, jobs, writers)
    n = len(jobs)
    return elapsed, CpuPerBatch((process_cpu_s(pids) - service) / n, (own_cpu_s() - own) / n, elapsed / n)


def raw_write(folder: Path, batches: list[pa.RecordBatch], cpu: list[float] | None = None) -> float:
    """Write each batch as an Arrow IPC file, fsync it and its folder (one process); seconds elapsed (and the CPU
    seconds it used appended to `cpu`)."""
    folder.mkdir(parents=True, exist_ok=True)
    started, used = time.perf_counter(), own_cpu_s()
    for i, batch in enumerate(batches):
        path = folder / f"{i}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    elapsed = time.perf_counter() - started
    if cpu is not None:
        cpu.append(own_cpu_s() - used)
    for path in folder.iterdir():
        path.unlink()
    return elapsed


def make_batches(ids: np.ndarray, batch_rows: int, request_tokens: int) -> list[tuple[list[str], np.ndarray,
                                                                                          np.ndarray]]:
    """The rows of each batch: request ids, positions, experts (requests of `request_tokens` rows)."""
    out = []
    for lo in range(0, len(ids), batch_rows):
        n = min(batch_rows, len(ids) - lo)
        request_ids = [f"r{(lo + i) // request_tokens}" for i in range(n)]
        positions = ((lo + np.arange(n)) % request_tokens).astype(np.int32)
        out.append((request_ids, positions, ids[lo : lo + n]))
    return out


def arrow_jobs(batches, run_id: str, writers: int) -> list[tuple[str, bytes, dict]]:
    """Encoded /v1/ingest bodies of `batches` for `run_id`, seq i by writer i % writers."""
    jobs = []
    for seq, (request_ids, positions, experts) in enumerate(batches):
        meta = RowsMeta(run_id, f"w{seq % writers}", seq, SHAPE, source="vllm-plugin")
        jobs.append(("/v1/ingest", encode_stream(build_rows(meta, request_ids, positions, experts)), ARROW_HEADERS))
    return jobs


def summary(values: list[float]) -> tuple[float, float, float]:
    """Median, min, max."""
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float]) -> str:
    med, lo, hi = summary(values)
    return f"{med / 1e6:5.2f} M tok/s ({lo / 1e6:.2f}-{hi / 1e6:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small-tokens", type=int, default=1 << 18, help="tokens per round, 8192-row batches")
    parser.add_argument("--large-tokens", type=int, default=1 << 20, help="tokens per round, 32768-row batches")
    parser.add_argument("--request-tokens", type=int, default=1024)
    parser.add_argument("--json-tokens", type=int, default=1 << 17, help="the base64-JSON baseline is slow: fewer")
    parser.add_argument("--warmup-batches", type=int, default=8, help="untimed batches (and requests) sent first")
    parser.add_argument("--workers", type=int, default=0, help="the service's worker processes (0: one per core)")
    args = parser.parse_args()
    workers = worker_count(args.workers)
    cores = len(os.sched_getaffinity(0))

    configs = [Config("8192-row batches, 1 writer", 8192, 1, args.small_tokens),
               Config("8192-row batches, 4 writers", 8192, 4, args.small_tokens),
               Config("32768-row batches, 2 writers", 32768, 2, args.large_tokens)]
    ids = bulk_routes(max(c.tokens for c in configs), 0)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp, \
            ServiceProcess(Path(tmp) / "data", workers=workers) as proc, \
            ServiceProcess(Path(tmp) / "data-per-worker", workers=workers,
                           env={"REPLAY_STALE_TABLE_SCOPE": "worker"}) as per_worker, \
            BytesServer(b'{"stored":true}', "application/json") as floor_url, \
            uvicorn_floor(b'{"stored":true}', "application/json", workers) as bare_floor:
        url, uvicorn_url = proc.url, bare_floor.url
        raw_dir = Path(tmp) / "raw"  # beside the data directory: the same filesystem
        for config in configs:
            batches = make_batches(ids[: config.tokens], config.batch_rows, args.request_tokens)
            record_batches = [build_rows(RowsMeta("raw", "w0", i, SHAPE, source="vllm-plugin"), *b)
                              for i, b in enumerate(batches)]
            warmup = arrow_jobs(batches[: args.warmup_batches], f"warmup-{config.batch_rows}-{config.writers}",
                                config.writers)
            post_all(url, warmup, config.writers)
            post_all(uvicorn_url, warmup, config.writers)
            post_all(per_worker.url, warmup, config.writers)
            ours, raw, floor, bare, cpu, bounds, own_tables, raw_cpu = [], [], [], [], [], [], [], []
            bare_cpu: list[CpuPerBatch] = []
            batch_bytes = config.batch_rows * SHAPE.row_width
            pids, bare_pids = service_pids(proc), service_pids(bare_floor)
            for r in range(args.rounds):
                jobs = arrow_jobs(batches, f"bench-{config.batch_rows}-{config.writers}-{r}", config.writers)
                elapsed, used = measured_post(url, jobs, config.writers, pids)
                ours.append(config.tokens / elapsed)
                raw_s = raw_write(raw_dir, record_batches, raw_cpu)
                raw.append(config.tokens / raw_s)
                cpu.append(used)
                bounds.append(used.bound_ratio(raw_s / len(jobs), cores))
                floor.append(config.tokens / post_all(floor_url, jobs, config.writers))
                bare_s, bare_used = measured_post(uvicorn_url, jobs, config.writers, bare_pids)
                bare.append(config.tokens / bare_s)
                bare_cpu.append(bare_used)
                own_tables.append(config.tokens / post_all(per_worker.url, jobs, config.writers))
            results[config.name] = {"ours": ours, "raw": raw, "floor": floor, "uvicorn": bare, "cpu": cpu,
                                    "cpu_per_gb": [c.service_per_gb(batch_bytes) for c in cpu],
                                    "raw_cpu_per_gb": [per_gb(c, config.tokens * SHAPE.row_width) for c in raw_cpu],
                                    "uvicorn_cpu_per_gb": [c.service_per_gb(batch_bytes) for c in bare_cpu],
                                    "bounds": bounds, "per_worker": own_tables,
                                    "table_ratios": [o / p for o, p in zip(ours, own_tables)],
                                    "ratios": [o / w for o, w in zip(ours, raw)],
                                    "floor_ratios": [f / w for f, w in zip(floor, raw)],
                                    "uvicorn_ratios": [b / w for b, w in zip(bare, raw)]}
            stored = httpx.get(f"{url}/v1/runs/bench-{config.batch_rows}-{config.writers}-0").json()
            assert stored["rows"] == config.tokens, stored

        # Today's transport: per request, int32 ids as base64 in JSON, decoded and stored by the server.
        base_ids = ids[: args.json_tokens]
        per_request = args.request_tokens

        def json_jobs(run_id: str, n: int | None = None) -> list[tuple[str, bytes, dict]]:
            jobs = []
            for r, lo in enumerate(range(0, len(base_ids), per_request)):
                doc = {"routed_experts": base64.b64encode(base_ids[lo : lo + per_request].astype(np.int32)
                                                          .tobytes()).decode(),
                       "num_layers": SHAPE.num_moe_layers, "top_k": SHAPE.top_k, "num_experts": SHAPE.num_experts}
                jobs.append((f"/v1/runs/{run_id}/requests/q{r}/routes", json.dumps(doc).encode(), JSON_HEADERS))
            return jobs[:n]

        post_all(url, json_jobs("warmup-json", args.warmup_batches), 2)
        json_tps = len(base_ids) / post_all(url, json_jobs("bench-json"), 2)
        large_tps = statistics.median(results[configs[2].name]["ours"])

    print(f"ingest, {SHAPE.num_moe_layers} x top-{SHAPE.top_k} uint8 rows ({SHAPE.row_width} B/token), durable "
          f"(fsync) store, {workers} service worker{'s' if workers > 1 else ''}; medians of {args.rounds} rounds "
          "(min-max); bodies encoded before timing")
    print(f"  {'path':<30} {'ours':<30} {'raw Arrow IPC + fsync':<30} {'ratio':<17} "
          f"{'HTTP floor (bodies dropped)':<30} {'floor / raw':<17} {'uvicorn floor (bodies dropped)':<30} "
          "uvicorn / raw")
    for config in configs:
        res = results[config.name]
        med, lo, hi = summary(res["ratios"])
        floor_med, floor_lo, floor_hi = summary(res["floor_ratios"])
        bare_med, bare_lo, bare_hi = summary(res["uvicorn_ratios"])
        print(f"  {config.name:<30} {fmt(res['ours']):<30} {fmt(res['raw']):<30} {med:.2f} ({lo:.2f}-{hi:.2f})"
              f"{'':<5} {fmt(res['floor']):<30} {floor_med:.2f} ({floor_lo:.2f}-{floor_hi:.2f})"
              f"{'':<5} {fmt(res['uvicorn']):<30} {bare_med:.2f} ({bare_lo:.2f}-{bare_hi:.2f})")
    print(f"  where the CPU went in our rounds, per batch (medians): service processes, writers, the ratio to raw "
          f"that bounds on {cores} cores, and how busy the cores were")
    for config in configs:
        res = results[config.name]
        service = statistics.median(c.service_s for c in res["cpu"]) * 1e3
        writers_ms = statistics.median(c.writers_s for c in res["cpu"]) * 1e3
        bound_med, bound_lo, bound_hi = summary(res["bounds"])
        busy = statistics.median(c.busy(cores) for c in res["cpu"])
        per, per_lo, per_hi = summary(res["cpu_per_gb"])
        raw_per = statistics.median(res["raw_cpu_per_gb"])
        bare_per = statistics.median(res["uvicorn_cpu_per_gb"])
        print(f"  {config.name:<30} service {service:5.1f} ms, writers {writers_ms:5.1f} ms; CPU bound "
              f"{bound_med:.2f} of raw ({bound_lo:.2f}-{bound_hi:.2f}); cores busy {busy:.0%}; service CPU-s per GB "
              f"stored {per:.2f} ({per_lo:.2f}-{per_hi:.2f}), raw write's {raw_per:.2f}, uvicorn floor's "
              f"{bare_per:.2f}")
    print("  the STALE table shared by the host's workers (ours) beside a table per worker, same batches, same rounds")
    for config in configs:
        res = results[config.name]
        med, lo, hi = summary(res["table_ratios"])
        print(f"  {config.name:<30} shared {fmt(res['ours']):<30} per worker {fmt(res['per_worker']):<30} "
              f"shared / per worker {med:.2f} ({lo:.2f}-{hi:.2f})")
    print(f"  base64 json, requests of {per_request} tokens, 2 writers: {json_tps / 1e6:.3f} M tok/s; "
          f"32768-row arrow / base64-json: {large_tps / json_tps:.1f}x")
    figures = {name: {"ours_tokens_per_s": round(statistics.median(r["ours"])),
                      "raw_tokens_per_s": round(statistics.median(r["raw"])),
                      "floor_tokens_per_s": round(statistics.median(r["floor"])),
                      "ratio": round(statistics.median(r["ratios"]), 2),
                      "floor_ratio": round(statistics.median(r["floor_ratios"]), 2),
                      "uvicorn_tokens_per_s": round(statistics.median(r["uvicorn"])),
                      "uvicorn_ratio": round(statistics.median(r["uvicorn_ratios"]), 2),
                      "service_cpu_ms_per_batch": round(statistics.median(c.service_s for c in r["cpu"]) * 1e3, 2),
                      "writers_cpu_ms_per_batch": round(statistics.median(c.writers_s for c in r["cpu"]) * 1e3, 2),
                      "cpu_bound_ratio": round(statistics.median(r["bounds"]), 2),
                      "service_cpu_s_per_gb": round(statistics.median(r["cpu_per_gb"]), 2),
                      "raw_cpu_s_per_gb": round(statistics.median(r["raw_cpu_per_gb"]), 2),
                      "uvicorn_cpu_s_per_gb": round(statistics.median(r["uvicorn_cpu_per_gb"]), 2),
                      "per_worker_table_tokens_per_s": round(statistics.median(r["per_worker"])),
                      "shared_vs_per_worker_table": round(statistics.median(r["table_ratios"]), 2)}
               for name, r in results.items()}
    print(json.dumps({"workers": workers, **figures, "json_tokens_per_s": round(json_tps),
                      "arrow_vs_json": round(large_tps / json_tps, 1)}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
