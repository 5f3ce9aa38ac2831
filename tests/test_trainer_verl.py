"""verl's dense layout: left-padded prompts, right-padded responses, a route as long as the input or one short."""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient, ReplayError
from tests.support.data import QWEN3_SHAPE, store_requests

torch = pytest.importorskip("torch")

L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts
# request: (prompt tokens, response tokens)
SHAPES = {"v-a": (5, 7), "v-b": (12, 3), "v-c": (1, 16)}


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "vl", {r: p + g for r, (p, g) in SHAPES.items()}, seed=13)
    return client, full


def test_dense_batch_places_prompts_left_padded_and_responses_right_padded(stored):
    client, full = stored
    order = ["v-a", "v-b", "v-c"]
    pw, rw = 12, 16
    batch = client.verl_batch([("vl", r) for r in order], prompt_lengths=[SHAPES[r][0] for r in order],
                              prompt_width=pw, response_width=rw)
    dense, mask, attention = batch.dense(), batch.mask(), batch.attention_mask()
    assert dense.shape == (3, pw + rw, L, K) and mask.shape == (3, pw + rw) and mask.dtype == torch.bool
    for b, r in enumerate(order):
        p, g = SHAPES[r]
        first = pw - p  # left padding of the prompt
        want_attention = np.zeros(pw + rw, bool)
        want_attention[first : pw + g] = True
        assert np.array_equal(attention[b].numpy(), want_attention)
        want_mask = want_attention.copy()
        want_mask[pw + g - 1] = False  # the last token never ran through the model: no row
        assert np.array_equal(mask[b].numpy(), want_mask)
        assert np.array_equal(dense[b, first : pw + g - 1].numpy(), full[r])
        # every slot, padding included, is router-valid: distinct ids in range, never all zero
        d = np.sort(dense[b].numpy(), axis=-1)
        assert (d[..., 1:] != d[..., :-1]).all() and d.max() < E and d.reshape(pw + rw, -1).any(axis=1).all()


def test_route_as_long_as_the_input_fills_every_token(stored):
    client, full = stored
    # the trainer feeds one token less than the request: all fed tokens have rows
    batch = client.verl_batch([{"run": "vl", "request": "v-a", "num_tokens": 11}], prompt_lengths=[5],
                              prompt_width=5, response_width=6)
    assert batch.mask().all() and np.array_equal(batch.dense()[0].numpy(), full["v-a"])


def test_lengths_off_by_more_than_one_are_refused(stored):
    client, _ = stored
    with pytest.raises(ReplayError) as err:
        client.verl_batch([{"run": "vl", "request": "v-b", "num_tokens": 13}], prompt_lengths=[12],
                          prompt_width=12, response_width=4)
    assert err.value.status == 422 and "one short" in err.value.detail
    with pytest.raises(ReplayError) as err:
        client.verl_batch([("vl", "v-b")], prompt_lengths=[12], prompt_width=8, response_width=4)
    assert err.value.status == 422 and "prompt_width" in err.value.detail
    with pytest.raises(ReplayError) as err:
        client.verl_batch([("vl", "v-b")], prompt_lengths=[12], prompt_width=12, response_width=2)
    assert err.value.status == 422 and "response_width" in err.value.detail
