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
PREVIOUS = "bench-previous"  # the step before (bench/step_fetch.py): the ranks' clients fetched it already


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


def load_store(client: ReplayClient, requests: list[str], rows: int, run: str = RUN) -> None:
    """The requests' rows in `run`, 8 requests per ingest batch (8 x rows, as a sender would ship them), each then
    finished."""
    ids = bulk_routes(rows * len(requests), 0)
    per_batch = 8
    for seq, lo in enumerate(range(0, len(requests), per_batch)):
        chunk = requests[lo : lo + per_batch]
        at = lo * rows
        body = encode_stream(build_rows(RowsMeta(run, "w", seq, SHAPE), [r for r in chunk for _ in range(rows)],
                                        np.tile(np.arange(rows, dtype=np.int32), len(chunk)),
                                        ids[at : at + len(chunk) * rows]))
        client.ingest(body)
    for r in requests:
        client.finish(run, r, rows + 1)


def load_store_as_sink(clients: list[ReplayClient], requests: list[str], rows: int, prompt: int = 512,
                       batch_rows: int = 8192, run: str = RUN) -> None:
    """The requests' rows in `run` as the plugin's sink ships them from a continuously batching engine: writer w (a DP
    rank, `clients[w]`) serves `requests[w::W]` in two waves, the second admitted once the first has decoded a quarter
    of its rows; each step adds a new request's `prompt` rows (its prefill) or one decode row of each running
    request, and steps are coalesced into batches of about `batch_rows` rows (prompt and decode rows mixed, every
    running request's positions spread over many batches). Each request is finished after its last row."""
    table = bulk_routes(rows * len(requests), 0).reshape(len(requests), rows, SHAPE.num_moe_layers, SHAPE.top_k)
    for w, client in enumerate(clients):
        _SinkWriter(client, run, f"w{w}", table, {r: i for i, r in enumerate(requests)}).serve(
            requests[w :: len(clients)], rows, prompt, batch_rows)


class _SinkWriter:
    """One writer's batches: coalesced steps, shipped in order, a request's finish after its rows."""

    def __init__(self, client: ReplayClient, run: str, writer_id: str, table: np.ndarray,
                 index: dict[str, int]) -> None:
        self.client, self.run, self.writer_id, self.table, self.index = client, run, writer_id, table, index
        self.parts: list[tuple[str, int, int]] = []  # (request, first position, rows) of the batch coalescing
        self.held = self.seq = 0

    def ship(self) -> None:
        req = [r for r, _, n in self.parts for _ in range(n)]
        pos = np.concatenate([np.arange(at, at + n, dtype=np.int32) for _, at, n in self.parts])
        ids = np.concatenate([self.table[self.index[r], at : at + n] for r, at, n in self.parts])
        self.client.ingest(encode_stream(build_rows(RowsMeta(self.run, self.writer_id, self.seq, SHAPE), req, pos,
                                                         ids)))
        self.parts, self.held, self.seq = [], 0, self.seq + 1

    def serve(self, mine: list[str], rows: int, prompt: int, batch_rows: int) -> None:
        first, pending = mine[: len(mine) // 2], mine[len(mine) // 2 :]
        done = {r: 0 for r in mine}  # rows shipped per request
        running = list(first)
        while running:
            for r in running:
                n = min(prompt, rows) if done[r] == 0 else 1
                self.parts.append((r, done[r], n))
                done[r] += n
                self.held += n
            if self.held >= batch_rows:
                self.ship()
            finished = [r for r in running if done[r] >= rows]
            running = [r for r in running if done[r] < rows]
            if pending and min(done[r] for r in first) >= rows // 4:
                running, pending = running + pending, []
            if finished and self.parts:
                self.ship()  # a request's rows are sent before its finish, as the sender orders them
            for r in finished:
                self.client.finish(self.run, r, rows + 1)
