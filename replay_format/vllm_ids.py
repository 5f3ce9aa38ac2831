"""Which request id a vLLM route is stored under, from what a user of vLLM holds (mirrors vLLM 0.32).

Used by the client (`replay_client.openai_ids` re-exports it) and by the service, which stores a whole response's
choices under these ids (`replay_format/vllm_response.md`). The plugin stores a route under the engine request's
*external* id (vLLM's 8-hex suffix stripped), which is not the id a user sees: `stored_request_id` maps a response's
`id` (`cmpl-...` + `-{prompt index}` for completions, `chatcmpl-...` for chat, `RequestOutput.request_id` offline)
and, with `n > 1`, the `{index}_` child prefix; `response_request_ids` / `choice_request_ids` give every choice's id.
An id the service cannot store raises ValueError (the plugin stored no rows for it).

Design (each rule's vLLM source): docs/design/vllm_request_ids.md.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from replay_format import valid_id

__all__ = ["Endpoint", "choice_request_ids", "response_request_ids", "stored_request_id"]


class Endpoint(StrEnum):
    """Where the request was made: vLLM's OpenAI-compatible endpoints, or the offline `LLM`."""

    COMPLETIONS = "completions"  # POST /v1/completions
    CHAT = "chat"  # POST /v1/chat/completions
    OFFLINE = "offline"  # vllm.LLM.generate / LLM.chat: the id is RequestOutput.request_id


def stored_request_id(response_id: str, *, endpoint: Endpoint | str = Endpoint.COMPLETIONS, prompt_index: int = 0,
                      choice_index: int = 0, n: int = 1) -> str:
    """The id one choice's route is stored under.

    `response_id`: the response's `id` (`cmpl-...`, `chatcmpl-...`) or, offline, `RequestOutput.request_id`.
    `prompt_index`: which prompt of a completions request (chat and offline: always 0).
    `choice_index`: which of the prompt's `n` samples (`CompletionOutput.index`; a chat choice's `index`).
    `n`: the request's `n` (a child prefix exists only when `n > 1`).
    Raises ValueError for indexes out of range, or an id the service cannot store (the plugin drops those rows).
    """
    endpoint = Endpoint(endpoint)
    if n < 1 or not 0 <= choice_index < n:
        raise ValueError(f"choice_index {choice_index} is not one of the n={n} samples")
    if prompt_index < 0 or (prompt_index and endpoint != Endpoint.COMPLETIONS):
        # chat: one conversation per request (chat_completion/serving.py:405 asserts one generator);
        # offline: every prompt has its own RequestOutput and id.
        raise ValueError(f"prompt_index {prompt_index}: only /v1/completions takes several prompts")
    rid = f"{response_id}-{prompt_index}" if endpoint == Endpoint.COMPLETIONS else response_id
    if n > 1:
        rid = f"{choice_index}_{rid}"  # vllm/v1/engine/parallel_sampling.py:94
    if not valid_id(rid):
        raise ValueError(f"{rid!r} breaks the service's id rule: the plugin stored no rows for it "
                         "(choose an X-Request-Id of A-Z a-z 0-9 . _ : @ + = -)")
    return rid


def response_request_ids(response_id: str, num_choices: int, *, endpoint: Endpoint | str = Endpoint.COMPLETIONS,
                         n: int | None = None) -> list[str]:
    """The stored id of every choice of one response, in `choice.index` order.

    Chat and offline: `n` is the number of choices. Completions: choice `i` is prompt `i // n`,
    sample `i % n` (completion/serving.py:328), so `n` is needed when there is more than one choice.
    """
    endpoint = Endpoint(endpoint)
    if endpoint != Endpoint.COMPLETIONS:
        if n not in (None, num_choices):
            raise ValueError(f"a {endpoint} response has n={num_choices} choices, not {n}")
        return [stored_request_id(response_id, endpoint=endpoint, choice_index=i, n=num_choices)
                for i in range(num_choices)]
    if n is None:
        if num_choices != 1:
            raise ValueError("a completions response with several choices needs the request's n "
                             "(several prompts and n > 1 both give several choices)")
        n = 1
    if n < 1 or num_choices % n:
        raise ValueError(f"{num_choices} choices are not a whole number of prompts of n={n}")
    return [stored_request_id(response_id, endpoint=endpoint, prompt_index=i // n, choice_index=i % n, n=n)
            for i in range(num_choices)]


def choice_request_ids(response: Any, n: int | None = None) -> list[str]:
    """The stored id of each entry of `response.choices` (or `RequestOutput.outputs`), in that order.

    Takes the `openai` client's `Completion` / `ChatCompletion` (by their `object` field) or a
    vLLM `RequestOutput` (its `request_id` and `outputs`). `n`: the request's `n`, needed for a
    completions response with several choices.
    """
    kind = getattr(response, "object", None)
    if kind in ("text_completion", "chat.completion"):
        endpoint = Endpoint.COMPLETIONS if kind == "text_completion" else Endpoint.CHAT
        ids = response_request_ids(response.id, len(response.choices), endpoint=endpoint, n=n)
        return [ids[c.index] for c in response.choices]
    if hasattr(response, "request_id") and hasattr(response, "outputs"):
        outs = response.outputs
        ids = response_request_ids(response.request_id, len(outs), endpoint=Endpoint.OFFLINE, n=n)
        return [ids[o.index] for o in outs]
    raise TypeError(f"not a completions/chat response or a vLLM RequestOutput: {type(response).__name__}")
