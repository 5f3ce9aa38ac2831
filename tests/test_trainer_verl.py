"""verl's dense layout: left-padded prompts, right-padded responses, a route as long as the input or one short."""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient, ReplayError
from replay_format import RunShape
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


def test_model_axis_gives_vllms_layer_layout_for_verl(shared_service):
    """verl indexes by `layer_number - 1` when the batch has all `num_layers` layers: vLLM's layout, dense zero."""
    client = ReplayClient(shared_service.url)
    shape = RunShape(num_moe_layers=3, top_k=2, num_experts=8, moe_layers=(1, 2, 4), num_hidden_layers=5)
    full = store_requests(client, "vl-axis", {"va-a": 9, "va-b": 4}, shape=shape, seed=17)
    batch = client.verl_batch([("vl-axis", "va-a"), ("vl-axis", "va-b")], prompt_lengths=[3, 2], prompt_width=4,
                              response_width=7, layer_axis="model")
    dense, mask = batch.dense(), batch.mask()
    assert dense.shape == (2, 11, 5, 2) and batch.layers == [0, 1, 2, 3, 4]
    assert np.array_equal(dense[0, 1:9].numpy(), shape.to_model_axis(full["va-a"]))  # byte-equal to vLLM's
    assert np.array_equal(dense[1, 2:5].numpy(), shape.to_model_axis(full["va-b"]))
    assert not dense[:, :, [0, 3]].any() and mask.sum() == 8 + 3


def test_a_flagged_row_is_refused_unless_the_policy_says_what_to_do(shared_service):
    client = ReplayClient(shared_service.url)
    store_requests(client, "vl-flag", {"vf-a": 10}, flagged={"vf-a": [4]})
    seqs, kw = [("vl-flag", "vf-a")], dict(prompt_lengths=[3], prompt_width=3, response_width=7)
    with pytest.raises(ReplayError) as err:
        client.verl_batch(seqs, **kw)
    assert err.value.status == 409 and "position 4" in err.value.detail
    routed = client.verl_batch(seqs, missing="router", **kw)
    assert routed.dense_replay_mask()[0].tolist() == [i != 4 for i in range(10)]
    assert routed.mask()[0, 4].item() is False and routed.replay_data()[0][4].eq(-1).all()
