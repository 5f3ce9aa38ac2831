"""A whole vLLM answer as returned (completions, chat, or the offline `RequestOutput`), decoded into one upload per
choice (`replay_format/vllm_response.md`).

Contract (`decode_vllm_response`): each choice is stored under the id the plugin would store it under
(`replay_format.vllm_ids`), at the request's `routed_experts_prompt_start`, with its dtype and layers as sent, its
tokens and weight-version spans where the answer carries them. Every choice is checked before any is stored (no
`routed_experts`, a start beyond its prompt, an array longer or shorter than its tokens or `usage` say); a refusal
names the choice.
Design: docs/design/ingest.md ("vLLM's answers").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_format import FormatError, RunShape, Source
from replay_format.vllm_ids import response_request_ids
from replay_format.vllm_response import ResponseObject, decode_routed_experts
from replay_service.errors import InvalidInput
from replay_service.ingest.decode import Upload
from replay_service.ingest.engine_outputs import EngineRoute, engine_route_rows, load_json, padding_of, parse_spans
from replay_service.ingest.responses import ResponseItem, item_errors, same_shape


@dataclass(frozen=True)
class VllmResponseOptions:
    """What the caller says beside a vLLM answer (query parameters): what the answer does not carry."""

    num_experts: int | None = None  # needed for a new run
    moe_layers: tuple[int, ...] | None = None
    num_hidden_layers: int | None = None
    start: int = 0  # the request's routed_experts_prompt_start
    n: int | None = None  # the request's n: needed for a completions answer of several choices
    max_items: int = 4096


@dataclass(frozen=True)
class _Choice:
    """One choice as the answer gives it: its place, its stored id, its array and what its tokens are known to be."""

    index: int
    request_id: str
    doc: dict
    prompt_ids: list | None  # the prompt's token ids, when returned
    output_ids: list | None  # the choice's token ids, when returned


def decode_vllm_response(body: bytes | memoryview, run_id: str, run_shape: RunShape | None,
                         options: VllmResponseOptions) -> list[ResponseItem]:
    """Every choice of a vLLM answer, each checked; none stored (module docstring).

    InvalidInput or FormatError naming `choice i (request <id>)` for the first choice that cannot be stored, or the
    answer when it is none of the three bodies.
    """
    doc = load_json(body)
    kind = _kind(doc)
    assert isinstance(doc, dict)
    choices = _choices(doc, kind, options)
    usage = doc.get("usage")
    # usage.prompt_tokens is every choice's prompt when the request had one prompt (chat always; completions with
    # n choices); the offline output carries its prompt's ids instead
    one_prompt = kind is ResponseObject.CHAT or len(choices) == (options.n or 1)
    shared_prompt = usage.get("prompt_tokens") if isinstance(usage, dict) and one_prompt else None
    items: list[ResponseItem] = []
    for choice in choices:
        with item_errors("choice", choice.index, choice.request_id):
            upload = _choice_upload(choice, run_id, run_shape, options,
                                    shared_prompt if type(shared_prompt) is int else None)
            same_shape(items, upload)
        items.append(ResponseItem(choice.index, choice.request_id, upload))
    _check_usage(usage, kind, items, options)
    return items


def _kind(doc: object) -> ResponseObject:
    kinds = ", ".join(f"'{k.value}'" for k in ResponseObject)
    if not isinstance(doc, dict):
        raise InvalidInput(f"a vLLM answer is a JSON object whose 'object' is one of {kinds}")
    try:
        return ResponseObject(str(doc.get("object")))
    except ValueError:
        raise InvalidInput(f"'object' is {doc.get('object')!r:.100}, not one of {kinds} (an SGLang answer goes to "
                           "/responses/sglang)") from None


def _choices(doc: dict, kind: ResponseObject, options: VllmResponseOptions) -> list[_Choice]:
    """The answer's choices with their stored ids (replay_format.vllm_ids), in the answer's order."""
    key, id_key = ("outputs", "request_id") if kind is ResponseObject.REQUEST_OUTPUT else ("choices", "id")
    listed, response_id = doc.get(key), doc.get(id_key)
    if not isinstance(listed, list) or not listed or not all(isinstance(c, dict) for c in listed):
        raise InvalidInput(f"'{key}' must be a non-empty list of objects")
    if len(listed) > options.max_items:
        raise InvalidInput(f"{len(listed)} {key} exceeds max_batch_requests={options.max_items}")
    if not isinstance(response_id, str):
        raise InvalidInput(f"'{id_key}' must be the answer's id, got {response_id!r:.100}")
    indexes = [c.get("index") for c in listed]
    if sorted(i for i in indexes if type(i) is int) != list(range(len(listed))):
        raise InvalidInput(f"the {key}' indexes {indexes[:20]} are not 0..{len(listed) - 1}, each once")
    try:
        ids = response_request_ids(response_id, len(listed), endpoint=kind.endpoint, n=options.n)
    except ValueError as exc:
        raise InvalidInput(f"{exc} (the request's n: `?n=`)") from None
    top_prompt = doc.get("prompt_token_ids")
    return [_Choice(c["index"], ids[c["index"]], c,
                    c.get("prompt_token_ids") if kind is ResponseObject.COMPLETION else top_prompt,
                    c.get("token_ids")) for c in listed]


def _choice_upload(choice: _Choice, run_id: str, run_shape: RunShape | None, options: VllmResponseOptions,
                   shared_prompt: int | None) -> Upload:
    doc = choice.doc
    if doc.get("routed_experts") is None:
        raise InvalidInput("it has no routed_experts (start the server with --enable-return-routed-experts, or "
                           "LLM(enable_return_routed_experts=True); an aborted request may have none)")
    array = decode_routed_experts(doc["routed_experts"], "")
    rows, start = int(array.shape[0]) - padding_of(array).trailing_rows, options.start  # a padded array: its route
    prompt = _token_list(choice.prompt_ids, "prompt_token_ids")
    output = _token_list(choice.output_ids, "token_ids")
    prompt_count = shared_prompt if prompt is None else len(prompt)
    if prompt_count is not None and start > prompt_count:
        raise InvalidInput(f"routed_experts_prompt_start={start} is beyond its prompt's {prompt_count} tokens (vLLM "
                           "would have started at the prompt's end: the rows' positions are not known)")
    tokens = None
    if prompt is not None and output is not None:
        tokens = prompt + output
        if rows != len(tokens) - 1 - start:
            raise InvalidInput(f"routed_experts holds {rows} rows, but {len(prompt)} prompt + {len(output)} output "
                               f"tokens from start {start} are {len(tokens) - 1 - start}: a truncated or foreign "
                               "array")
    spans = doc.get("weight_versions")
    route = EngineRoute(
        route=array,
        num_experts=None,
        moe_layers=options.moe_layers,
        token_ids=None if tokens is None else np.asarray(tokens, np.int64),
        source=Source.VLLM_OUTPUT,
        start=start,
        num_hidden_layers=options.num_hidden_layers,
        weight_versions=None if spans is None else parse_spans(spans, "weight_versions"),
        prompt_tokens=prompt_count,
    )
    return Upload.of_engine(engine_route_rows(run_id, choice.request_id, route, run_shape, options.num_experts),
                            start)


def _token_list(value: object, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < 2**31 for t in value):
        raise InvalidInput(f"{what} must be a list of token ids")
    return value


def _check_usage(usage: object, kind: ResponseObject, items: list[ResponseItem], options: VllmResponseOptions) -> None:
    """Every choice's tokens add up to what `usage` says the request computed (when it says it): an array cut
    short or another request's is refused even without token ids. Chat and offline have one prompt for every
    choice; completions' `usage.prompt_tokens` sums each prompt once."""
    if not isinstance(usage, dict) or kind is ResponseObject.REQUEST_OUTPUT:
        return
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:
        return
    samples = len(items) if kind is ResponseObject.CHAT else (options.n or 1)
    tokens_total = sum(item.upload.num_tokens for item in items)  # each choice's start + rows + 1
    want = prompt * samples + completion
    if tokens_total != want:
        raise FormatError(f"the choices' routed_experts from start {options.start} cover {tokens_total} tokens in "
                          f"all, but usage says {prompt} prompt tokens x {samples} samples + {completion} completion "
                          f"tokens = {want}: a truncated or foreign array, or the wrong start or n")
