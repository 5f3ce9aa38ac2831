"""Start offsets on every upload path, and a conversation's later turns extending one request.

Engines return a later turn's rows from an offset: vLLM `SamplingParams.routed_experts_prompt_start`
("skip the first routed_experts_prompt_start prompt tokens ... set this to the length of the
already-returned prefix", vllm/sampling_params.py; the rows end at `num_tokens - 1`,
vllm/distributed/aux_output_connector/connector.py `take_output`), SGLang `routed_experts_start_len`
("response covers [routed_experts_start_len, seqlen - 1)", sglang io_struct GenerateReqInput).
miles asks turn k for the rows after turn k-1's `T - 1` (miles/rollout/session/core.py
`_maybe_request_addition_r3`) and concatenates them (samples/merge.py `merge_samples_with_addition_r3`).
Each upload here is checked against that rule, through a real server.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from replay_client.client import ReplayClient, ReplayError
from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from tests.support.data import routes
from tests.support.service import calls

DEEPSEEK = RunShape(num_moe_layers=5, top_k=8, num_experts=64, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def conversation(seed: int, turns: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A dialogue's whole route `(T-1, 8, K)` as vLLM returns it, its tokens, and each turn's (start, T).

    `turns` are (new prompt tokens, generated tokens) per turn; turn k's prompt is everything before it.
    """
    rng = np.random.default_rng(seed)
    total = sum(p + g for p, g in turns)
    full = DEEPSEEK.to_model_axis(routes(rng, total - 1, DEEPSEEK)).astype(np.int32)
    tokens = rng.integers(0, 150_000, total)
    bounds, end = [], 0
    for new, generated in turns:
        start = max(end - 1, 0)  # routed_experts_prompt_start = the rows already returned
        end += new + generated
        bounds.append((start, end))
    return full, tokens, bounds


def test_vllm_turns_with_prompt_start_read_back_as_one_request(client, shared_service):
    full, _, bounds = conversation(1, [(20, 6), (10, 5), (3, 9)])
    for k, (start, t) in enumerate(bounds):
        turn = full[start : t - 1]  # what vLLM hands out for this turn: (T - 1 - start, num_hidden_layers, K)
        answer = client.upload_vllm_output("turns-v", "chat", turn, num_experts=64, moe_layers=DEEPSEEK.moe_layers,
                                           start=start)
        assert answer.stored and answer.rows == len(turn)
        summary = client.request("turns-v", "chat")
        assert summary.num_tokens == t and summary.status == "finished" and summary.clean, (k, summary)
    route = client.get_route("turns-v", "chat", strict=True, layer_axis="model")
    assert route.positions.tolist() == list(range(len(full)))
    assert route.experts.tobytes() == full.astype(np.uint8).tobytes()
    assert client.get_route("turns-v", "chat").experts.tobytes() == full[:, 3:].astype(np.uint8).tobytes()
    start, t = bounds[1]
    assert client.get_route_npy("turns-v", "chat", start=start, end=t - 1, layer_axis="model").tobytes() == \
        full[start : t - 1].astype(np.uint8).tobytes()
    # A retried turn is a duplicate; an earlier turn again leaves the request's end where the last turn put it.
    start, t = bounds[1]
    again = client.upload_vllm_output("turns-v", "chat", full[start : t - 1], start=start)
    assert again.duplicate and client.request("turns-v", "chat").num_tokens == bounds[-1][1]
    # The same turn with other rows is not a retry: 409, as a reused seq.
    other = full[start : t - 1].copy()
    other[0, 3] = (other[0, 3] + 1) % 64
    with pytest.raises(ReplayError, match="already stored seq") as reused:
        client.upload_vllm_output("turns-v", "chat", other, start=start)
    assert reused.value.status == 409


def test_one_upload_from_an_offset_lands_at_its_positions(client, shared_service):
    """The issue's round trip: `(T-1-start, num_hidden_layers, K)` .npy uploaded with `start`, read back byte-equal."""
    full, _, _ = conversation(2, [(30, 12)])
    start = 17
    body = io.BytesIO()
    np.save(body, full[start:], allow_pickle=False)
    answer = calls.post(f"{shared_service.url}/v1/runs/turns-one/requests/r/routes", content=body.getvalue(),
                        params={"start": start, "num_experts": 64, "moe_layers": "3,4,5,6,7"},
                        headers={"content-type": NPY_MEDIA_TYPE})
    assert answer.status_code == 200, answer.text
    summary = client.request("turns-one", "r")
    assert summary.num_tokens == 42 and summary.rows == 41 - start and summary.flagged["GAP"] == start
    tail = client.get_route("turns-one", "r", start=start, strict=True, layer_axis="model")
    assert tail.positions[0] == start and tail.experts.tobytes() == full[start:].astype(np.uint8).tobytes()
    head = client.get_route("turns-one", "r", end=start)
    assert set(head.flags.tolist()) == {32}  # rows before the offset were never sent: GAP, never clean


def test_sglang_turns_with_routed_experts_start_len(client):
    full, tokens, bounds = conversation(3, [(12, 4), (7, 8)])
    for start, t in bounds:
        turn = np.ascontiguousarray(full[start : t - 1])
        client.upload_sglang_output("turns-s", "chat", base64.b64encode(turn.tobytes()).decode(), num_layers=8,
                                    top_k=8, num_experts=64, moe_layers=DEEPSEEK.moe_layers, start=start,
                                    token_ids=tokens[:t])  # the whole sequence so far (input_ids + output ids)
    route = client.get_route("turns-s", "chat", strict=True, layer_axis="model")
    assert route.experts.astype(np.int32).tolist() == full.tolist()
    assert route.token_ids.tolist() == tokens[:-1].tolist()
    assert client.request("turns-s", "chat").num_tokens == len(tokens)
    # token_ids from the turn's start are read the same way.
    start, t = bounds[1]
    payload = base64.b64encode(np.ascontiguousarray(full[start : t - 1])).decode()
    client.upload_sglang_output("turns-s", "chat2", payload, num_layers=8, top_k=8, moe_layers=DEEPSEEK.moe_layers,
                                start=start, token_ids=tokens[start:t])
    assert client.get_route("turns-s", "chat2", start=start).token_ids.tolist() == tokens[start : t - 1].tolist()


def test_arrow_positions_are_absolute(client, shared_service):
    rng = np.random.default_rng(4)
    shape = RunShape(2, 2, 16, (0, 1))
    ex = routes(rng, 9, shape)
    url = f"{shared_service.url}/v1/runs/turns-a/requests/a/routes"
    arrow = {"content-type": ARROW_STREAM_MEDIA_TYPE}

    def body(lo: int, hi: int) -> bytes:
        return encode_stream(build_rows(RowsMeta("x", "x", 0, shape), ["a"] * (hi - lo), np.arange(lo, hi), ex[lo:hi]))

    assert calls.post(url, content=body(0, 5), headers=arrow).status_code == 200
    assert client.request("turns-a", "a").num_tokens == 6
    wrong = calls.post(url, content=body(5, 9), params={"start": 0}, headers=arrow)  # relative positions assumed
    assert wrong.status_code == 422 and "positions are absolute" in wrong.json()["detail"]
    assert calls.post(url, content=body(5, 9), params={"start": 5}, headers=arrow).status_code == 200
    assert client.request("turns-a", "a").num_tokens == 10
    assert client.get_route("turns-a", "a", strict=True).experts.tobytes() == ex.tobytes()


def test_uploads_that_would_misplace_rows_are_refused_and_store_nothing(client, shared_service):
    full, tokens, bounds = conversation(5, [(10, 4), (6, 3)])
    (s1, t1), (s2, t2) = bounds
    client.upload_vllm_output("turns-bad", "r", full[: t1 - 1], num_experts=64, moe_layers=DEEPSEEK.moe_layers)
    rows_before = client.request("turns-bad", "r").rows
    # start = the previous length instead of length - 1: one row off, every later row shifted. Refused.
    with pytest.raises(ReplayError, match=rf"next turn starts at row {t1 - 1}.* starts at {t1}") as gap:
        client.upload_vllm_output("turns-bad", "r", full[t1 : t2 - 1], start=t1)
    assert gap.value.status == 409
    # Rows past a finished request's end without finish: they would never be served.
    with pytest.raises(ReplayError, match="would never be served") as unfinished:
        client.upload_vllm_output("turns-bad", "r", full[s2 : t2 - 1], start=s2, finish=False)
    assert unfinished.value.status == 409
    assert client.request("turns-bad", "r").rows == rows_before  # nothing stored by either
    # The query and the body disagreeing on the start, or token ids of no sensible length.
    url = f"{shared_service.url}/v1/runs/turns-bad/requests/r/routes"
    doc = {"routed_experts": base64.b64encode(np.ascontiguousarray(full[s2 : t2 - 1])).decode(), "num_layers": 8,
           "top_k": 8, "routed_experts_start_len": s2}
    disagree = calls.post(url, json=doc, params={"start": s2 + 1})
    assert disagree.status_code == 422 and "routed_experts_start_len" in disagree.json()["detail"]
    bad_tokens = calls.post(url, json={**doc, "token_ids": tokens[: s2 + 2].tolist()})
    assert bad_tokens.status_code == 422 and "token_ids has" in bad_tokens.json()["detail"]
    assert calls.post(url, json=doc).status_code == 200
    assert client.request("turns-bad", "r").num_tokens == t2
    # An aborted request is not finished or extended by an upload.
    client.finish("turns-bad", "ab", 5, status="aborted")
    with pytest.raises(ReplayError, match="was aborted") as aborted:
        client.upload_vllm_output("turns-bad", "ab", full[:4])
    assert aborted.value.status == 409


def test_without_finish_an_open_request_stays_open(client):
    full, _, _ = conversation(6, [(8, 4)])
    client.upload_vllm_output("turns-open", "o", full[:6], num_experts=64, moe_layers=DEEPSEEK.moe_layers,
                              finish=False)
    client.upload_vllm_output("turns-open", "o", full[6:], start=6, finish=False)
    summary = client.request("turns-open", "o")
    assert summary.status == "open" and summary.rows == len(full) and summary.num_tokens is None
    assert client.get_route("turns-open", "o", layer_axis="model").experts.tobytes() == full.astype(np.uint8).tobytes()
