"""What the fetch benchmarks share: a run of bulk routes loaded through a service, and the baseline that reads the
same rows straight out of the memory-mapped segment files (numpy only: rank processes fork without torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from replay_client import ReplayClient
from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.ops.demo import bulk_routes

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)
RUN = "bench"


def segment_rows(data_dir: Path, requests: list[str]) -> np.ndarray:
    """Every segment file of the run memory-mapped, the requests' rows copied into one array, in request order."""
    wanted = {r: i for i, r in enumerate(requests)}
    pieces: list[list] = [[] for _ in requests]
    for path in sorted((data_dir / "runs" / RUN).glob("*.arrow")):
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
    out = np.empty((total, SHAPE.num_moe_layers, SHAPE.top_k), dtype=np.uint8)
    at = 0
    for parts in pieces:
        for positions, experts in parts:
            out[at : at + len(positions)] = experts[np.argsort(positions, kind="stable")]
            at += len(positions)
    return out


def load_store(client: ReplayClient, requests: list[str], rows: int) -> None:
    """The requests' rows, 8 requests per ingest batch (8 x rows, as a sender would ship them), each then finished."""
    ids = bulk_routes(rows * len(requests), 0)
    per_batch = 8
    for seq, lo in enumerate(range(0, len(requests), per_batch)):
        chunk = requests[lo : lo + per_batch]
        at = lo * rows
        body = encode_stream(build_rows(RowsMeta(RUN, "w", seq, SHAPE), [r for r in chunk for _ in range(rows)],
                                        np.tile(np.arange(rows, dtype=np.int32), len(chunk)),
                                        ids[at : at + len(chunk) * rows]))
        client.ingest(body)
    for r in requests:
        client.finish(RUN, r, rows + 1)
