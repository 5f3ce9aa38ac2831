"""One route at a time: `GET /v1/runs/{run}/requests/{request}/routes` through a real server, against the files.

N requests of 4096 rows (48 x top-8 uint8 ids, 384 bytes a row), read one request per call,
each into one numpy array:
  - `ReplayClient.get_route` (Arrow route answer, views of the received body),
  - `ReplayClient.get_route_npy` (.npy answer),
  - plain httpx, as a script would write it: `httpx.Client.get(url).content` then
    `pa.ipc.open_stream` / `np.load` (Arrow and .npy).
Baseline in the same run: one process memory-maps the store's segment files itself (warm page
cache) and copies the same requests' rows into one array (no HTTP, no checks): `bench/fetch.py`'s
`read_files_directly`. Every path is checked byte-equal to it.

Each round runs every path once, in turn (a load spike hits all of them alike); the medians of
the rounds, their spread (min-max) and the ratio to the baseline are printed. Asserts no time.

    python bench/route_get.py [--requests 32] [--rows 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/route_get.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np
import pyarrow as pa

from bench.fetch import SHAPE, print_rows_table, read_files_directly, timed_rounds
from replay_client import ReplayClient
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.ops.demo import bulk_routes
from tests.support.service import ServiceProcess


def load_store(client: ReplayClient, requests: list[str], rows: int) -> None:
    """The requests' rows, 8 requests per ingest batch (as a sender ships them), each then finished."""
    ids = bulk_routes(rows * len(requests), 0, SHAPE)
    per_batch = 8
    for seq, lo in enumerate(range(0, len(requests), per_batch)):
        chunk = requests[lo : lo + per_batch]
        at = lo * rows
        batch = build_rows(RowsMeta("bench", "w", seq, SHAPE), [r for r in chunk for _ in range(rows)],
                           np.tile(np.arange(rows, dtype=np.int32), len(chunk)), ids[at : at + len(chunk) * rows])
        client.ingest(encode_stream(batch))
    for r in requests:
        client.finish("bench", r, rows + 1)


def paths(url: str, client: ReplayClient, plain: httpx.Client,
          requests: list[str]) -> dict[str, Callable[[], list[np.ndarray]]]:
    """Each way of reading every request, one GET per request, as `(rows, L, K)` arrays."""

    def route_url(rid: str) -> str:
        return f"{url}/v1/runs/bench/requests/{rid}/routes"

    def plain_arrow() -> list[np.ndarray]:
        out = []
        for rid in requests:
            table = pa.ipc.open_stream(plain.get(route_url(rid)).content).read_all()
            ids = table.column("experts").combine_chunks().flatten().to_numpy()
            out.append(ids.reshape(table.num_rows, SHAPE.num_moe_layers, SHAPE.top_k))
        return out

    def plain_npy() -> list[np.ndarray]:
        return [np.load(io.BytesIO(plain.get(route_url(rid), params={"format": "npy"}).content)) for rid in requests]

    return {
        "client get_route (Arrow)": lambda: [client.get_route("bench", rid).experts for rid in requests],
        "client get_route_npy": lambda: [client.get_route_npy("bench", rid) for rid in requests],
        "plain httpx, Arrow": plain_arrow,
        "plain httpx, .npy": plain_npy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4096, help="rows per request")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    requests = [f"r{i:03d}" for i in range(args.requests)]
    total_rows = args.requests * args.rows
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc, ReplayClient(proc.url) as client, \
                httpx.Client(timeout=60) as plain:
            load_store(client, requests, args.rows)
            ways = {"direct segment files, one process": lambda: [read_files_directly(data, requests)],
                    **paths(proc.url, client, plain, requests)}
            expected = read_files_directly(data, requests).numpy()
            for name, way in ways.items():  # warm (page cache, segment cache, connections) and check bytes
                got = np.concatenate(way())
                assert np.array_equal(got, expected), f"{name}: not the rows sent"
            load = os.getloadavg()[0]
            times = timed_rounds(ways, args.rounds)
            load_after = os.getloadavg()[0]

    print(f"GET one route at a time: {args.requests} requests x {args.rows} rows, {SHAPE.num_moe_layers} x top-"
          f"{SHAPE.top_k} uint8 ({total_rows * SHAPE.row_width / 1e6:.0f} MB); {args.rounds} rounds, "
          f"1-min load {load:.2f} -> {load_after:.2f}")
    summary = print_rows_table(times, total_rows, "direct segment files, one process")
    print(json.dumps(summary | {"load_1min": round(load, 2)}))


if __name__ == "__main__":
    main()
