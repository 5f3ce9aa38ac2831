"""Read answers, service side: the route format asked for, strict refusals, the bytes of each format.

Arrow is the route answer of replay_format/route.md (built by `replay_format.route.encode_routes`),
`.npy` is numpy's format, JSON is `api.models.RouteJson` for people. The routers only pick the
HTTP response class; every decision about what goes out is made here. Each carries the rows' weight
versions: Arrow a `weight_version` column, JSON a `weight_version` per row (and the spans), `.npy` the
header `X-Replay-Weight-Versions` (the spans as JSON: a reader needs no body parsing to get them).
"""

from __future__ import annotations

import enum
import functools
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic_core import to_json

from replay_format import (
    ARROW_STREAM_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    NO_TOKEN,
    NPY_MEDIA_TYPE,
    LayerAxis,
    RunShape,
    flag_names,
)
from replay_format.route import RequestRoute, RouteMeta, encode_routes
from replay_format.weight_versions import RecomputeRule, VersionSpan
from replay_service.errors import InvalidInput, StrictRefusal
from replay_service.store import RouteStore
from replay_service.store.requests.rows import RouteRows


class RouteFormat(enum.StrEnum):
    """The representations of a route answer (`format=` or `Accept`)."""

    ARROW = "arrow"
    NPY = "npy"
    JSON = "json"

    @property
    def media_type(self) -> str:
        return {RouteFormat.ARROW: ARROW_STREAM_MEDIA_TYPE, RouteFormat.NPY: NPY_MEDIA_TYPE,
                RouteFormat.JSON: JSON_MEDIA_TYPE}[self]


def pick_format(format_param: str | None, accept: str | None) -> RouteFormat:
    """`format=` when given, else the first format the Accept header names, else Arrow."""
    if format_param:
        try:
            return RouteFormat(format_param)
        except ValueError:
            raise InvalidInput(f"format {format_param!r} is not one of {', '.join(RouteFormat)}") from None
    for kind in RouteFormat:
        if accept and kind.media_type in accept:
            return kind
    return RouteFormat.ARROW


@dataclass
class Answer:
    """What goes out: the body in parts (views of the arrays where possible), its media type and headers."""

    media_type: str
    parts: list[bytes | memoryview]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


def flag_counts(flags: np.ndarray) -> dict[str, int]:
    """Rows per flag name."""
    if not flags.any():  # the common answer (clean rows), without np.unique's sort
        return {}
    bits, counts = np.unique(flags[flags != 0], return_counts=True)
    out: dict[str, int] = {}
    for b, c in zip(bits.tolist(), counts.tolist()):
        for name in flag_names(b):
            out[name] = out.get(name, 0) + c
    return out


def refuse_if_flagged(route: RouteRows, report_rows: int, what: str) -> None:
    """StrictRefusal naming the first `report_rows` flagged or missing rows of `route`, if it has any."""
    bad = route.bad_rows()
    if bad.size:
        named: list[dict[str, Any]] = [{"request_id": route.request_id, "position": int(route.positions[i]),
                  "flags": flag_names(int(route.flags[i]))} for i in bad[:report_rows]]
        first = named[0]
        raise StrictRefusal(
            f"strict read refused: {what} has {bad.size} flagged or missing rows, the first at position "
            f"{first['position']} ({', '.join(first['flags'])})",
            named,
        )


def request_route(route: RouteRows, axis: LayerAxis = LayerAxis.MOE) -> RequestRoute:
    """The store's rows as the route format's `RequestRoute` on `axis` (the MoE axis: the same arrays, no copy)."""
    return RequestRoute(route.request_id, route.positions, route.token_ids, route.experts_on(axis), route.flags,
                        route.weight_versions)


@dataclass(frozen=True)
class Selection:
    """Which of a position's computations a read serves: the rule, and a weight version when one is named."""

    rule: RecomputeRule = RecomputeRule.FIRST
    weight_version: str | None = None


VERSIONS_HEADER = "X-Replay-Weight-Versions"
MAX_VERSIONS_HEADER = 32 << 10  # bytes of spans JSON a header carries (HTTP servers and clients bound header sizes)


def version_spans(route: RouteRows) -> list[VersionSpan]:
    """The route's rows' weight versions as spans over positions (rows of unknown version in none)."""
    return [] if route.weight_versions is None else route.weight_versions.spans(route.positions)


def versions_header(route: RouteRows) -> str:
    """`X-Replay-Weight-Versions`: the spans as JSON (`[{"version", "start", "end"}]`); InvalidInput over the bound."""
    spans = version_spans(route)
    if not spans:
        return "[]"
    text = json.dumps([s.to_json() for s in spans], separators=(",", ":"))
    if len(text) > MAX_VERSIONS_HEADER:
        raise InvalidInput(f"the rows' weight versions are {len(text)} bytes of spans, more than the "
                           f"{VERSIONS_HEADER} header carries ({MAX_VERSIONS_HEADER}); read a shorter range "
                           "(start/end), or format=arrow, whose weight_version column carries them per row")
    return text


def route_answer(run: str, route: RouteRows, start: int, kind: RouteFormat, max_json_rows: int,
                 axis: LayerAxis = LayerAxis.MOE, selection: Selection = Selection()) -> Answer:
    """One request's rows `[start, start + n)` in `kind` on layer axis `axis`, with the X-Route-* headers."""
    stop = start + route.num_rows
    headers = {"X-Route-Start": str(start), "X-Route-End": str(stop), "X-Route-Layer-Axis": axis.value,
               "X-Replay-Recompute": selection.rule.value}
    if kind == RouteFormat.JSON:
        if route.num_rows > max_json_rows:
            raise InvalidInput(f"{route.num_rows} rows is more than JSON serves ({max_json_rows}); "
                               "use start/end, or format=arrow or npy")
        return Answer(kind.media_type, [to_json(route_json(run, route, start, stop, axis, selection))], headers)
    counts = flag_counts(route.flags)
    headers["X-Route-Flags"] = ",".join(f"{k}={v}" for k, v in counts.items()) or "none"
    if kind == RouteFormat.NPY:
        headers[VERSIONS_HEADER] = versions_header(route)
        return Answer(kind.media_type, npy_parts(route.experts_on(axis)), headers)
    meta = RouteMeta(run, route.shape, requests=1, start=start, end=stop, layer_axis=axis,
                     recompute=selection.rule, weight_version=selection.weight_version)
    parts = [p for chunk in encode_routes(meta, [request_route(route, axis)]) for p in chunk]
    return Answer(kind.media_type, joined_small(parts), headers)


SMALL_PART = 1 << 16  # parts below this are joined (a copy), not sent one by one (a syscall and ASGI send each)


def joined_small(parts: list[memoryview]) -> list[bytes | memoryview]:
    """`parts` with each run of small neighbours joined into one bytes; large parts stay views (no copy).

    An Arrow answer is ~20 parts (flatbuffer headers, 4-byte lengths, padding, the columns); only
    the ids column is large. Sent as they are, each is an ASGI message, an h11 event and a socket write.
    """
    out: list[bytes | memoryview] = []
    small: list[memoryview] = []
    for part in parts:
        if part.nbytes < SMALL_PART:
            small.append(part)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(part)
    if small:
        out.append(b"".join(small))
    return out


HELD_ANSWER_BYTES = 1 << 30  # a batch answer up to this size is built whole (its routes held at once)


def batch_answer(store: RouteStore, run: str, request_ids: list[str], start: int, end: int | None, strict: bool,
                 report_rows: int, axis: LayerAxis = LayerAxis.MOE,
                 selection: Selection = Selection()) -> Answer | Iterator[list[memoryview]]:
    """Many requests' routes as one Arrow route answer on layer axis `axis`, one record batch per request.

    Every request is read before this returns, so a missing request or a strict refusal is a
    clean 404/409 instead of a cut stream. Up to `HELD_ANSWER_BYTES` of ids the answer is built
    whole, from the routes read (views of the segments where a route is one stored span): an
    `Answer` with a known length, sent in a few large writes. A larger one is streamed, each
    request read again as it goes out, so no more than one route is held at a time.
    """
    shape = store.run_shape(run)
    meta = RouteMeta(run, shape, requests=len(request_ids), start=start, end=end, layer_axis=axis,
                     recompute=selection.rule, weight_version=selection.weight_version)
    row_bytes = meta.column_shape.row_width * shape.dtype.itemsize
    held: list[RouteRows] | None = []
    size = 0
    rule, version = selection.rule, selection.weight_version
    for rid in request_ids:
        route = store.read_route(run, rid, start, end, rule, version)
        if strict:
            refuse_if_flagged(route, report_rows, f"request {rid!r}")
        size += route.num_rows * row_bytes
        if held is not None and size <= HELD_ANSWER_BYTES:
            held.append(route)
        else:
            held = None  # past the bound: hold none, stream
    if held is not None:
        parts = [p for chunk in encode_routes(meta, [request_route(r, axis) for r in held]) for p in chunk]
        return Answer(ARROW_STREAM_MEDIA_TYPE, joined_small(parts))
    return encode_routes(meta, (request_route(store.read_route(run, rid, start, end, rule, version), axis)
                                for rid in request_ids))


@functools.lru_cache(maxsize=1024)
def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The `.npy` 1.0 header of a C-ordered array of `dtype` and `shape`, as numpy writes it (kept: answers repeat
    a few shapes, and numpy's writer costs more than the rest of a small answer)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    return header.getvalue()


def npy_parts(array: np.ndarray) -> list[bytes | memoryview]:
    """`.npy` (format 1.0) of `array`: its header, then the array's own bytes in C order (no copy when contiguous)."""
    header = npy_header(array.dtype, array.shape)
    if array.size == 0:  # an empty range: a memoryview of a zero-length shape cannot be cast
        return [header]
    return [header, np.ascontiguousarray(array).data.cast("B")]


def route_json(run_id: str, route: RouteRows, start: int, end: int, axis: LayerAxis = LayerAxis.MOE,
               selection: Selection = Selection()) -> dict:
    """The `RouteJson` answer (api/models.py) as plain data (serialised without per-row validation: it is large)."""
    experts = route.experts_on(axis).tolist()
    tokens = route.token_ids
    shape = route.shape
    labels = route.versions().per_row()
    return {
        "run_id": run_id,
        "request_id": route.request_id,
        "start": start,
        "end": end,
        "num_moe_layers": shape.num_moe_layers,
        "top_k": shape.top_k,
        "num_experts": shape.num_experts,
        "moe_layers": list(shape.moe_layers),
        "num_hidden_layers": shape.num_hidden_layers,
        "layer_axis": axis.value,
        "layers": list(shape.moe_layers) if axis == LayerAxis.MOE else list(range(shape.num_hidden_layers)),
        "flagged": flag_counts(route.flags),
        "recompute": selection.rule.value,
        "weight_version": selection.weight_version,
        "weight_versions": [s.to_json() for s in version_spans(route)],
        "rows": [
            {"position": int(p), "token_id": None if t == NO_TOKEN else t, "experts": e, "flags": flag_names(int(f)),
             "weight_version": v}
            for p, t, e, f, v in zip(route.positions.tolist(), tokens.tolist(), experts, route.flags.tolist(), labels)
        ],
    }


def expert_load(run_id: str, shape: RunShape, load: np.ndarray) -> dict:
    """The `ExpertLoad` answer: the `(num_moe_layers, num_experts)` token counts and each layer's max/mean."""
    rows_counted = int(load[0].sum() // shape.top_k) if load.size else 0
    mean = load.mean(axis=1)
    imbalance = np.divide(load.max(axis=1), mean, out=np.zeros_like(mean, dtype=float), where=mean > 0)
    return {
        "run_id": run_id,
        "num_moe_layers": shape.num_moe_layers,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "moe_layers": list(shape.moe_layers),
        "rows": rows_counted,
        "counts": load.tolist(),
        "imbalance": [round(float(x), 4) for x in imbalance],
    }
