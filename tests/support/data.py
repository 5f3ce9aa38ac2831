"""Deterministic routing data for tests: rows, batches, and a run of finished requests with known routes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream

if TYPE_CHECKING:
    from replay_client.client import ReplayClient

QWEN3_SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)


def routes(rng: np.random.Generator, n: int, shape: RunShape = QWEN3_SHAPE) -> np.ndarray:
    """`(n, L, K)` ids, distinct within each layer's top-k."""
    keys = rng.random((n, shape.num_moe_layers, shape.num_experts), dtype=np.float32)
    return np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)


def skewed_routes(rng: np.random.Generator, n: int, shape: RunShape = QWEN3_SHAPE) -> np.ndarray:
    """`(n, L, K)` distinct ids per layer, drawn from a Zipf-like popularity per layer (a few hot experts, as
    routers show; each layer its own), in the order of their draws."""
    popularity = np.stack([np.log(1.0 / np.arange(1, shape.num_experts + 1))[rng.permutation(shape.num_experts)]
                           for _ in range(shape.num_moe_layers)])
    keys = popularity + rng.gumbel(size=(n, shape.num_moe_layers, shape.num_experts))
    return np.argpartition(-keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)


def batch_bytes(run_id, writer_id, seq, request_ids, positions, experts, shape=QWEN3_SHAPE, token_ids=None,
                flags=None) -> bytes:
    """One row batch as an Arrow IPC stream body."""
    meta = RowsMeta(run_id, writer_id, seq, shape)
    return encode_stream(build_rows(meta, request_ids, positions, experts, token_ids=token_ids, flags=flags))


_POOL: dict = {}


def many_routes(rng: np.random.Generator, n: int, shape: RunShape = QWEN3_SHAPE) -> np.ndarray:
    """Like `routes`, fast for bulk data: a cached pool relabelled by a random expert permutation."""
    key = (n, shape)
    if key not in _POOL:
        _POOL[key] = routes(np.random.default_rng(12345), n, shape)
    relabel = rng.permutation(shape.num_experts).astype(shape.dtype)
    return relabel[_POOL[key][rng.permutation(n)]]


def store_requests(client: ReplayClient, run: str, lengths: dict[str, int], seed: int = 5, shape=QWEN3_SHAPE,
                   flagged: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Requests of T tokens each (T-1 rows), finished; `flagged` plants ZERO rows at given positions."""
    rng = np.random.default_rng(seed)
    full = {}
    ids, pos, ex = [], [], []
    for rid, tokens in lengths.items():
        r = routes(rng, tokens - 1, shape)
        for p in (flagged or {}).get(rid, []):
            r[p] = 0
        full[rid] = r
        ids += [rid] * (tokens - 1)
        pos.append(np.arange(tokens - 1))
        ex.append(r)
    answer = client.ingest(batch_bytes(run, "w", 0, ids, np.concatenate(pos), np.concatenate(ex), shape=shape))
    assert answer.stored
    for rid, tokens in lengths.items():
        client.finish(run, rid, tokens)
    return full


def two_halves(run: str, lengths: dict[str, int], seed: int) -> tuple[list[bytes], dict[str, np.ndarray]]:
    """Two batches of `run` by writer "w" (every request's first half, then the rest) and each request's route."""
    rng = np.random.default_rng(seed)
    full = {rid: routes(rng, n) for rid, n in lengths.items()}
    bodies = []
    for seq in (0, 1):
        ids, pos, ex = [], [], []
        for rid, n in lengths.items():
            p = np.arange(n)[: n // 2] if seq == 0 else np.arange(n)[n // 2:]
            ids += [rid] * len(p)
            pos.append(p)
            ex.append(full[rid][p])
        bodies.append(bytes(batch_bytes(run, "w", seq, ids, np.concatenate(pos), np.concatenate(ex))))
    return bodies, full
