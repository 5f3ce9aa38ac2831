"""A worker builds `REPLAY_SLICE_BUILDS_PER_WORKER` trainer slices at once, the others waiting their turn.

A slice is built in a thread and holds the GIL most of the time: in one process on 2 cores, 16 warm slices cost
0.6-0.7 CPU-s per GB built one at a time and 1.1-1.5 two or eight at a time (docs/design/store.md). So a worker
builds one at a time over local segments unless told otherwise (a bucket's builds wait on its reads: 8). Here,
through a real uvicorn on loopback in this process (so the builds can be counted where they run): eight ranks asking
at once are built at most that many at a time, and each gets the slice it gets alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import replay_service.api.trainer as trainer_api
from replay_client import ReplayClient
from replay_format import RunShape
from replay_service.app import create_app
from replay_service.settings import ServiceSettings
from tests.support.data import batch_bytes, routes
from tests.support.service import served_in_thread

SHAPE = RunShape(num_moe_layers=4, top_k=2, num_experts=16)
RUN = "builds"
REQUESTS = [f"b{i}" for i in range(8)]
ROWS = 30


def test_a_worker_builds_one_slice_at_a_time_over_local_segments_and_eight_over_a_bucket():
    assert ServiceSettings().slice_builds() == 1
    assert ServiceSettings(segments_url="s3://bucket/prefix").slice_builds() == 8
    assert ServiceSettings(segments_url="s3://bucket/prefix", slice_builds_per_worker=2).slice_builds() == 2


@pytest.mark.parametrize("builds", [1, 3])
def test_ranks_asking_at_once_are_built_at_most_the_setting_at_a_time(tmp_path, monkeypatch, builds):
    running, most, started = 0, 0, 0
    counting = threading.Lock()
    together = threading.Barrier(builds, timeout=30)  # the first `builds` builds side by side, or the test fails
    real = trainer_api.read_slice

    def counted(*args):
        nonlocal running, most, started
        with counting:
            running += 1
            started += 1
            most = max(most, running)
            first = started <= builds
        try:
            if first:
                together.wait()
            time.sleep(0.05)  # the other ranks' requests arrive meanwhile: unbounded, they would be built now too
            return real(*args)
        finally:
            with counting:
                running -= 1

    app = create_app(ServiceSettings(data_dir=tmp_path / "data", fsync=False, slice_builds_per_worker=builds))
    with served_in_thread(app) as port, ReplayClient(f"http://127.0.0.1:{port}") as client:
        sent = routes(np.random.default_rng(4), len(REQUESTS) * ROWS, SHAPE)
        names = [r for r in REQUESTS for _ in range(ROWS)]
        positions = np.tile(np.arange(ROWS, dtype=np.int32), len(REQUESTS))
        assert client.ingest(batch_bytes(RUN, "w", 0, names, positions, sent, shape=SHAPE)).stored
        for r in REQUESTS:
            client.finish(RUN, r, ROWS + 1)
        seqs = [(RUN, r) for r in REQUESTS]

        def rank(cp_rank: int) -> np.ndarray:
            with ReplayClient(f"http://127.0.0.1:{port}") as own:
                return own.megatron_batch(seqs, "thd", cp_size=8, cp_rank=cp_rank, pad_multiple=16).experts

        alone = [rank(r) for r in range(8)]
        monkeypatch.setattr(trainer_api, "read_slice", counted)
        with ThreadPoolExecutor(8) as ranks:
            together_answers = list(ranks.map(rank, range(8)))
    assert most == builds
    assert all(np.array_equal(a, b) for a, b in zip(alone, together_answers, strict=True))
