"""Ingest stage 1, decode: request bodies become `Rows` (replay_format.rows), or a named error; nothing is stored.

Contract: `decode_batch` reads a `POST /v1/ingest` body (an Arrow row batch, rows.md); `decode_route` reads one
request's route, or one turn of it from a start position, as `.npy`, SGLang JSON (engine_outputs.py) or an Arrow
batch whose run, writer and request come from the URL, into an `Upload` (its rows, start and implied length).
Engines' whole answers: sglang_responses.py and vllm_responses.py.
Design: docs/design/ingest.md ("Decoding bodies").
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa

from replay_format import ARROW_STREAM_MEDIA_TYPE, JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, RunShape, Source
from replay_format import rows as rows_format
from replay_format.rows import Rows, RowsMeta, shape_metadata
from replay_format.vllm_response import read_npy
from replay_format.weight_versions import VersionSpan
from replay_service.errors import InvalidInput, UnsupportedMediaType
from replay_service.ingest.engine_outputs import (
    EngineRoute,
    EngineRows,
    decode_sglang_json,
    engine_route_rows,
    parse_spans,
    upload_writer,
)

T = TypeVar("T")
# Metadata keys that name a run's layer count (rows.md 2.0 and 1.0).
_SHAPE_KEYS = {"num_moe_layers", "num_layers"}


class BodyKind(enum.Enum):
    """What a body holds, by its media type."""

    ARROW = (ARROW_STREAM_MEDIA_TYPE, "application/octet-stream")
    NPY = (NPY_MEDIA_TYPE,)
    JSON = (JSON_MEDIA_TYPE,)

    @classmethod
    def of(cls, content_type: str) -> BodyKind | None:
        """The kind a `Content-Type` names, None when none does."""
        media = media_type(content_type)
        return next((kind for kind in cls if media in kind.value), None)


def media_type(content_type: str) -> str:
    """A `Content-Type` header's media type, without parameters, lower case."""
    return content_type.split(";")[0].strip().lower()


def decode_batch(content_type: str, body: bytes | memoryview) -> Rows:
    """A `POST /v1/ingest` body: an Arrow row batch (no content type is taken to mean one)."""
    if media_type(content_type) and BodyKind.of(content_type) != BodyKind.ARROW:
        raise UnsupportedMediaType(f"ingest takes {ARROW_STREAM_MEDIA_TYPE}, got {media_type(content_type)}")
    table, md = rows_format.read_stream(body)
    return rows_format.read_rows(table, RowsMeta.from_metadata(md))


def parse_moe_layers(text: str | None) -> tuple[int, ...] | None:
    """The `moe_layers` query parameter: comma-separated model-layer indices."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidInput(f"moe_layers={text!r} is not a comma-separated list of layer indices") from None


def parse_weight_versions(text: str | None) -> list[VersionSpan] | None:
    """The `weight_versions` query parameter: a JSON list of spans over output tokens (vLLM's
    `CompletionOutput.weight_versions` as `[{"version", "start", "end"}]`)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidInput(f"weight_versions={text[:200]!r} is not JSON: a list of {{'version', 'start', 'end'}} "
                           "spans over output tokens") from None
    return parse_spans(value)


@dataclass(frozen=True)
class UploadOptions:
    """What the caller says about an uploaded route beside its body (query parameters)."""

    num_experts: int | None = None
    moe_layers: tuple[int, ...] | None = None  # model-layer index of each MoE layer
    num_hidden_layers: int | None = None  # the model's layer count
    start: int | None = None  # the first row's position (default 0; an Arrow body's positions say it)
    weight_versions: list[VersionSpan] | None = None  # spans over output tokens (engine_outputs.upload_versions)
    weight_version: str | None = None  # one version for every row
    prompt_tokens: int | None = None  # P, where the spans do not imply it


@dataclass
class Upload:
    """A decoded route upload: its rows, the first position they start at, the request length they imply, and the
    engine's padding cut from it (`engine_outputs.padding_of`: rows after its last real row, trailing slots)."""

    rows: Rows
    start: int
    num_tokens: int  # T: the last row's position + 2 (start + 1 for no rows)
    padding_rows_cut: int = 0
    padding_slots_cut: int = 0

    @classmethod
    def of_engine(cls, engine: EngineRows, start: int, num_tokens: int | None = None) -> Upload:
        """An engine route's upload; `num_tokens` from its rows unless the answer's token counts say it."""
        real = engine.rows.num_rows
        return cls(engine.rows, start, start + real + 1 if num_tokens is None else num_tokens, engine.rows_cut,
                   engine.slots_cut)


def decode_route(content_type: str, body: bytes | memoryview, run_id: str, request_id: str,
                 run_shape: RunShape | None, options: UploadOptions = UploadOptions()) -> Upload:
    """One request's route, or one turn of it, at positions `start ..`; idempotent per (request, start, rows).

    `run_shape` is the run's when it exists: it says which layers an engine output holds when the caller
    does not (`engine_outputs.choose_layers`), and an Arrow body without shape keys takes its shape.
    """
    kind = BodyKind.of(content_type)
    if kind == BodyKind.NPY:
        route = EngineRoute(read_npy(body), None, None, None, Source.VLLM_OUTPUT)
    elif kind == BodyKind.JSON:
        route = decode_sglang_json(body)
    elif kind == BodyKind.ARROW:
        if options.weight_versions is not None or options.weight_version is not None or options.prompt_tokens:
            raise InvalidInput("an Arrow route carries its rows' versions in its weight_version column (rows.md); "
                               "weight_versions, weight_version and prompt_tokens are for .npy and JSON bodies")
        return _arrow_route(body, run_id, request_id, run_shape, options.start)
    else:
        raise UnsupportedMediaType(f"a route is {NPY_MEDIA_TYPE}, {JSON_MEDIA_TYPE} or {ARROW_STREAM_MEDIA_TYPE}; "
                                   f"got {media_type(content_type) or 'no content type'}")
    route.start = _agree("start", "routed_experts_start_len", options.start, route.start)
    route.moe_layers = _agree("moe_layers", "moe_layers", options.moe_layers, route.moe_layers)
    route.num_hidden_layers = _agree("num_hidden_layers", "num_hidden_layers", options.num_hidden_layers,
                                     route.num_hidden_layers)
    route.weight_versions = _agree("weight_versions", "weight_versions", options.weight_versions,
                                   route.weight_versions)
    route.weight_version = _agree("weight_version", "weight_version", options.weight_version, route.weight_version)
    route.prompt_tokens = _agree("prompt_tokens", "prompt_tokens", options.prompt_tokens, route.prompt_tokens)
    return Upload.of_engine(engine_route_rows(run_id, request_id, route, run_shape, options.num_experts),
                            route.start or 0)


def _agree(query_name: str, body_name: str, query: T | None, body: T | None) -> T | None:
    """The value the query and the body both name (either may leave it out); InvalidInput when they differ."""
    if query is not None and body is not None and query != body:
        raise InvalidInput(f"the query says {query_name}={query} but the body says {body_name}={body}")
    return query if query is not None else body


def _arrow_route(body: bytes | memoryview, run_id: str, request_id: str, run_shape: RunShape | None,
                 start: int | None) -> Upload:
    """An Arrow row batch of one request: positions are absolute (rows.md); a given `start` must be the first."""
    table, md = rows_format.read_stream(body)
    md = {"source": Source.VLLM_OUTPUT.value, **md, "run_id": run_id, "writer_id": "upload", "seq": "0"}
    if run_shape is not None and not _SHAPE_KEYS & md.keys():
        md.setdefault("format_version", str(rows_format.VERSION))  # the run's shape is written in today's keys
        md.update(shape_metadata(run_shape))
    meta = RowsMeta.from_metadata(md)
    if "request_id" in table.schema.names:
        table = table.drop_columns(["request_id"])
    table = table.add_column(0, "request_id", pa.array([request_id] * table.num_rows, pa.utf8()))
    rows = rows_format.read_rows(table, meta)
    first = int(np.min(rows.positions))
    if start is not None and start != first:
        raise InvalidInput(f"an Arrow route's positions are absolute (rows.md): its first is {first}, but "
                           f"start={start}; write the positions start, start + 1, ... into the body")
    # The upload's idempotency key, as for engine outputs (`upload_writer`): one batch per (request, start, rows).
    rows.meta = dataclasses.replace(meta, writer_id=upload_writer(request_id, first), seq=rows.num_rows)
    return Upload(rows, first, int(np.max(rows.positions)) + 2)
