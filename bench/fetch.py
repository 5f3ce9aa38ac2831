"""Training-batch fetch through a real server into a torch tensor, against reading the segment files directly.

A training batch: 64 requests x 8192 tokens (8191 recorded rows each), 48 x 8 uint8 rows, each
path read into one `[rows, 48, 8]` torch tensor:
  - `ReplayClient.megatron_batch` (POST /v1/trainer/megatron, THD packing, no CP/SP: the whole
    batch on one rank, so the most bytes): every row checked by the server (flags), laid out in
    Megatron's token order, filler for the last token of each sequence (64 rows more);
  - `ReplayClient.get_routes` (POST /v1/runs/{run}/routes/batch);
  - plain httpx, the batch read into one buffer as docs/guides/http_api.md's recipe says.
Baseline in the same run: one process memory-maps the store's segment files itself (warm page
cache), picks the same requests' rows and copies them into one torch tensor (same rows, same
dtype, one array): no HTTP, no checks, no layout. Every path is checked byte-equal to it.
Each round runs every path once, in turn (a load spike hits all of them alike); the medians of
the rounds, their spread (min-max) and the ratio to the baseline are printed. The int64
conversion `RouterReplay.set_replay_data` needs (`TrainerBatch.replay_data()`) is timed
apart: it is the same on both sides. Asserts no time (shared, noisy machines).

    python bench/fetch.py [--requests 64] [--tokens 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/fetch.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import pyarrow as pa
import torch

from bench.segment_files import SHAPE, load_store, segment_rows
from bench.stopping import exit_on_sigterm
from replay_client import ReplayClient
from tests.support.service import ServiceProcess


def read_files_directly(data_dir: Path, requests: list[str]) -> torch.Tensor:
    """The baseline: every segment file memory-mapped, the requests' rows copied into one tensor in order."""
    return torch.from_numpy(segment_rows(data_dir, requests))


def plain_batch(url: str, requests: list[str]) -> torch.Tensor:
    """The batch read as a script would write it with httpx alone, read into one buffer (the recipe in
    docs/guides/http_api.md)."""
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/runs/bench/routes/batch",
                                                         json={"requests": requests}) as answer:
        answer.raise_for_status()
        body = bytearray(int(answer.headers["content-length"]))
        view, at = memoryview(body), 0
        for chunk in answer.iter_raw(1 << 20):
            view[at : at + len(chunk)] = chunk
            at += len(chunk)
    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()  # Arrow's arrays view `body` read-only
    ids = table.column("experts").combine_chunks().flatten().to_numpy()
    with warnings.catch_warnings():  # torch warns of the read-only view; nothing writes to it here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(ids.reshape(table.num_rows, SHAPE.num_moe_layers, SHAPE.top_k))


def timed_rounds(ways: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each way; every round runs each way once, in turn (a load spike hits all alike)."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times.setdefault(name, []).append(time.perf_counter() - started)
    return times


def print_rows_table(times: dict[str, list[float]], total_rows: int, base_name: str) -> dict[str, float]:
    """Each way's median, rows/s, spread and ratio to `base_name`'s median; returns rows/s per way."""
    base = statistics.median(times[base_name])
    print(f"  {'path':36s} {'median':>8s} {'M rows/s':>9s} {'spread (min-max)':>18s} {'ratio':>6s}")
    summary: dict[str, float] = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        summary[name] = round(total_rows / med)
        print(f"  {name:36s} {med:7.3f}s {total_rows / med / 1e6:9.2f} {min(ts):8.3f}-{max(ts):.3f}s "
              f"{base / med:6.2f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request (rows = tokens - 1)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = args.tokens - 1
    total_rows = args.requests * rows
    requests = [f"r{i:03d}" for i in range(args.requests)]
    seqs = [("bench", r) for r in requests]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        # fsync off: this measures reads, and the set-up should not take minutes
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc, ReplayClient(proc.url) as client:
            load_store(client, requests, rows)
            ways = {
                "direct segment files, one process": lambda: read_files_directly(data, requests),
                # the recorded rows of the THD slice (it adds one filler row per sequence: its last token)
                "client megatron_batch (THD)": lambda: client.megatron_batch(seqs, packing="thd").torch(),
                "client get_routes (batch)": lambda: torch.cat([r.torch() for r in client.get_routes("bench",
                                                                                                      requests)]),
                "plain httpx, batch, one buffer": lambda: plain_batch(proc.url, requests),
            }
            expected = read_files_directly(data, requests)
            for name, way in ways.items():  # warm (page cache, segment cache, connections) and check bytes
                got = way()
                if name.startswith("client megatron"):
                    valid = torch.from_numpy(client.megatron_batch(seqs, packing="thd").valid.astype(bool))
                    got = got[valid]
                assert torch.equal(got, expected), f"{name}: not the rows sent"
                del got
            load = os.getloadavg()[0]
            times = timed_rounds(ways, args.rounds)
            load_after = os.getloadavg()[0]
            batch = client.megatron_batch(seqs, packing="thd")
            int64 = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                batch.replay_data()
                int64.append(time.perf_counter() - started)

    print(f"fetch a training batch: {args.requests} requests x {args.tokens} tokens ({total_rows} recorded rows), "
          f"{SHAPE.num_moe_layers} x top-{SHAPE.top_k} uint8 ({total_rows * SHAPE.row_width / 1e6:.0f} MB), into "
          f"one torch tensor; {args.rounds} rounds, 1-min load {load:.2f} -> {load_after:.2f}")
    summary = print_rows_table(times, total_rows, "direct segment files, one process")
    med = statistics.median(int64)
    print(f"  + int64 list for RouterReplay.set_replay_data (same on both sides, not in the ratio): {med:.3f} s")
    print(json.dumps(summary | {"load_1min": round(load, 2)}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
