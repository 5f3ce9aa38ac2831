"""slime: every rank of a CP x TP grid gets exactly the rows slime's own rule gives it.

slime does not install here; its rule is restated in `tests/support/trainers.py` (`slime_rank_rows`,
citing slime/backends/megatron_utils/cp_utils.py line by line): one row for the last token, zigzag
CP per sequence (or one contiguous cut of the whole stream with `--allgather-cp`), the whole
micro-batch padded at the tail to `tp * data_pad_size_multiplier` per CP rank, SP split over TP.
slime reads `routes[:, layer_id]` by model layer (slime/backends/megatron_utils/actor.py `fill_routing_replay`), so
the rows it is given have every model layer, dense ones zero: `layer_axis="model"`.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format import RunShape
from tests.support.data import store_requests
from tests.support.trainers import batch_identity, identity_routes, slime_rank_rows, stage_model_layers

# DeepSeek-like: the first three layers dense, the rest MoE
MOE_LAYER_FREQ = [0, 0, 0, 1, 1, 1, 1, 1]
SHAPE = RunShape(num_moe_layers=5, top_k=2, num_experts=16, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)
LENGTHS = {"sl-a": 100, "sl-b": 37, "sl-c": 61}
ORDER = list(LENGTHS)


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "slime", LENGTHS, seed=21, shape=SHAPE)
    return client, full


def _slime_batch(client, order, **kw):
    return client.megatron_batch([("slime", r) for r in order], convention="slime", layer_axis="model", **kw)


def test_lengths_100_and_37_at_tp_2_give_the_128_tokens_per_rank_slime_expects(stored):
    client, full = stored
    for t in range(2):
        batch = _slime_batch(client, ["sl-a", "sl-b"], tp_size=2, tp_rank=t)
        # slime pads 100 + 37 tokens at the tail to tp * 128 = 256 and splits them over TP: 128 each
        assert batch.num_tokens == 128 and batch.layout.total_tokens == 256
        assert batch.layout.cu_seqlens == [0, 100, 137] and batch.layout.cu_seqlens_padded == [0, 100, 137]
    # verl's rule (no convention) pads every sequence to tp instead: 100 + 38 = 138, 69 per rank
    assert client.megatron_batch([("slime", "sl-a"), ("slime", "sl-b")], tp_size=2).num_tokens == 69


@pytest.mark.parametrize("cp,tp,allgather", [(1, 1, False), (1, 2, False), (2, 1, False), (2, 2, False),
                                              (2, 1, True), (2, 2, True)])
def test_every_rank_gets_slimes_rows_and_the_ranks_reassemble_the_batch(stored, cp, tp, allgather):
    client, full = stored
    # what vLLM returns per request: (T-1, num_hidden_layers, K), dense layers zero
    vllm_routes = [SHAPE.to_model_axis(full[r]) for r in ORDER]
    seen = []
    for c in range(cp):
        for t in range(tp):
            rank = dict(tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=c, allgather_cp=allgather)
            want = slime_rank_rows(vllm_routes, num_experts=SHAPE.num_experts, **rank)
            who = slime_rank_rows(identity_routes(list(LENGTHS.values())), pad_value=-1, **rank)[:, 0, 0]
            batch = _slime_batch(client, ORDER, cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t,
                                 cp_split="contiguous" if allgather else "zigzag")
            assert batch.experts.shape == want.shape  # (tokens of this rank, num_hidden_layers, K)
            assert np.array_equal(batch_identity(batch), who)  # the same token at every router position
            real = who >= 0
            assert np.array_equal(batch.experts[real], want[real])  # dense layers zero, MoE layers recorded
            assert not batch.valid[~real].any()  # slime's pad rows (and each last token): masked filler here
            seen.append(who[real])
    # every recorded row of the micro-batch is on exactly one rank
    seen_all = np.sort(np.concatenate(seen))
    assert np.array_equal(seen_all, np.sort(np.concatenate([r.reshape(-1) for r in identity_routes(
        list(LENGTHS.values()))])))


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_a_pipeline_stage_reads_its_moe_layers_by_model_layer(stored, pp_rank):
    """slime's `rollout_routed_experts[:, layer_id]`: right on the model axis, wrong on the MoE axis."""
    client, full = stored
    layers = stage_model_layers(8, MOE_LAYER_FREQ, pp_size=2, pp_rank=pp_rank)  # megatron-core's own split
    model = _slime_batch(client, ORDER, tp_size=2)
    stage = client.megatron_batch([("slime", r) for r in ORDER], convention="slime", tp_size=2,
                                  model_layer_range=(4 * pp_rank, 4 * pp_rank + 4))
    real = model.valid.astype(bool)
    by_slime = np.stack([model.experts[:, layer] for layer in layers], axis=1)  # what slime records per router
    assert stage.moe_layers == layers and np.array_equal(by_slime[real], stage.experts[real])
    assert len(stage.replay_data()) == len(layers) and len(model.replay_data()) == SHAPE.num_moe_layers
    # the same indexing on MoE-axis rows (what the service served before) replays other layers, or none
    moe = client.megatron_batch([("slime", r) for r in ORDER], convention="slime", tp_size=2)
    wrong = [layer for layer in layers if layer >= moe.experts.shape[1]
             or not np.array_equal(moe.experts[real, layer], stage.experts[real, layers.index(layer)])]
    assert wrong == layers


def test_data_pad_size_multiplier_and_wrong_knobs(stored):
    client, _ = stored
    batch = _slime_batch(client, ORDER, tp_size=2, data_pad_size_multiplier=4)
    assert batch.layout.total_tokens == 200 and batch.num_tokens == 100  # 198 tokens up to a multiple of 8
    cases = [
        ({"convention": "slime", "pad_multiple": 4}, "fixes pad_multiple"),
        ({"convention": "slime", "fp8_padding": True}, "fp8_padding is verl's knob"),
        ({"convention": "verl", "data_pad_size_multiplier": 64}, "slime's and miles's knob"),
        ({"data_pad_size_multiplier": 64}, "give convention too"),
        ({"convention": "slime", "packing": "bshd"}, "THD packing rule"),
        ({"packing": "bshd", "total_multiple": 8}, "BSHD pads every sequence"),
    ]
    for extra, words in cases:
        doc = {"sequences": [{"run": "slime", "request": "sl-a"}], **extra}
        response = client.http.post("/v1/trainer/megatron", json=doc)
        assert response.status_code == 422 and words in response.json()["detail"], (extra, response.text)
