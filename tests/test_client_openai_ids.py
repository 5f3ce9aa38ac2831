"""The id rules of `replay_client.openai_ids` (fast, no vLLM): what a vLLM user holds -> the stored id.

Each rule is checked two ways: against the ids written out by hand from vLLM 0.32's source (cited in
the module), and against the plugin's own `external_id` applied to the internal id vLLM would make
(`{engine id}-{8 hex}`, children `{index}_{engine id}-{8 hex}`), so the helper and the plugin agree.
The end-to-end check against a real API server is tests/test_vllm_openai.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from capture.vllm.sink.book import external_id
from replay_client import Endpoint, choice_request_ids, response_request_ids, stored_request_id

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def _internal(engine_id: str, n: int, index: int) -> str:
    """The id vLLM's workers see: assign_request_id's suffix, then the n > 1 child prefix."""
    parent = f"{engine_id}-0a1b2c3d"  # vllm/v1/engine/input_processor.py:371
    return f"{index}_{parent}" if n > 1 else parent  # vllm/v1/engine/parallel_sampling.py:94


@pytest.mark.parametrize(("response_id", "endpoint", "prompt_index", "choice_index", "n", "want", "engine_id"), [
    # completions: every prompt is engine request `{id}-{prompt index}` (completion/serving.py:177)
    ("cmpl-a0f9c1d2e3f40516", "completions", 0, 0, 1, "cmpl-a0f9c1d2e3f40516-0", "cmpl-a0f9c1d2e3f40516-0"),
    ("cmpl-my-rollout-0001", "completions", 3, 0, 1, "cmpl-my-rollout-0001-3", "cmpl-my-rollout-0001-3"),
    ("cmpl-a0f9", "completions", 0, 1, 2, "1_cmpl-a0f9-0", "cmpl-a0f9-0"),
    ("cmpl-a0f9", "completions", 2, 0, 4, "0_cmpl-a0f9-2", "cmpl-a0f9-2"),
    # chat: the response id is the engine request id (chat_completion/serving.py:314-316, 339-341)
    ("chatcmpl-my-chat-7", "chat", 0, 0, 1, "chatcmpl-my-chat-7", "chatcmpl-my-chat-7"),
    ("chatcmpl-b1", "chat", 0, 2, 3, "2_chatcmpl-b1", "chatcmpl-b1"),
    # offline LLM.generate: RequestOutput.request_id, a counter (entrypoints/common/offline.py:579)
    ("0", "offline", 0, 0, 1, "0", "0"),
    ("17", Endpoint.OFFLINE, 0, 1, 2, "1_17", "17"),
])
def test_stored_id(response_id, endpoint, prompt_index, choice_index, n, want, engine_id):
    got = stored_request_id(response_id, endpoint=endpoint, prompt_index=prompt_index, choice_index=choice_index, n=n)
    assert got == want
    assert external_id(_internal(engine_id, n, choice_index)) == want  # what the plugin stores it under


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(response_id="cmpl-x", choice_index=1), "not one of the n=1"),
    (dict(response_id="cmpl-x", choice_index=2, n=2), "not one of the n=2"),
    (dict(response_id="cmpl-x", n=0), "not one of"),
    (dict(response_id="cmpl-x", prompt_index=-1), "prompt_index"),
    (dict(response_id="chatcmpl-x", endpoint="chat", prompt_index=1), "only /v1/completions"),
    (dict(response_id="3", endpoint="offline", prompt_index=1), "only /v1/completions"),
    (dict(response_id="cmpl-my id"), "id rule"),  # an X-Request-Id with a space: the plugin stored nothing
    (dict(response_id="cmpl-a/b"), "id rule"),
])
def test_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stored_request_id(**kwargs)


def test_unknown_endpoint():
    with pytest.raises(ValueError):
        stored_request_id("x", endpoint="responses")


def test_response_ids_completions_order():
    # choice i is prompt i // n, sample i % n (completion/serving.py:328)
    assert response_request_ids("cmpl-z", 6, n=2) == ["0_cmpl-z-0", "1_cmpl-z-0", "0_cmpl-z-1", "1_cmpl-z-1",
                                                     "0_cmpl-z-2", "1_cmpl-z-2"]
    assert response_request_ids("cmpl-z", 3, n=1) == ["cmpl-z-0", "cmpl-z-1", "cmpl-z-2"]
    assert response_request_ids("cmpl-z", 1) == ["cmpl-z-0"]
    with pytest.raises(ValueError, match="needs the request's n"):
        response_request_ids("cmpl-z", 2)  # two prompts, or one prompt with n = 2: not guessed
    with pytest.raises(ValueError, match="whole number"):
        response_request_ids("cmpl-z", 3, n=2)


def test_response_ids_chat_and_offline():
    assert response_request_ids("chatcmpl-q", 1, endpoint="chat") == ["chatcmpl-q"]
    assert response_request_ids("chatcmpl-q", 2, endpoint="chat") == ["0_chatcmpl-q", "1_chatcmpl-q"]
    assert response_request_ids("4", 2, endpoint="offline", n=2) == ["0_4", "1_4"]
    with pytest.raises(ValueError, match="n=2 choices, not 3"):
        response_request_ids("chatcmpl-q", 2, endpoint="chat", n=3)


def _completion(rid: str, indexes: list[int]):
    return openai_types.Completion.model_validate({
        "id": rid, "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": i, "text": "", "finish_reason": "length", "logprobs": None} for i in indexes]})


def _chat(rid: str, indexes: list[int]):
    return chat_types.ChatCompletion.model_validate({
        "id": rid, "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": i, "finish_reason": "length", "message": {"role": "assistant", "content": "t5"}}
                    for i in indexes]})


def test_choice_ids_from_openai_objects():
    assert choice_request_ids(_completion("cmpl-r", [0, 1, 2, 3]), n=2) == [
        "0_cmpl-r-0", "1_cmpl-r-0", "0_cmpl-r-1", "1_cmpl-r-1"]
    # the choice's own index decides, whatever the list order
    assert choice_request_ids(_completion("cmpl-r", [1, 0]), n=1) == ["cmpl-r-1", "cmpl-r-0"]
    assert choice_request_ids(_chat("chatcmpl-s", [0])) == ["chatcmpl-s"]
    assert choice_request_ids(_chat("chatcmpl-s", [2, 0, 1])) == ["2_chatcmpl-s", "0_chatcmpl-s", "1_chatcmpl-s"]


def test_choice_ids_from_request_output_shape():
    # vLLM's RequestOutput: request_id (external, vllm/v1/engine/output_processor.py:394) and outputs[k].index
    out = SimpleNamespace(request_id="12", outputs=[SimpleNamespace(index=1), SimpleNamespace(index=0)])
    assert choice_request_ids(out) == ["1_12", "0_12"]
    assert choice_request_ids(SimpleNamespace(request_id="12", outputs=[SimpleNamespace(index=0)])) == ["12"]
    with pytest.raises(TypeError):
        choice_request_ids(SimpleNamespace(id="x", object="response"))
