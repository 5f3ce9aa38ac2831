"""Whole routes as engines hand them out, decoded into row batches (`Rows`).

Two shapes arrive: vLLM's `routed_experts` as a `.npy` array `(T-1, layers, top_k)` and SGLang's
`meta_info["routed_experts"]` as base64 int32 inside JSON. Both may hold every model layer
(dense ones as zeros); only MoE layers are stored. Everything here raises `FormatError` (its
`UndecodableError` when the body is not .npy or JSON at all) or `InvalidInput`, naming the problem.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass

import numpy as np

from replay_format import NO_TOKEN, RunShape, Source, UndecodableError
from replay_format.rows import Rows, RowsMeta, narrow_ids
from replay_service.errors import InvalidInput

ID_DTYPES = ("int32", "int64", "int16", "uint8", "uint16")  # what a JSON route's `dtype` may name


@dataclass
class EngineRoute:
    """A whole route from an engine output, before layer selection."""

    route: np.ndarray  # (T-1, layers, K) integers
    num_experts: int | None
    moe_layers: tuple[int, ...] | None
    token_ids: np.ndarray | None
    source: Source


def select_moe_layers(route: np.ndarray, moe_layers: tuple[int, ...] | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Keep only MoE layers of an engine output `(T-1, num_model_layers, K)`.

    Engines write dense layers as zeros (vLLM's `routed_experts`); without a
    caller-given list the MoE layers are the ones that are not all zero.
    """
    if route.ndim != 3:
        raise InvalidInput(f"a route is (tokens-1, layers, top_k); got shape {route.shape}")
    if moe_layers:
        if max(moe_layers) >= route.shape[1] or min(moe_layers) < 0:
            raise InvalidInput(f"moe_layers {list(moe_layers)} do not fit a route of {route.shape[1]} layers")
        if len(moe_layers) == route.shape[1]:
            return route, tuple(moe_layers)
        return np.ascontiguousarray(route[:, list(moe_layers), :]), tuple(moe_layers)
    if route.shape[0] == 0:
        return route, tuple(range(route.shape[1]))
    nonzero = np.flatnonzero(route.reshape(route.shape[0], route.shape[1], -1).any(axis=(0, 2)))
    if nonzero.size == 0:
        raise InvalidInput("every layer of the route is all zero: nothing to store (pass moe_layers explicitly)")
    layers = tuple(int(x) for x in nonzero)
    if len(layers) == route.shape[1]:
        return route, layers
    return np.ascontiguousarray(route[:, list(layers), :]), layers


def decode_npy(body: bytes | memoryview) -> np.ndarray:
    """A `.npy` body as an integer array viewing the body (no copy, no pickles).

    The header is checked against the body's length before anything is allocated, and
    a damaged header is an UndecodableError (numpy raises several kinds of error while parsing one).
    """
    fp = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except Exception as exc:  # noqa: BLE001 - ValueError, SyntaxError, TokenError, ... all mean "bad header"
        raise UndecodableError(f"body is not a .npy array: {exc}") from None
    if dtype.hasobject or not np.issubdtype(dtype, np.integer):
        raise InvalidInput(f".npy route must hold integer ids, got {dtype}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    data_bytes = len(body) - fp.tell()
    if count * dtype.itemsize != data_bytes:
        raise UndecodableError(
            f".npy header says {shape} of {dtype} ({count * dtype.itemsize} bytes) but the body holds {data_bytes}")
    array = np.frombuffer(body, dtype=dtype, count=count, offset=fp.tell())
    return array.reshape(shape, order="F" if fortran_order else "C")


def decode_sglang_json(body: bytes | memoryview) -> EngineRoute:
    """SGLang-style `{"routed_experts": base64 int32, "num_layers", "top_k", ...}`."""
    try:
        doc = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UndecodableError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("routed_experts"), str):
        raise InvalidInput("JSON route needs 'routed_experts': a base64 string of int32 ids")
    try:
        raw = base64.b64decode(doc["routed_experts"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"'routed_experts' is not valid base64: {exc}") from None
    # `num_layers` is SGLang's name: the layers of the flattened array (model layers or MoE layers).
    num_layers, top_k = _json_int(doc, "num_layers"), _json_int(doc, "top_k")
    if num_layers is None or top_k is None:
        raise InvalidInput("JSON route needs integer 'num_layers' and 'top_k' (the flattened array's shape)")
    dtype_name = doc.get("dtype", "int32")
    if dtype_name not in ID_DTYPES:
        raise InvalidInput(f"'dtype' {dtype_name!r} is not an integer id type (int32 as SGLang sends)")
    dtype = np.dtype(dtype_name)
    if len(raw) % dtype.itemsize:
        raise InvalidInput(f"'routed_experts' decodes to {len(raw)} bytes, not a whole number of {dtype_name} ids")
    ids = np.frombuffer(raw, dtype=dtype)
    if num_layers < 1 or top_k < 1 or ids.size % (num_layers * top_k):
        raise InvalidInput(f"{ids.size} ids do not split into rows of num_layers*top_k = {num_layers}*{top_k}")
    token_ids, moe_layers = _json_int_list(doc, "token_ids"), _json_int_list(doc, "moe_layers")
    return EngineRoute(
        route=ids.reshape(-1, num_layers, top_k),
        num_experts=_json_int(doc, "num_experts"),
        moe_layers=tuple(moe_layers) if moe_layers else None,
        token_ids=np.asarray(token_ids, np.int64) if token_ids is not None else None,
        source=Source.SGLANG_OUTPUT,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_int(doc: dict, key: str) -> int | None:
    value = doc.get(key)
    if value is not None and not _is_int(value):
        raise InvalidInput(f"'{key}' must be an integer, got {value!r}")
    return value


def _json_int_list(doc: dict, key: str) -> list[int] | None:
    value = doc.get(key)
    if value is not None and not (isinstance(value, list) and all(_is_int(v) and abs(v) < 2**31 for v in value)):
        raise InvalidInput(f"'{key}' must be a list of integers")
    return value


def engine_route_rows(
    run_id: str, request_id: str, route: EngineRoute, run_shape: RunShape | None, num_experts: int | None
) -> Rows:
    """Rows for a whole-route upload; idempotent on (run, "upload/<request>", 0)."""
    all_layers = run_shape is not None and route.route.shape[1] != run_shape.num_moe_layers
    layers_wanted = route.moe_layers or (run_shape.moe_layers if run_shape is not None and all_layers else None)
    experts3, moe_layers = select_moe_layers(route.route, layers_wanted)
    if run_shape is not None and route.moe_layers is None and experts3.shape[1] == run_shape.num_moe_layers:
        moe_layers = run_shape.moe_layers
    n, num_moe_layers, top_k = experts3.shape
    experts_n = num_experts or route.num_experts or (run_shape.num_experts if run_shape else None)
    if experts_n is None:
        raise InvalidInput("num_experts is unknown: pass it (query parameter or JSON field) for a new run")
    shape = RunShape(num_moe_layers, top_k, experts_n, moe_layers)
    experts = narrow_ids(experts3.reshape(n, num_moe_layers * top_k), experts_n, what="route")
    tokens = np.full(n, NO_TOKEN, np.int32)
    if route.token_ids is not None:
        if len(route.token_ids) not in (n, n + 1):
            raise InvalidInput(
                f"token_ids has {len(route.token_ids)} entries; a route of {n} rows needs {n} or {n + 1}")
        tokens = route.token_ids[:n].astype(np.int32)
    # "upload/<request>" breaks the id rule on purpose: no real writer can send this writer id.
    meta = RowsMeta(run_id=run_id, writer_id=f"upload/{request_id}", seq=0, shape=shape, source=route.source)
    return Rows(meta=meta, request_ids=[request_id], request_index=np.zeros(n, np.int32),
                positions=np.arange(n, dtype=np.int32), token_ids=tokens, experts=experts,
                flags=np.zeros(n, np.uint16))
