"""miles: every rank of a CP x TP grid, with and without all-gather CP, gets the rows miles's own rule gives it.

miles does not install here; `fill_replay_data` (miles/backends/training_utils/replay_data.py) is
restated in `tests/support/trainers.py` (`miles_rank_rows`, line by line). It is slime's packing with
-1 padding rows (replayed as experts 0..K-1 by `miles/utils/replay_base.py`); `register_replay_list_moe`
(megatron_utils/replay_utils.py) reads `replay_data[:, layer_id]` by model layer, so the rows carry
every model layer: `layer_axis="model"`.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format import RunShape
from tests.support.data import store_requests
from tests.support.trainers import batch_identity, identity_routes, miles_rank_rows, stage_model_layers

MOE_LAYER_FREQ = [1, 0, 1, 0, 1, 0, 1, 1]  # interleaved dense and MoE layers
SHAPE = RunShape(num_moe_layers=5, top_k=4, num_experts=64, moe_layers=(0, 2, 4, 6, 7), num_hidden_layers=8)
LENGTHS = {"mi-a": 45, "mi-b": 130, "mi-c": 8, "mi-d": 77}
ORDER = list(LENGTHS)


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    return client, store_requests(client, "miles", LENGTHS, seed=23, shape=SHAPE)


@pytest.mark.parametrize("allgather", [False, True])
@pytest.mark.parametrize("cp,tp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_every_rank_gets_miles_rows_and_the_ranks_reassemble_the_batch(stored, cp, tp, allgather):
    client, full = stored
    vllm_routes = [SHAPE.to_model_axis(full[r]).astype(np.int32) for r in ORDER]  # vLLM's int32, -1 padding fits
    identities = identity_routes(list(LENGTHS.values()))
    seen = []
    for c in range(cp):
        for t in range(tp):
            rank = dict(tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=c, data_pad_size_multiplier=16,
                        allgather_cp=allgather)
            want = miles_rank_rows(vllm_routes, **rank)
            who = miles_rank_rows(identities, **rank)[:, 0, 0]
            batch = client.megatron_batch([("miles", r) for r in ORDER], convention="miles", layer_axis="model",
                                          data_pad_size_multiplier=16, cp_size=cp, cp_rank=c, tp_size=tp,
                                          tp_rank=t, cp_split="contiguous" if allgather else "zigzag")
            assert batch.experts.shape == want.shape and batch.layout.convention == "miles"
            assert np.array_equal(batch_identity(batch), who)
            real = who >= 0
            assert np.array_equal(batch.experts[real], want[real])
            # miles's padding rows are -1 (experts 0..K-1 when replayed); ours are router-valid filler, masked
            assert (want[~real] == -1).all() and not batch.valid[~real].any()
            seen.append(who[real])
    assert np.array_equal(np.sort(np.concatenate(seen)), np.sort(np.concatenate([i.reshape(-1) for i in identities])))


@pytest.mark.parametrize("pp_rank", [0, 1, 2, 3])
def test_each_stage_stream_is_its_model_layer(stored, pp_rank):
    client, _ = stored
    layers = stage_model_layers(8, MOE_LAYER_FREQ, pp_size=4, pp_rank=pp_rank)
    model = client.megatron_batch([("miles", r) for r in ORDER], convention="miles", layer_axis="model")
    stage = client.megatron_batch([("miles", r) for r in ORDER], convention="miles",
                                  model_layer_range=(2 * pp_rank, 2 * pp_rank + 2))
    real = model.valid.astype(bool)
    assert stage.moe_layers == layers
    for i, layer in enumerate(layers):  # replay_list[i].record(replay_data[:, layer_idx])
        assert np.array_equal(model.experts[real, layer], stage.experts[real, i])
