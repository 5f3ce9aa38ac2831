"""Turn request bodies (Arrow IPC, .npy, SGLang-style base64 JSON) into validated rows.

Everything here raises `InputError` with a message naming the problem; nothing
is stored until a body has passed every check.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_schema import FLAG_MASK, BatchMeta, Flag, RunShape, check_id, expert_dtype


class InputError(Exception):
    """A bad request body or parameter: `status` is the HTTP answer."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class IncomingRows:
    """One writer batch, normalised: ids in the run dtype, one request dictionary."""

    meta: BatchMeta
    request_ids: list[str]  # dictionary of request ids
    request_index: np.ndarray  # int32 (n,): index into request_ids per row
    positions: np.ndarray  # int32 (n,)
    token_ids: np.ndarray  # int64 (n,), -1 where the writer sent none
    experts: np.ndarray  # (n, L*K) run dtype
    flags: np.ndarray  # uint16 (n,): the writer's bits

    @property
    def num_rows(self) -> int:
        return len(self.positions)


def _integer_column(column: pa.Array, name: str, allow_null: bool) -> np.ndarray:
    if not pa.types.is_integer(column.type):
        raise InputError(f"column {name!r} has type {column.type}, expected an integer type")
    if column.null_count and not allow_null:
        raise InputError(f"column {name!r} has {column.null_count} null values")
    if column.null_count:
        return column.fill_null(-1).to_numpy().astype(np.int64)
    return column.to_numpy(zero_copy_only=False)


def narrow_ids(values: np.ndarray, num_experts: int, usable: np.ndarray | None = None, what: str = "experts") -> np.ndarray:
    """Narrow integer ids to uint8/uint16; ids that do not fit are an error, never wrapped.

    `usable` masks rows whose content matters (padding rows are dropped later).
    """
    dtype = expert_dtype(num_experts)
    if values.dtype == dtype:
        return values
    if not np.issubdtype(values.dtype, np.integer):
        raise InputError(f"{what} must hold integer ids, got {values.dtype}")
    checked = values if usable is None else values[usable]
    if checked.size:
        low, high = int(checked.min()), int(checked.max())
        limit = np.iinfo(dtype).max
        if low < 0 or high > limit:
            bad = low if low < 0 else high
            raise InputError(
                f"{what} holds id {bad}, which does not fit {dtype} (num_experts={num_experts}); "
                "mark padding rows with the PADDING flag instead of writing -1"
            )
    return values.astype(dtype)


def read_arrow_body(body: bytes | memoryview) -> pa.Table:
    """An HTTP body as an Arrow table, fully validated (offsets, dictionary indices, UTF-8).

    A damaged stream is a 400 naming what is wrong, never an exception deeper in.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        table.validate(full=True)
        table.schema.names  # noqa: B018 - field names must decode as UTF-8
        for key, value in (table.schema.metadata or {}).items():
            key.decode(), value.decode()
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"body is not a valid Arrow IPC stream: {exc}", status=400) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"body is not a valid Arrow IPC stream: a name or metadata is not UTF-8 ({exc})", 400) from None
    return table


def decode_ingest(body: bytes | memoryview) -> IncomingRows:
    """Parse and validate a `POST /v1/ingest` body (DESIGN.md schema)."""
    table = read_arrow_body(body)
    return rows_from_table(table, parse_meta(table.schema.metadata))


def parse_meta(metadata) -> BatchMeta:
    """Schema metadata as a `BatchMeta`; what is missing or malformed is a 422 naming it."""
    try:
        return BatchMeta.from_metadata(metadata)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def rows_from_table(table: pa.Table, meta: BatchMeta) -> IncomingRows:
    shape = meta.shape
    names = table.schema.names
    for required in ("request_id", "position", "experts"):
        if required not in names:
            raise InputError(f"schema lacks column {required!r}; columns are {names}")
    unknown = set(names) - {"request_id", "position", "token_id", "experts", "flags"}
    if unknown:
        raise InputError(f"schema has unknown columns {sorted(unknown)}")
    if table.num_rows == 0:
        raise InputError("batch holds no rows")
    table = table.combine_chunks()

    experts_col = table.column("experts").chunk(0)
    if not pa.types.is_fixed_size_list(experts_col.type):
        raise InputError(f"column 'experts' has type {experts_col.type}, expected fixed_size_list<uint8|uint16>[L*K]")
    width = experts_col.type.list_size
    if width != shape.row_width:
        raise InputError(
            f"column 'experts' holds {width} ids per row but num_layers*top_k = "
            f"{shape.num_layers}*{shape.top_k} = {shape.row_width}"
        )
    if experts_col.null_count or experts_col.values.null_count:
        raise InputError("column 'experts' has null rows or ids")

    req_col = table.column("request_id").chunk(0)
    if pa.types.is_dictionary(req_col.type):
        if not pa.types.is_string(req_col.type.value_type) and not pa.types.is_large_string(req_col.type.value_type):
            raise InputError(f"column 'request_id' has type {req_col.type}, expected dictionary<int32, utf8>")
    elif pa.types.is_string(req_col.type) or pa.types.is_large_string(req_col.type):
        req_col = req_col.dictionary_encode()
    else:
        raise InputError(f"column 'request_id' has type {req_col.type}, expected dictionary<int32, utf8>")
    if req_col.null_count:
        raise InputError("column 'request_id' has null values")
    dictionary = req_col.dictionary.to_pylist()
    request_index = req_col.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    used = np.unique(request_index)
    request_ids = [str(v) for v in dictionary]
    for i in used:
        try:
            check_id("request_id", request_ids[i])
        except ValueError as exc:
            raise InputError(str(exc)) from None
    if len(set(request_ids)) != len(request_ids):
        # A dictionary with repeated strings: fold it so one request has one index.
        remap = {rid: k for k, rid in enumerate(dict.fromkeys(request_ids))}
        lookup = np.array([remap[r] for r in request_ids], np.int32)
        request_index = lookup[request_index]
        request_ids = list(remap)

    positions = _integer_column(table.column("position").chunk(0), "position", allow_null=False)
    if positions.min() < 0 or positions.max() >= 2**31 - 1:
        raise InputError(f"column 'position' holds {int(positions.min())}..{int(positions.max())}; positions are 0..2**31-2")
    positions = positions.astype(np.int32, copy=False)

    if "token_id" in names:
        token_ids = _integer_column(table.column("token_id").chunk(0), "token_id", allow_null=True).astype(np.int64)
    else:
        token_ids = np.full(table.num_rows, -1, np.int64)

    if "flags" in names:
        flags = _integer_column(table.column("flags").chunk(0), "flags", allow_null=False)
        if flags.size and (int(flags.min()) < 0 or int(np.bitwise_or.reduce(flags.astype(np.int64))) & ~FLAG_MASK):
            raise InputError(f"column 'flags' sets bits outside the defined flags (mask {FLAG_MASK})")
        flags = flags.astype(np.uint16)
    else:
        flags = np.zeros(table.num_rows, np.uint16)

    values = experts_col.values
    if not pa.types.is_integer(values.type):
        raise InputError(f"column 'experts' holds {values.type}, expected uint8 or uint16 ids")
    flat = values.to_numpy(zero_copy_only=False)
    if experts_col.offset:
        flat = flat[experts_col.offset * width : (experts_col.offset + table.num_rows) * width]
    experts = flat.reshape(table.num_rows, width)
    experts = narrow_ids(experts, shape.num_experts, usable=(flags & Flag.PADDING) == 0)
    return IncomingRows(meta, request_ids, request_index, positions, token_ids, experts, flags)


def select_moe_layers(route: np.ndarray, moe_layers: tuple[int, ...] | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Keep only MoE layers of an engine output `(T-1, num_model_layers, K)`.

    Engines write dense layers as zeros (vLLM's `routed_experts`); without a
    caller-given list the MoE layers are the ones that are not all zero.
    """
    if route.ndim != 3:
        raise InputError(f"a route is (tokens-1, layers, top_k); got shape {route.shape}")
    if moe_layers:
        if max(moe_layers) >= route.shape[1] or min(moe_layers) < 0:
            raise InputError(f"moe_layers {list(moe_layers)} do not fit a route of {route.shape[1]} layers")
        if len(moe_layers) == route.shape[1]:
            return route, tuple(moe_layers)
        return np.ascontiguousarray(route[:, list(moe_layers), :]), tuple(moe_layers)
    if route.shape[0] == 0:
        return route, tuple(range(route.shape[1]))
    nonzero = np.flatnonzero(route.reshape(route.shape[0], route.shape[1], -1).any(axis=(0, 2)))
    if nonzero.size == 0:
        raise InputError("every layer of the route is all zero: nothing to store (pass moe_layers explicitly)")
    layers = tuple(int(x) for x in nonzero)
    if len(layers) == route.shape[1]:
        return route, layers
    return np.ascontiguousarray(route[:, list(layers), :]), layers


def decode_npy(body: bytes) -> np.ndarray:
    """A `.npy` body as an integer array viewing the body (no copy, no pickles).

    The header is checked against the body's length before anything is allocated, and
    a damaged header is a 400 (numpy raises several kinds of error while parsing one).
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
        raise InputError(f"body is not a .npy array: {exc}", status=400) from None
    if dtype.hasobject or not np.issubdtype(dtype, np.integer):
        raise InputError(f".npy route must hold integer ids, got {dtype}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    data_bytes = len(body) - fp.tell()
    if count * dtype.itemsize != data_bytes:
        raise InputError(
            f".npy header says {shape} of {dtype} ({count * dtype.itemsize} bytes) but the body holds {data_bytes}",
            status=400,
        )
    array = np.frombuffer(body, dtype=dtype, count=count, offset=fp.tell())
    return array.reshape(shape, order="F" if fortran_order else "C")


@dataclass
class EngineRoute:
    """A whole route from an engine output, before layer selection."""

    route: np.ndarray  # (T-1, layers, K) integers
    num_experts: int | None
    moe_layers: tuple[int, ...] | None
    token_ids: np.ndarray | None
    source: str


def decode_sglang_json(body: bytes) -> EngineRoute:
    """SGLang-style `{"routed_experts": base64 int32, "num_layers", "top_k", ...}`."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"body is not JSON: {exc}", status=400) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("routed_experts"), str):
        raise InputError("JSON route needs 'routed_experts': a base64 string of int32 ids")
    try:
        raw = base64.b64decode(doc["routed_experts"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"'routed_experts' is not valid base64: {exc}") from None
    num_layers, top_k = _json_int(doc, "num_layers"), _json_int(doc, "top_k")
    if num_layers is None or top_k is None:
        raise InputError("JSON route needs integer 'num_layers' and 'top_k' (the flattened array's shape)")
    dtype_name = doc.get("dtype", "int32")
    if dtype_name not in ("int32", "int64", "int16", "uint8", "uint16"):
        raise InputError(f"'dtype' {dtype_name!r} is not an integer id type (int32 as SGLang sends)")
    dtype = np.dtype(dtype_name)
    if len(raw) % dtype.itemsize:
        raise InputError(f"'routed_experts' decodes to {len(raw)} bytes, not a whole number of {dtype_name} ids")
    ids = np.frombuffer(raw, dtype=dtype)
    if num_layers < 1 or top_k < 1 or ids.size % (num_layers * top_k):
        raise InputError(f"{ids.size} ids do not split into rows of num_layers*top_k = {num_layers}*{top_k}")
    token_ids, moe_layers = _json_int_list(doc, "token_ids"), _json_int_list(doc, "moe_layers")
    return EngineRoute(
        route=ids.reshape(-1, num_layers, top_k),
        num_experts=_json_int(doc, "num_experts"),
        moe_layers=tuple(moe_layers) if moe_layers else None,
        token_ids=np.asarray(token_ids, np.int64) if token_ids is not None else None,
        source="sglang-output",
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_int(doc: dict, key: str) -> int | None:
    value = doc.get(key)
    if value is not None and not _is_int(value):
        raise InputError(f"'{key}' must be an integer, got {value!r}")
    return value


def _json_int_list(doc: dict, key: str) -> list[int] | None:
    value = doc.get(key)
    if value is not None and not (isinstance(value, list) and all(_is_int(v) and abs(v) < 2**31 for v in value)):
        raise InputError(f"'{key}' must be a list of integers")
    return value


def engine_route_rows(
    run_id: str, request_id: str, route: EngineRoute, run_shape: RunShape | None, num_experts: int | None
) -> IncomingRows:
    """Rows for a whole-route upload; idempotent on (run, "upload/<request>", 0)."""
    layers_wanted = route.moe_layers or (run_shape.moe_layers if run_shape and route.route.shape[1] != run_shape.num_layers else None)
    experts3, moe_layers = select_moe_layers(route.route, layers_wanted)
    if run_shape is not None and route.moe_layers is None and experts3.shape[1] == run_shape.num_layers:
        moe_layers = run_shape.moe_layers
    n, num_layers, top_k = experts3.shape
    experts_n = num_experts or route.num_experts or (run_shape.num_experts if run_shape else None)
    if experts_n is None:
        raise InputError("num_experts is unknown: pass it (query parameter or JSON field) for a new run")
    try:
        shape = RunShape(num_layers, top_k, experts_n, moe_layers)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    experts = narrow_ids(experts3.reshape(n, num_layers * top_k), experts_n, what="route")
    tokens = np.full(n, -1, np.int64)
    if route.token_ids is not None:
        if len(route.token_ids) not in (n, n + 1):
            raise InputError(f"token_ids has {len(route.token_ids)} entries; a route of {n} rows needs {n} or {n + 1}")
        tokens = route.token_ids[:n].astype(np.int64)
    meta = BatchMeta(run_id=run_id, writer_id=f"upload/{request_id}", seq=0, shape=shape, source=route.source)
    return IncomingRows(
        meta=meta,
        request_ids=[request_id],
        request_index=np.zeros(n, np.int32),
        positions=np.arange(n, dtype=np.int32),
        token_ids=tokens,
        experts=experts,
        flags=np.zeros(n, np.uint16),
    )
