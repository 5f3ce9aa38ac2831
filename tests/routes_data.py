"""Deterministic routing rows for tests: distinct top-k per layer, realistic skew."""

from __future__ import annotations

import numpy as np

from replay_schema import BatchMeta, RunShape, build_batch, encode_stream

QWEN3_SHAPE = RunShape(num_layers=48, top_k=8, num_experts=128)


def routes(rng: np.random.Generator, n: int, shape: RunShape = QWEN3_SHAPE) -> np.ndarray:
    """`(n, L, K)` ids, distinct within each layer's top-k."""
    keys = rng.random((n, shape.num_layers, shape.num_experts), dtype=np.float32)
    return np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)


def batch_bytes(run_id, writer_id, seq, request_ids, positions, experts, shape=QWEN3_SHAPE, token_ids=None, flags=None) -> bytes:
    meta = BatchMeta(run_id, writer_id, seq, shape)
    return encode_stream(build_batch(meta, request_ids, positions, experts, token_ids=token_ids, flags=flags))


_POOL: dict = {}


def many_routes(rng: np.random.Generator, n: int, shape: RunShape = QWEN3_SHAPE) -> np.ndarray:
    """Like `routes`, fast for bulk data: a cached pool relabelled by a random expert permutation."""
    key = (n, shape)
    if key not in _POOL:
        _POOL[key] = routes(np.random.default_rng(12345), n, shape)
    relabel = rng.permutation(shape.num_experts).astype(shape.dtype)
    return relabel[_POOL[key][rng.permutation(n)]]
