"""Scale-out ingest: 1, 2 and 3 replicas on one PostgreSQL index and one S3 bucket, beside today's one replica
on SQLite + local files; and what a PostgreSQL commit and an object PUT cost per batch beside the local path.

Everything is started by this script, on this machine: a throwaway PostgreSQL cluster (tests/support/postgres.py,
but with fsync ON, as a production index would run: the tests' cluster turns it off), a moto S3 server
(tests/support/s3.py: an S3 HTTP endpoint written in Python that keeps objects in memory), three
`replay-service serve` replicas sharing that database and bucket (each its own data directory, as on separate
machines) and one replica with today's default (SQLite index + local segment files, fsync on).

1. Ingest throughput. W writers (threads of this process, one connection each; writer w posts to replica
   w mod n) send 8192-row Arrow batches to /v1/ingest; every answer acknowledges durable rows. Shape: 8 MoE
   layers x top-8 uint8 (64 B/token); a DeepSeek-like shape (58 x top-8, 464 B/token) does not fit this
   machine's time and memory beside everything else. Bodies are encoded before the timed region. Each round
   runs every configuration once, in turn (a load spike hits all alike): medians of the rounds, min-max, and
   the ratio to today's path. The last configuration gives each writer its own run (3 replicas), the others
   have every writer write one run, as a training run's DP ranks do: it shows what the per-run commit lock
   costs (below). Every run's stored row count is checked through the configuration's last
   replica (with 2 and 3 replicas one that wrote only part of the run: the index is shared).
2. Per-batch cost of the store's pieces, in this process, for one 8192-row batch, through the service's own
   ingest stages (`RouteStore`'s pipeline: check, then the timed segment stage, then the timed commit stage):
   - segment: local = image built in the staging buffer, O_DIRECT write, fsync, rename; S3 = image built in
     memory, one PUT (`S3Segments.put`).
   - commit: local = the run folder's fsync + one SQLite transaction (WAL, synchronous=FULL); PostgreSQL = one
     transaction (advisory run lock, load read, duplicate and served-rows reads, inserts, COMMIT with fsync).
   Medians over rounds, min-max, and the ratio to the local path.

Where the ceiling is, on a 2-core machine: every process here shares the same two cores: the writer threads
(GIL-bound HTTP client), the replicas (each decodes, checks, CRCs and serialises every batch in Python/numpy),
PostgreSQL, and moto, a single Python process that parses and hashes every PUT body under its own GIL. More
replicas add CPU demand, not CPU, so tokens/s does not grow with replicas here (1, 2 and 3 replicas measure
within each other's spread). Each remote stage also costs several times its local counterpart per batch
(part 2: a PUT to moto against an O_DIRECT write + fsync; a PostgreSQL transaction of several loopback round
trips against an in-process SQLite commit), so one replica on PostgreSQL + S3 stores a fraction of today's
tokens/s on the same cores. The design has one more limit, which this machine does not reach: a run's commits
are serialised across replicas by its advisory lock (replay_service/store/index/backends/postgres.py) and group
commit gathers only
one replica's queued batches, so one run commits at most 1 / (transaction time) groups per second whatever the
replica count (uploads overlap: they happen before the lock); the "run per writer" configuration, which shares
no lock, measures no better here, so on 2 cores the ceiling is CPU, not that lock. What this shows is the
per-batch cost of the shared path and that replicas share one index and bucket correctly, not how far
scale-out goes: that needs replicas on their own machines, a real object store (S3, MinIO) and a PostgreSQL
server of its own.

    python bench/scale_out.py [--quick] [--rounds 3] [--tokens 393216] [--writers 6] [--piece-rounds 15]

Asserts no time (shared, noisy machines); the 1-minute load average is printed beside the figures; the last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/scale_out.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np

from bench.ingest import post_parts
from bench.stopping import exit_on_sigterm
from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape, Source
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.app import open_store
from replay_service.checks.check import check, check_stale
from replay_service.ingest.decode import decode_batch
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ops.demo import bulk_routes
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore
from tests.support.postgres import Cluster
from tests.support.s3 import MotoS3
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=8, top_k=8, num_experts=64)
BATCH_ROWS = 8192
REQUEST_TOKENS = 1024  # rows per request: 8 requests per batch, none shared between batches
HEADERS = {"content-type": ARROW_STREAM_MEDIA_TYPE}
TODAY = "1 replica, SQLite + local files"


class DurableCluster(Cluster):
    """The tests' throwaway cluster, but fsyncing its WAL (the tests turn fsync off; a production index keeps it)."""

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200", "start")


@dataclass
class Config:
    """One measured configuration: the replicas its writers post to."""

    name: str
    key: str  # run id prefix
    urls: list[str]
    run_per_writer: bool = False  # each writer its own run (no two replicas commit the same run)

    def run_ids(self, prefix: str, writers: int) -> list[str]:
        """The run id each writer writes."""
        return [f"{prefix}-w{w}" if self.run_per_writer else prefix for w in range(writers)]


def batch_body(ids: np.ndarray, run_id: str, writer: str, seq: int, first_request: int) -> bytes:
    """One encoded 8192-row batch: requests of REQUEST_TOKENS rows numbered from `first_request`."""
    n = len(ids)
    request_ids = [f"r{first_request + i // REQUEST_TOKENS}" for i in range(n)]
    positions = (np.arange(n) % REQUEST_TOKENS).astype(np.int32)
    return encode_stream(build_rows(RowsMeta(run_id, writer, seq, SHAPE, source=Source.VLLM_PLUGIN), request_ids,
                                    positions, ids))


def round_jobs(ids: np.ndarray, run_ids: list[str]) -> list[list[bytes]]:
    """Each writer's encoded bodies of one round (batch i by writer w = i mod W into run_ids[w], seq i)."""
    writers = len(run_ids)
    jobs: list[list[bytes]] = [[] for _ in range(writers)]
    per_batch = BATCH_ROWS // REQUEST_TOKENS
    for seq, lo in enumerate(range(0, len(ids), BATCH_ROWS)):
        w = seq % writers
        jobs[w].append(batch_body(ids[lo : lo + BATCH_ROWS], run_ids[w], f"w{w}", seq, seq * per_batch))
    return jobs


def post_all(urls: list[str], jobs: list[list[bytes]]) -> float:
    """Writer w posts its bodies to urls[w mod n], all writers at once; seconds until the last answer."""
    return post_parts(urls, [[("/v1/ingest", body, HEADERS) for body in bodies] for bodies in jobs])


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """`median (min-max)` of `values` times `scale`."""
    return (f"{statistics.median(values) * scale:.{digits}f} ({min(values) * scale:.{digits}f}-"
            f"{max(values) * scale:.{digits}f})")


def measure_ingest(configs: list[Config], ids: np.ndarray, writers: int, rounds: int,
                   warmup: int) -> dict[str, list[float]]:
    """Seconds per round of each configuration; each round runs every configuration once, in turn."""
    for config in configs:  # connections, buffers, pools and caches warm, as in a long-running service
        post_all(config.urls, round_jobs(ids[: warmup * BATCH_ROWS], config.run_ids(f"warmup-{config.key}",
                                                                                     writers)))
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    for r in range(rounds):
        for config in configs:
            run_ids = config.run_ids(f"{config.key}-{r}", writers)
            jobs = round_jobs(ids, run_ids)  # encoded before the timed region
            times[config.name].append(post_all(config.urls, jobs))
            stored = sum(httpx.get(f"{config.urls[-1]}/v1/runs/{run_id}", timeout=60).json()["rows"]
                         for run_id in sorted(set(run_ids)))
            assert stored == len(ids), (config.name, stored)
    return times


def measure_pieces(stores: dict[str, RouteStore], ids: np.ndarray, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds of the segment stage and of the commit stage for one batch, per store, `rounds` times in turn.

    The first two batches per store are untimed (connections, pools, the run's creation).
    """
    times: dict[str, dict[str, list[float]]] = {name: {"segment": [], "commit": [], "feed": []} for name in stores}
    pipes = {name: IngestPipeline.over(store) for name, store in stores.items()}
    for r in range(rounds + 2):
        for name in stores:
            rows = decode_batch(ARROW_STREAM_MEDIA_TYPE, batch_body(ids, "pieces", "w0", r, r * 8))
            pipe = pipes[name]
            run = pipe.runs.for_batch(rows.meta)
            checked = check(rows, run.shape)
            started = time.perf_counter()
            segment = pipe.segments.write(checked)
            written = time.perf_counter()
            result = pipe.committer.commit(segment, run)
            done = time.perf_counter()
            assert result.stored, result
            fed = 0.0
            if pipe.feed is not None:  # replicas: the STALE feed's round for this batch (publish, learn), in turn
                remembered = check_stale(checked, pipe.recent)
                feed_start = time.perf_counter()
                pipe.feed.note(remembered.hashes, remembered.requests, remembered.positions, remembered.tokens)
                pipe.feed.step()
                fed = time.perf_counter() - feed_start
            if r >= 2:
                times[name]["segment"].append(written - started)
                times[name]["commit"].append(done - written)
                times[name]["feed"].append(fed)
    for pipe in pipes.values():
        pipe.close()
    return times


def print_ingest(args: argparse.Namespace, times: dict[str, list[float]], load: tuple[float, float, float],
                 load_after: tuple[float, float, float]) -> dict[str, float]:
    """Part 1's table (printed at once: part 2 may still fail); tokens/s per configuration."""
    print(f"scale-out ingest: {SHAPE.num_moe_layers} MoE layers x top-{SHAPE.top_k} uint8 ({SHAPE.row_width} B/token),"
          f" {BATCH_ROWS}-row batches, {args.writers} writers, {args.tokens} tokens per round, fsync on everywhere;"
          f" medians of {args.rounds} rounds (min-max); load avg 1/5/15 min {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
          f" -> {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; {os.cpu_count()} cores shared by all")
    base = statistics.median(times[TODAY])
    print(f"  {'configuration':42s} {'M tok/s (min-max)':>22s} {'s/round':>8s} {'ratio':>6s}")
    figures: dict[str, float] = {}
    for name, ts in times.items():
        rates = [args.tokens / t for t in ts]
        figures[name] = round(statistics.median(rates))
        print(f"  {name:42s} {spread(rates, 1e-6):>22s} {statistics.median(ts):8.3f} "
              f"{base / statistics.median(ts):6.2f}")
    sys.stdout.flush()
    return figures


def print_pieces(rounds: int, times: dict[str, dict[str, list[float]]], load: float,
                 load_after: float) -> dict[str, float]:
    """Part 2's table; the median milliseconds per stage and store."""
    figures: dict[str, float] = {}
    print(f"per batch ({BATCH_ROWS} rows, {BATCH_ROWS * SHAPE.row_width // 1024} KiB), the store's stages in one "
          f"process, ms, medians of {rounds} rounds (min-max); load 1-min {load:.2f} -> {load_after:.2f}")
    local, remote = times["SQLite + local files"], times["PostgreSQL + S3 (moto)"]
    rows = [("segment: local write+fsync+rename / S3 PUT", "segment"), ("commit: SQLite (+folder fsync) / PostgreSQL",
                                                                          "commit")]
    print(f"  {'stage':44s} {'SQLite + local files':>24s} {'PostgreSQL + S3 (moto)':>24s} {'ratio':>6s}")
    feed = statistics.median(remote["feed"])
    print(f"  {'STALE feed: publish + learn (replicas only)':44s} {'-':>24s} {spread(remote['feed'], 1e3):>24s} "
          f"{feed / statistics.median(remote['commit']):6.2f} of the PostgreSQL commit")
    figures["stale_feed_ms"] = round(feed * 1e3, 2)
    for label, key in rows:
        ratio = statistics.median(remote[key]) / statistics.median(local[key])
        print(f"  {label:44s} {spread(local[key], 1e3):>24s} {spread(remote[key], 1e3):>24s} {ratio:6.2f}")
        figures[f"{key}_ms_local"] = round(statistics.median(local[key]) * 1e3, 2)
        figures[f"{key}_ms_remote"] = round(statistics.median(remote[key]) * 1e3, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a shared 2-core machine): 2 rounds of "
                        "98304 tokens, 4 writers, 8 piece rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48 * BATCH_ROWS, help="tokens per round (8192-row batches)")
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--warmup-batches", type=int, default=6)
    parser.add_argument("--piece-rounds", type=int, default=15)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.writers, args.warmup_batches, args.piece_rounds = 2, 12 * BATCH_ROWS, 4, 4, 8
    ids = bulk_routes(args.tokens, 0, SHAPE)

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp_name:
        tmp = Path(tmp_name)
        s3 = MotoS3().start()
        cluster = DurableCluster()
        try:
            bucket = s3.bucket()
            shared = {"REPLAY_INDEX_URL": cluster.new_database("bench"), **s3.env(bucket, "replicas")}
            replicas = [ServiceProcess(tmp / f"replica{i}" / "data", env=shared) for i in range(3)]
            today = ServiceProcess(tmp / "local" / "data")
            procs = [today, *replicas]
            try:
                for proc in procs:
                    proc.data_dir.parent.mkdir(parents=True)  # its log lies beside its data directory
                    proc.start()
                configs = [Config(TODAY, "local", [today.url])] + [
                    Config(f"{n} replica{'s' if n > 1 else ''}, PostgreSQL + S3 (moto)", f"pg{n}",
                           [p.url for p in replicas[:n]]) for n in (1, 2, 3)] + [
                    Config("3 replicas, PG + S3, a run per writer", "pg3runs", [p.url for p in replicas],
                           run_per_writer=True)]
                load = os.getloadavg()
                ingest_times = measure_ingest(configs, ids, args.writers, args.rounds, args.warmup_batches)
                load_ingest = os.getloadavg()
            finally:
                for proc in procs:
                    proc.stop()
            figures = print_ingest(args, ingest_times, load, load_ingest)

            os.environ.update(s3.aws_env())  # this process's own S3 store (part 2) reads the AWS variables
            stores = {"SQLite + local files": open_store(ServiceSettings(data_dir=tmp / "pieces-local")),
                      "PostgreSQL + S3 (moto)": open_store(ServiceSettings(
                          data_dir=tmp / "pieces-remote", index_url=cluster.new_database("pieces"),
                          segments_url=f"s3://{bucket}/pieces"))}
            try:
                load_pieces = os.getloadavg()
                piece_times = measure_pieces(stores, ids[:BATCH_ROWS], args.piece_rounds)
                load_pieces_after = os.getloadavg()
            finally:
                for store in stores.values():
                    store.close()
        finally:
            cluster.close()
            s3.stop()
    figures |= print_pieces(args.piece_rounds, piece_times, load_pieces[0], load_pieces_after[0])
    print(json.dumps(figures | {"load_1min": round(load[0], 2), "cores": os.cpu_count()}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
