"""Route answers: Arrow IPC stream (default), .npy, or JSON for people."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa

from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, flag_names
from replay_service.errors import InvalidInput, StrictRefusal
from replay_service.store.reads import RouteRows

FORMATS = {"arrow": ARROW_STREAM_MEDIA_TYPE, "npy": NPY_MEDIA_TYPE, "json": "application/json"}


def pick_format(format_param: str | None, accept: str | None) -> str:
    if format_param:
        if format_param not in FORMATS:
            raise InvalidInput(f"format {format_param!r} is not one of {', '.join(FORMATS)}")
        return format_param
    for name, media in FORMATS.items():
        if accept and media in accept:
            return name
    return "arrow"


def route_metadata(run_id: str, route: RouteRows, start: int, end: int) -> dict[str, str]:
    shape = route.shape
    return {
        "run_id": run_id,
        "request_id": route.request_id,
        "num_layers": str(shape.num_moe_layers),
        "top_k": str(shape.top_k),
        "num_experts": str(shape.num_experts),
        "moe_layers": json.dumps(list(shape.moe_layers)),
        "start": str(start),
        "end": str(end),
    }


def flag_counts(flags: np.ndarray) -> dict[str, int]:
    bits, counts = np.unique(flags[flags != 0], return_counts=True)
    out: dict[str, int] = {}
    for b, c in zip(bits.tolist(), counts.tolist()):
        for name in flag_names(b):
            out[name] = out.get(name, 0) + c
    return out


def refuse_if_flagged(route: RouteRows, report_rows: int, what: str) -> None:
    bad = route.bad_rows()
    if bad.size:
        named = [
            {"request_id": route.request_id, "position": int(route.positions[i]), "flags": flag_names(int(route.flags[i]))}
            for i in bad[:report_rows]
        ]
        first = named[0]
        raise StrictRefusal(
            f"strict read refused: {what} has {bad.size} flagged or missing rows, the first at position "
            f"{first['position']} ({', '.join(first['flags'])})",
            named,
        )


def arrow_stream(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def npy_bytes(array: np.ndarray) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return b"".join((header.getvalue(), memoryview(np.ascontiguousarray(array)).cast("B")))


def route_json(run_id: str, route: RouteRows, start: int, end: int) -> dict:
    experts = route.experts_3d().tolist()
    tokens = route.token_ids.to_pylist()
    return {
        "run_id": run_id,
        "request_id": route.request_id,
        "start": start,
        "end": end,
        "num_layers": route.shape.num_moe_layers,
        "top_k": route.shape.top_k,
        "num_experts": route.shape.num_experts,
        "moe_layers": list(route.shape.moe_layers),
        "flagged": flag_counts(route.flags),
        "rows": [
            {"position": int(p), "token_id": t, "experts": e, "flags": flag_names(int(f))}
            for p, t, e, f in zip(route.positions.tolist(), tokens, experts, route.flags.tolist())
        ],
    }
