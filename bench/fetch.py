"""Training-batch fetch through a real server into a torch tensor, against reading the Arrow files directly.

A training batch: 64 requests x 8192 tokens (8191 recorded rows each), 48 x 8 uint8 rows.
Ours: `ReplayClient.megatron_batch` (POST /v1/trainer/megatron, THD packing, no CP/SP:
the whole batch on one rank, so the most bytes) into a `[tokens, 48, 8]` torch tensor,
every row checked by the server (flags) and laid out in Megatron's token order, filler
for the last token of each sequence. Also `get_routes` (POST /v1/runs/{run}/routes/batch).
Baseline in the same run: one process opens the store's segment files itself (memory-mapped
Arrow IPC, warm page cache), picks the same requests' rows and copies them into one torch
tensor: no HTTP, no checks, no layout. The int64 conversion `RouterReplay.set_replay_data`
needs (`TrainerBatch.replay_data()`) is timed separately: it is the same on both sides.
Prints tokens/s and the ratio; asserts nothing (shared, noisy machines).

    python bench/fetch.py [--requests 64] [--tokens 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/fetch.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import numpy as np
import pyarrow as pa
import torch

from replay_client import ReplayClient
from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.demo import bulk_routes
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return min(times), (out, statistics.median(times))


def read_files_directly(data_dir: Path, requests: list[str]) -> torch.Tensor:
    """The baseline: every segment file memory-mapped, the requests' rows copied into one tensor in order."""
    wanted = {r: i for i, r in enumerate(requests)}
    pieces: list[list] = [[] for _ in requests]
    for path in sorted((data_dir / "runs" / "bench").glob("*.arrow")):
        batch = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)
        req = batch.column("request_id")
        names = req.dictionary.to_pylist()
        index = req.indices.to_numpy()
        positions = batch.column("position").to_numpy()
        experts = batch.column("experts").flatten().to_numpy()
        experts = experts.reshape(batch.num_rows, SHAPE.num_moe_layers, SHAPE.top_k)
        for k, name in enumerate(names):
            if name in wanted:
                rows = np.flatnonzero(index == k)
                pieces[wanted[name]].append((positions[rows], experts[rows]))
    total = sum(len(p) for parts in pieces for p, _ in parts)
    out = torch.empty((total, SHAPE.num_moe_layers, SHAPE.top_k), dtype=torch.uint8)
    view = out.numpy()
    at = 0
    for parts in pieces:
        for positions, experts in parts:
            view[at : at + len(positions)] = experts[np.argsort(positions, kind="stable")]
            at += len(positions)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request (rows = tokens - 1)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = args.tokens - 1
    requests = [f"r{i:03d}" for i in range(args.requests)]
    ids = bulk_routes(rows * args.requests, 0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        # fsync off: this measures reads, and the set-up should not take minutes
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc:
            client = ReplayClient(proc.url)
            per_batch = 8  # requests per ingest batch: 8 x 8191 rows, as a sender would ship them
            for seq, lo in enumerate(range(0, args.requests, per_batch)):
                chunk = requests[lo : lo + per_batch]
                meta = RowsMeta("bench", "w", seq, SHAPE)
                at = lo * rows
                body = encode_stream(build_rows(meta, [r for r in chunk for _ in range(rows)],
                                                 np.tile(np.arange(rows, dtype=np.int32), len(chunk)),
                                                 ids[at : at + len(chunk) * rows]))
                client.ingest(body)
            for r in requests:
                client.finish("bench", r, args.tokens)
            seqs = [("bench", r) for r in requests]

            def via_megatron():
                return client.megatron_batch(seqs, packing="thd").torch()

            def via_batch_routes():
                routes = client.get_routes("bench", requests)
                return torch.cat([torch.from_numpy(r.experts) for r in routes])

            via_megatron()  # warm: page cache, segment cache, connection
            t_mega, (mega, mega_med) = best(via_megatron, args.repeat)
            t_routes, (routed, routes_med) = best(via_batch_routes, args.repeat)
            batch = client.megatron_batch(seqs, packing="thd")
            t_int64, _ = best(batch.replay_data, args.repeat)
        read_files_directly(data, requests)  # warm
        t_files, (direct, files_med) = best(lambda: read_files_directly(data, requests), args.repeat)

    tokens = args.requests * args.tokens
    # the same recorded rows: the service's layout adds one filler row per sequence (the last token)
    valid = torch.from_numpy(batch.valid.astype(bool))
    assert torch.equal(mega[valid], direct) and torch.equal(routed, direct)
    rate = {
        "service_megatron": tokens / t_mega,
        "service_batch_routes": args.requests * rows / t_routes,
        "direct_arrow_files": args.requests * rows / t_files,
    }
    mb = SHAPE.row_width * tokens / 1e6
    print(f"fetch a training batch: {args.requests} requests x {args.tokens} tokens, {SHAPE.num_moe_layers} x top-"
          f"{SHAPE.top_k} uint8 ({mb:.0f} MB), into a torch tensor; best of {args.repeat}")
    print(f"  service /v1/trainer/megatron (THD) {t_mega:6.3f} s  {rate['service_megatron'] / 1e6:6.2f} M tokens/s"
          f"  (median {mega_med:.3f} s)")
    print(f"  service /v1/runs/.../routes/batch  {t_routes:6.3f} s  "
          f"{rate['service_batch_routes'] / 1e6:6.2f} M tokens/s"
          f"  (median {routes_med:.3f} s)")
    print(f"  direct Arrow files, one process    {t_files:6.3f} s  {rate['direct_arrow_files'] / 1e6:6.2f} M tokens/s"
          f"  (median {files_med:.3f} s)")
    print(f"  ratio service(megatron)/direct: {rate['service_megatron'] / rate['direct_arrow_files']:.2f}")
    print(f"  + int64 list for RouterReplay.set_replay_data: {t_int64:.3f} s ({tokens / t_int64 / 1e6:.2f} M tokens/s)")
    print(json.dumps({k: round(v) for k, v in rate.items()}
                     | {"ratio_service_over_direct": round(rate["service_megatron"] / rate["direct_arrow_files"], 3)}))


if __name__ == "__main__":
    main()
