"""Ingest stage 1, decode: request bodies become `Rows` (replay_format.rows), or a named error.

Two endpoints send rows. `POST /v1/ingest` takes row batches (rows.md) and nothing else.
`POST /v1/runs/{run}/requests/{request}/routes` takes one request's whole route in the form the
engine handed it out: `.npy` or SGLang JSON (`engine_outputs.py`), or an Arrow row batch whose
run, writer and request come from the URL. Nothing is stored until a body has decoded.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pyarrow as pa

from replay_format import ARROW_STREAM_MEDIA_TYPE, JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, RunShape, Source
from replay_format import rows as rows_format
from replay_format.rows import Rows, RowsMeta, shape_metadata
from replay_service.errors import InvalidInput, UnsupportedMediaType
from replay_service.ingest.engine_outputs import EngineRoute, decode_npy, decode_sglang_json, engine_route_rows

# Metadata keys that name a run's layer count (rows.md 2.0 and 1.0).
_SHAPE_KEYS = {"num_moe_layers", "num_layers"}


class BodyKind(enum.Enum):
    """What a body holds, by its media type."""

    ARROW = (ARROW_STREAM_MEDIA_TYPE, "application/octet-stream")
    NPY = (NPY_MEDIA_TYPE,)
    SGLANG_JSON = (JSON_MEDIA_TYPE,)

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


def decode_route(content_type: str, body: bytes | memoryview, run_id: str, request_id: str,
                 run_shape: RunShape | None, num_experts: int | None, moe_layers: tuple[int, ...] | None) -> Rows:
    """One request's whole route (positions 0..T-2), idempotent on (run, "upload/<request>", 0).

    `run_shape` is the run's when it exists: engine outputs holding every model layer are cut
    to its MoE layers, and an Arrow body without shape keys takes its shape.
    """
    kind = BodyKind.of(content_type)
    if kind == BodyKind.NPY:
        route = EngineRoute(decode_npy(body), None, moe_layers, None, Source.VLLM_OUTPUT)
    elif kind == BodyKind.SGLANG_JSON:
        route = decode_sglang_json(body)
        route.moe_layers = moe_layers or route.moe_layers
    elif kind == BodyKind.ARROW:
        return _arrow_route(body, run_id, request_id, run_shape)
    else:
        raise UnsupportedMediaType(f"a route is {NPY_MEDIA_TYPE}, {JSON_MEDIA_TYPE} or {ARROW_STREAM_MEDIA_TYPE}; "
                                   f"got {media_type(content_type) or 'no content type'}")
    return engine_route_rows(run_id, request_id, route, run_shape, num_experts)


def _arrow_route(body: bytes | memoryview, run_id: str, request_id: str, run_shape: RunShape | None) -> Rows:
    table, md = rows_format.read_stream(body)
    md = {"source": Source.VLLM_OUTPUT.value, **md, "run_id": run_id, "writer_id": "upload", "seq": "0"}
    if run_shape is not None and not _SHAPE_KEYS & md.keys():
        md.setdefault("format_version", str(rows_format.VERSION))  # the run's shape is written in today's keys
        md.update(shape_metadata(run_shape))
    meta = RowsMeta.from_metadata(md)
    # "upload/<request>" breaks the id rule on purpose: no real writer can send this writer id.
    meta = dataclasses.replace(meta, writer_id=f"upload/{request_id}")
    if "request_id" in table.schema.names:
        table = table.drop_columns(["request_id"])
    table = table.add_column(0, "request_id", pa.array([request_id] * table.num_rows, pa.utf8()))
    return rows_format.read_rows(table, meta)


def route_num_tokens(rows: Rows) -> int:
    """T of a whole route: its last position + 2 (the last sampled token has no row)."""
    return int(np.max(rows.positions)) + 2 if rows.num_rows else 1
