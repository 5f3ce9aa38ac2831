"""A -1 in an engine's array, through a real server, on each endpoint that takes one (docs/guides/http_api.md, "-1 in an
engine's array").

Engines write -1 where there is no expert: vLLM 0.34 for its padded MoE rows, SGLang inside for a fused shared-expert
slot (dropped before it answers), google/tunix when it pads its arrays to a fixed length. A row of -1 is a padding row:
not stored, counted in `padding_dropped`, its position left a GAP; rows of -1 after the last real row are cut (the
request ends at its last real row); a trailing top-k slot of -1 on every row is dropped (`padding_slots_dropped`). Any
other -1 sits beside expert ids: refused naming its row, layer and slot, and nothing is stored. Unfixed, each of these
was a 422 "mark padding rows with the PADDING flag", which these endpoints cannot do.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client.client import ReplayClient, ReplayError
from tests.test_sglang_responses import generate_item, request_of
from tests.test_vllm_responses import SHAPE, _tokens, capture, chat_response


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def padded(array: np.ndarray, inside: int, after: int, slots: int) -> np.ndarray:
    """`array` (rows, layers, K) as int32 with row `inside` all -1, `after` rows of -1 after it and `slots` trailing
    slots of -1."""
    out = np.concatenate([array.astype(np.int32), np.full((after, *array.shape[1:]), -1, np.int32)])
    out[inside] = -1
    return np.concatenate([out, np.full((*out.shape[:2], slots), -1, np.int32)], axis=2)


def assert_stored_but(client: ReplayClient, run: str, rid: str, sent: np.ndarray, gap: int) -> None:
    """Every row of `sent` (model axis) stored at its position but the padding row `gap`, which reads GAP."""
    route = client.get_route(run, rid, layer_axis="model")
    assert route.positions.tolist() == list(range(len(sent)))
    real = np.arange(len(sent)) != gap
    assert np.array_equal(route.experts[real].astype(np.int64), sent[real].astype(np.int64))
    assert [p for p, flags in route.flagged_rows()] == [gap] and route.flagged_rows()[0][1] == ["GAP"]
    summary = client.request(run, rid)
    assert summary.status == "finished" and summary.num_tokens == len(sent) + 1


def test_a_npy_upload_drops_padding_rows_and_slots_and_says_so(client):
    rng = np.random.default_rng(61)
    sent = capture(SHAPE, rng, _tokens(rng, 7), _tokens(rng, 5))  # 11 rows, every model layer, layer 0 dense
    answer = client.upload_route("pad-npy", "r", padded(sent, inside=4, after=3, slots=1), num_experts=16,
                                 moe_layers=SHAPE.moe_layers)
    assert (answer.stored, answer.rows, answer.padding_dropped, answer.padding_slots_dropped) == (True, 10, 4, 1)
    assert_stored_but(client, "pad-npy", "r", sent, gap=4)


def test_a_vllm_answer_drops_padding_rows_and_slots_and_says_so(client):
    rng = np.random.default_rng(62)
    prompt, out = _tokens(rng, 6), _tokens(rng, 4)
    sent = capture(SHAPE, rng, prompt, out)  # 9 rows: the answer's token counts say so
    body = chat_response("pad", prompt, [out], [padded(sent, inside=2, after=2, slots=1)], token_ids=True)
    (item,) = client.upload_vllm_response("pad-vllm", body, num_experts=16, moe_layers=SHAPE.moe_layers).items
    assert (item.rows, item.padding_dropped, item.padding_slots_dropped) == (8, 3, 1)
    assert_stored_but(client, "pad-vllm", item.request_id, sent, gap=2)


def test_an_sglang_answer_drops_padding_rows_and_slots_and_says_so(client):
    rng = np.random.default_rng(63)
    prompt, output, model = request_of(rng, SHAPE, 8, 5)  # 12 rows, int32 on the wire (SGLang 0.5.23)
    item = generate_item("pad-s", prompt, output, padded(model, inside=6, after=0, slots=1))
    (stored,) = client.upload_sglang_response("pad-sglang", item, num_experts=16, num_layers=4, top_k=3,
                                              moe_layers=SHAPE.moe_layers).items
    assert (stored.rows, stored.padding_dropped, stored.padding_slots_dropped) == (11, 1, 1)
    assert_stored_but(client, "pad-sglang", "pad-s", model, gap=6)


@pytest.mark.parametrize("where", ["npy", "vllm", "sglang"])
def test_a_minus_one_beside_expert_ids_is_refused_naming_it_and_nothing_is_stored(client, where):
    rng = np.random.default_rng(64)
    prompt, out = _tokens(rng, 6), _tokens(rng, 4)
    sent = capture(SHAPE, rng, prompt, out).astype(np.int32)
    sent[5, 2, 1] = -1
    run = f"pad-refused-{where}"
    with pytest.raises(ReplayError) as refused:
        if where == "npy":
            client.upload_route(run, "r", sent, num_experts=16, moe_layers=SHAPE.moe_layers)
        elif where == "vllm":
            client.upload_vllm_response(run, chat_response("x", prompt, [out], [sent], token_ids=True),
                                        num_experts=16, moe_layers=SHAPE.moe_layers)
        else:
            client.upload_sglang_response(run, generate_item("r", prompt, out, sent), num_experts=16, num_layers=4,
                                          top_k=2, moe_layers=SHAPE.moe_layers)
    assert refused.value.status == 422
    assert "row 5 holds -1 at layer 2, slot 1 beside expert ids" in str(refused.value)
    assert "send the expert ids the engine used for that token, or that whole row as -1" in str(refused.value)
    assert run not in {r.run_id for r in client.runs()}
