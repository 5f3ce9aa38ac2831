"""A whole SGLang `/generate` answer as returned (one item, or a batch's list), decoded into one upload per item.

Contract (`decode_sglang_response`): each item's `meta_info.routed_experts` (of `routed_experts_dtype`, int32 when
absent) becomes rows at positions `[start, prompt_tokens + completion_tokens - 1)`, `start` being the request's
`routed_experts_start_len` (the caller's, one per answer), under `meta_info.id` or the caller's `request_ids`. Every
item is decoded and checked before any is stored; an error names the item's index and request id.
Design: docs/design/ingest.md ("SGLang's /generate answers").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_format import ID_RULE, RunShape, Source, valid_id
from replay_service.errors import InvalidInput
from replay_service.ingest.decode import Upload
from replay_service.ingest.engine_outputs import (
    EngineRoute,
    engine_route_rows,
    load_json,
    parse_spans,
    sglang_ids,
    sglang_ids_dtype,
)
from replay_service.ingest.responses import ResponseItem, item_errors, same_shape


@dataclass(frozen=True)
class ResponseOptions:
    """What the caller says beside an SGLang answer (query parameters): the shape SGLang does not send, the start."""

    num_experts: int | None = None
    moe_layers: tuple[int, ...] | None = None
    num_hidden_layers: int | None = None
    num_layers: int | None = None  # the layers of each item's array (default: the ids of a row over top_k)
    top_k: int | None = None  # default: the run's
    start: int = 0  # the request's routed_experts_start_len (one for the whole /generate call)
    max_items: int = 4096


def decode_sglang_response(body: bytes | memoryview, run_id: str, run_shape: RunShape | None,
                           options: ResponseOptions) -> list[ResponseItem]:
    """Every item of an SGLang `/generate` answer (a dict, a list of them, or `{"response": either, "request_ids":
    [...]}` to store the items under the caller's ids in item order), each checked; none stored.

    InvalidInput, FormatError or Conflict naming `item i (request <id>)` for the first item that cannot be stored.
    """
    doc = load_json(body)
    request_ids = None
    if isinstance(doc, dict) and "response" in doc and "meta_info" not in doc:
        unknown = set(doc) - {"response", "request_ids"}
        if unknown:
            raise InvalidInput(f"a wrapped answer holds 'response' and 'request_ids' only, not {sorted(unknown)}")
        request_ids = doc.get("request_ids")
        doc = doc["response"]
    answer = [doc] if isinstance(doc, dict) else doc
    if not isinstance(answer, list) or not answer:
        raise InvalidInput("an SGLang /generate answer is an object with 'meta_info' or a non-empty list of them")
    if len(answer) > options.max_items:
        raise InvalidInput(f"{len(answer)} items exceeds max_batch_requests={options.max_items}")
    if request_ids is not None and (not isinstance(request_ids, list) or len(request_ids) != len(answer)):
        raise InvalidInput(f"'request_ids' must be a list of {len(answer)} ids, one per item in order")
    items: list[ResponseItem] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(answer):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        request_id = request_ids[index] if request_ids is not None else (meta or {}).get("id")
        with item_errors("item", index, request_id):
            if not isinstance(request_id, str) or not valid_id(request_id):
                raise InvalidInput(f"the request id is not a valid id ({ID_RULE}); pass request_ids to store the "
                                   "items under ids of your own")
            if request_id in seen:
                raise InvalidInput(f"the same request id as item {seen[request_id]}")
            seen[request_id] = index
            upload = _item_upload(item, meta, run_id, request_id, run_shape, options)
            same_shape(items, upload)
        items.append(ResponseItem(index, request_id, upload))
    return items


def _item_upload(item: object, meta: object, run_id: str, request_id: str, run_shape: RunShape | None,
                 options: ResponseOptions) -> Upload:
    if not isinstance(item, dict) or not isinstance(meta, dict):
        raise InvalidInput("not an SGLang /generate answer: an object with 'meta_info'")
    if meta.get("routed_experts") is None:
        raise InvalidInput("meta_info has no 'routed_experts' (send the request with return_routed_experts=true to "
                           "a server started with --enable-return-routed-experts)")
    ids = sglang_ids(meta["routed_experts"], sglang_ids_dtype(meta, "meta_info."), "meta_info.")
    prompt, completion = _count(meta, "prompt_tokens"), _count(meta, "completion_tokens")
    start = options.start
    # SGLang aborts such a request (sglang/srt/managers/scheduler.py: "is higher than the number of input tokens")
    if start > prompt:
        raise InvalidInput(f"routed_experts_start_len={start} is beyond the prompt's {prompt} tokens")
    rows = prompt + completion - 1 - start
    if rows < 1:
        raise InvalidInput(f"{prompt} prompt + {completion} output tokens from start {start} leave no rows")
    num_layers, top_k = _row_shape(ids.size, rows, options, run_shape)
    if ids.size != rows * num_layers * top_k:
        raise InvalidInput(f"meta_info.routed_experts holds {ids.size} ids, but prompt_tokens={prompt} and "
                           f"completion_tokens={completion} from start {start} are {rows} rows of "
                           f"num_layers*top_k = {num_layers}*{top_k} ({rows * num_layers * top_k} ids): a truncated "
                           "or foreign array")
    spans = parse_spans(meta["weight_versions"], "meta_info.weight_versions") \
        if meta.get("weight_versions") is not None else None
    single = meta.get("weight_version") if spans is None else None
    if single is not None and not isinstance(single, str):
        raise InvalidInput(f"meta_info.weight_version must be a string, got {single!r:.100}")
    route = EngineRoute(
        route=ids.reshape(rows, num_layers, top_k),
        num_experts=None,
        moe_layers=options.moe_layers,
        token_ids=_tokens(item, prompt, completion),
        source=Source.SGLANG_OUTPUT,
        start=start,
        num_hidden_layers=options.num_hidden_layers,
        weight_versions=spans,
        weight_version=single,
        prompt_tokens=prompt,
    )
    return Upload.of_engine(engine_route_rows(run_id, request_id, route, run_shape, options.num_experts), start,
                            start + rows + 1)


def _count(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"meta_info.{key} must be a count (SGLang sends it), got {value!r:.100}")
    return value


def _row_shape(size: int, rows: int, options: ResponseOptions, run_shape: RunShape | None) -> tuple[int, int]:
    """`(num_layers, top_k)` of each row: the caller's, else top_k from the run and the layers from the ids' count."""
    top_k = options.top_k or (run_shape.top_k if run_shape is not None else None)
    if top_k is None and options.num_layers:
        if size % (rows * options.num_layers):
            raise InvalidInput(f"meta_info.routed_experts holds {size} ids, not {rows} rows of num_layers="
                               f"{options.num_layers} layers: a truncated or foreign array")
        return options.num_layers, size // (rows * options.num_layers)
    if top_k is None:
        raise InvalidInput("SGLang does not send the array's shape: pass top_k (and num_layers) for a new run")
    if options.num_layers:
        return options.num_layers, top_k
    if size % (rows * top_k):
        raise InvalidInput(f"meta_info.routed_experts holds {size} ids, not {rows} rows of top_k={top_k} ids per "
                           "layer: a truncated or foreign array")
    return size // (rows * top_k), top_k


def _tokens(item: dict, prompt: int, completion: int) -> np.ndarray | None:
    """The whole sequence when SGLang returned the prompt's ids (`return_prompt_token_ids`) and the output ids."""
    prompt_ids, output_ids = item.get("prompt_token_ids"), item.get("output_ids")
    if not isinstance(prompt_ids, list) or not isinstance(output_ids, list):
        return None
    if len(prompt_ids) != prompt or len(output_ids) != completion:
        raise InvalidInput(f"prompt_token_ids ({len(prompt_ids)}) and output_ids ({len(output_ids)}) are not "
                           f"prompt_tokens={prompt} and completion_tokens={completion}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt_ids + output_ids):
        raise InvalidInput("prompt_token_ids and output_ids must be token ids")
    return np.asarray(prompt_ids + output_ids, np.int64)

