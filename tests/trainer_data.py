"""Shared set-up for the trainer tests: a run of finished requests with known routes."""

from __future__ import annotations

import numpy as np

from replay_service.client import ReplayClient
from tests.routes_data import QWEN3_SHAPE, batch_bytes, routes


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
    assert answer["stored"]
    for rid, tokens in lengths.items():
        client.finish(run, rid, tokens)
    return full
