"""Trainer slices of a sink-shaped step against the rows sent, through real servers.

A step stored as the plugin's sink ships it (4 writers, prompts and decodes interleaved) spreads every request over
many segments: the read locates each position's row span by span (store/requests/rows.py), with every sequence's
spans from one index query per rank, and copies each rank's ids once, straight from the segments. Every trainer
convention and layer axis must still answer, for each real token, the ids sent at its (sequence, position), and
filler with `valid == 0` for every other token: here on a service of two workers (SQLite, local segments), and on
a second replica sharing a PostgreSQL index and an S3 bucket with the replica of two workers that stored the step
(the index's one query for a rank's spans in PostgreSQL's dialect, spans read by their blocks from a bucket).
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.segment_files import RUN, SHAPE, load_store_as_sink
from bench.step_fetch import rank_query
from replay_client import ReplayClient
from replay_format.trainer_slice import TrainerSlice
from replay_service.ops.demo import bulk_routes
from tests.support.service import ServiceProcess

REQUESTS = [f"q{i:03d}" for i in range(16)]
ROWS = 255  # 256 tokens: positions 0..254 have rows, the last token none
RANKS = 8  # DP 2 x CP 2 x TP 2
PROMPT = 64  # verl: the prompt's tokens (left-padded), the rest the response


def _sent() -> np.ndarray:
    """The rows the loader sent, `(request, position, L, K)` (drawn as `load_store_as_sink` draws them)."""
    return bulk_routes(ROWS * len(REQUESTS), 0).reshape(len(REQUESTS), ROWS, SHAPE.num_moe_layers, SHAPE.top_k)


def _store(url: str) -> None:
    clients = [ReplayClient(url) for _ in range(4)]
    try:
        load_store_as_sink(clients, REQUESTS, ROWS, prompt=64, batch_rows=512)
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def sink_step(tmp_path_factory):
    """Two workers over the step."""
    env = {"REPLAY_FSYNC": "false"}
    with ServiceProcess(tmp_path_factory.mktemp("sink") / "data", workers=2, env=env) as service:
        _store(service.url)
        yield service


MEGATRON = {
    "thd": {},
    "thd slime": {"convention": "slime"},
    "thd verl": {"convention": "verl"},
    "thd without sequence parallel": {"sequence_parallel": False},
    "thd contiguous cp": {"cp_split": "contiguous"},
    "bshd": {"packing": "bshd"},
    "a pipeline stage's moe ordinals": {"moe_ordinals": [0, 7, 47]},
    "the model-layer axis": {"layer_axis": "model", "model_layer_range": [2, 20]},
}


def _check(got: TrainerSlice, names: list[str], sent: np.ndarray) -> int:
    """Every real token of `got` holds the ids sent at its (sequence, position) on the layers it holds, every other
    token is filler (`valid == 0`); the real tokens' count."""
    order = [REQUESTS.index(name) for name in names]
    real = (got.sequence >= 0) & (got.position >= 0) & (got.position < ROWS)
    assert got.valid.tolist() == real.astype(np.uint8).tolist()
    sequence, position = got.sequence[real], got.position[real]
    expected = sent[np.asarray(order)[sequence], position][:, got.moe_ordinals]
    held = [got.meta.layers.index(layer) for layer in got.moe_layers]
    assert got.experts[real][:, held].tobytes() == expected.tobytes()
    dense = [i for i in range(got.experts.shape[1]) if i not in held]
    assert not got.experts[real][:, dense].any()  # the model axis's dense layers: zero
    return int(real.sum())


def _megatron_ranks(url: str, options: dict, sent: np.ndarray) -> None:
    sequences = [(RUN, r) for r in REQUESTS]
    options = dict(options)
    packing = options.pop("packing", "thd")
    real = 0
    with ReplayClient(url) as client:
        for rank in range(RANKS):
            seqs, grid = rank_query(rank, RANKS, sequences, None)
            got = client.megatron_batch(seqs, packing=packing, **grid, **options)
            real += _check(got, [r for _, r in seqs], sent)
    assert real > 0


@pytest.mark.parametrize("options", MEGATRON.values(), ids=MEGATRON.keys())
def test_every_megatron_convention_answers_each_real_token_the_row_sent(sink_step, options):
    _megatron_ranks(sink_step.url, options, _sent())


def test_verl_s_dense_batch_answers_each_real_token_the_row_sent(sink_step):
    sent = _sent()
    seqs = [(RUN, r) for r in REQUESTS[:6]]
    with ReplayClient(sink_step.url) as client:
        got = client.verl_batch(seqs, prompt_lengths=[PROMPT] * len(seqs), prompt_width=PROMPT + 8,
                                response_width=ROWS + 1 - PROMPT + 4)
    assert _check(got, [r for _, r in seqs], sent) == len(seqs) * ROWS


def test_a_replica_serves_the_slices_of_a_step_another_stored(tmp_path, postgres, moto_s3):
    env = {"REPLAY_INDEX_URL": postgres.new_database(), **moto_s3.env(moto_s3.bucket()), "REPLAY_FSYNC": "false"}
    with ServiceProcess(tmp_path / "a", workers=2, env=env) as a, ServiceProcess(tmp_path / "b", env=env) as b:
        _store(a.url)
        sent = _sent()
        for options in ({}, {"convention": "slime"}, {"moe_ordinals": [3, 4]}):
            _megatron_ranks(b.url, options, sent)
