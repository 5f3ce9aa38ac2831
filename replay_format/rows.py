"""Row batches: the one Arrow format for routing rows (spec: rows.md).

Writers build them (`build_rows`: the capture sender, the trainer's compare body, the
demo); the service reads them (`read_rows_stream` + `RowsMeta.from_metadata` +
`read_rows`) and writes the same schema to its segment files (`Rows.to_record_batch`,
with the metadata of `replay_format.segment`, segment.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from replay_format.core import (
    FLAG_MASK,
    NO_TOKEN,
    Flag,
    FormatError,
    FormatVersion,
    RunShape,
    Source,
    UndecodableError,
    check_id,
    decode_metadata,
    expert_dtype,
    metadata_int,
    metadata_version,
)
from replay_format.weight_versions import COLUMN_TYPE as WEIGHT_COLUMN_TYPE
from replay_format.weight_versions import WeightVersions

FORMAT = "routing-replay.rows"
# 2.1 added the optional num_hidden_layers; 2.2, 2.3 and 2.4 changed segment files only (segment.md, which has
# its own version since); 2.5 added the optional weight_version column (weight_versions.py)
VERSION = FormatVersion(2, 5)
LEGACY_VERSION = FormatVersion(1, 0)  # no format_version key; `num_layers` where 2.0 says `num_moe_layers`
COLUMNS = ("request_id", "position", "token_id", "experts", "flags")
VERSION_COLUMN = "weight_version"  # optional since 2.5: which weights computed each row (weight_versions.py)
POSITION_MAX = 2**31 - 2


def rows_schema(shape: RunShape, metadata: dict[str, str] | None = None) -> pa.Schema:
    """The record-batch schema of one run's rows."""
    return pa.schema(
        [
            pa.field("request_id", pa.dictionary(pa.int32(), pa.utf8()), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
            pa.field("token_id", pa.int32(), nullable=True),
            pa.field("experts", pa.list_(shape.arrow_type, shape.row_width), nullable=False),
            pa.field("flags", pa.uint16(), nullable=False),
        ],
        metadata=metadata,
    )


def shape_metadata(shape: RunShape) -> dict[str, str]:
    """The run-shape keys every rows-like message carries."""
    return {
        "num_moe_layers": str(shape.num_moe_layers),
        "top_k": str(shape.top_k),
        "num_experts": str(shape.num_experts),
        "moe_layers": json.dumps(list(shape.moe_layers)),
        "num_hidden_layers": str(shape.num_hidden_layers),
    }


def shape_from_metadata(md: dict[str, str], what: str, version: FormatVersion = VERSION) -> RunShape:
    """The run shape named by `shape_metadata` keys (1.x called num_moe_layers num_layers)."""
    layers_key = "num_layers" if version.major < 2 else "num_moe_layers"
    num_moe_layers = metadata_int(md, layers_key, what, 1, 65535)
    top_k = metadata_int(md, "top_k", what, 1, 65535)
    num_experts = metadata_int(md, "num_experts", what, 1, 65536)
    moe_layers: tuple[int, ...] = ()
    if md.get("moe_layers"):
        try:
            parsed = json.loads(md["moe_layers"])
            if not isinstance(parsed, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in parsed):
                raise ValueError
            moe_layers = tuple(parsed)
        except (ValueError, RecursionError):
            text = md["moe_layers"][:100]
            raise FormatError(f"{what}: schema metadata moe_layers={text!r} is not a JSON list of ints") from None
    hidden = metadata_int(md, "num_hidden_layers", what, 1, 65535) if "num_hidden_layers" in md else 0
    try:
        return RunShape(num_moe_layers, top_k, num_experts, moe_layers, hidden)
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class RowsMeta:
    """Schema metadata of one row batch (rows.md, "Metadata")."""

    run_id: str
    writer_id: str
    seq: int
    shape: RunShape
    source: Source = Source.SYNTHETIC
    version: FormatVersion = VERSION
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", Source(self.source))  # a plain string names one too

    def to_metadata(self) -> dict[str, str]:
        """The metadata dict written into the schema (always the current version)."""
        return {
            **self.extra,
            "format": FORMAT,
            "format_version": str(VERSION),
            "run_id": self.run_id,
            "writer_id": self.writer_id,
            "seq": str(self.seq),
            **shape_metadata(self.shape),
            "source": self.source.value,
        }

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> RowsMeta:
        """Parse and validate decoded metadata; FormatError naming the missing or bad key."""
        what = "row batch"
        version = metadata_version(md, what, VERSION, LEGACY_VERSION)
        missing = [k for k in ("run_id", "writer_id", "seq") if k not in md]
        if missing:
            raise FormatError(f"{what}: schema metadata lacks {', '.join(missing)}")
        try:
            source = Source(md.get("source", Source.SYNTHETIC.value))
        except ValueError:
            raise FormatError(
                f"{what}: schema metadata source={md['source']!r} is not one of {', '.join(s.value for s in Source)}"
            ) from None
        known = {"format", "format_version", "run_id", "writer_id", "seq", "num_layers", "num_moe_layers", "top_k",
                 "num_experts", "moe_layers", "num_hidden_layers", "source"}
        return cls(
            run_id=check_id("run_id", md["run_id"]),
            writer_id=check_id("writer_id", md["writer_id"]),
            seq=metadata_int(md, "seq", what),
            shape=shape_from_metadata(md, what, version),
            source=source,
            version=version,
            extra={k: v for k, v in md.items() if k not in known},
        )


@dataclass
class Rows:
    """One row batch in memory: ids in the run dtype, request ids as a dictionary."""

    meta: RowsMeta
    request_ids: list[str]  # the dictionary
    request_index: np.ndarray  # int32 (n,): index into request_ids per row
    positions: np.ndarray  # int32 (n,)
    token_ids: np.ndarray  # int32 (n,), NO_TOKEN where unknown
    experts: np.ndarray  # (n, L*K) run dtype
    flags: np.ndarray  # uint16 (n,)
    weight_versions: WeightVersions | None = None  # None: the batch has no weight_version column (all unknown)

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    def take(self, index: np.ndarray) -> Rows:
        """These rows at `index` (a bool mask or row numbers), same dictionary."""
        versions = None if self.weight_versions is None else self.weight_versions.take(index)
        return replace(self, request_index=self.request_index[index], positions=self.positions[index],
                       token_ids=self.token_ids[index], experts=self.experts[index], flags=self.flags[index],
                       weight_versions=versions)

    def versions(self) -> WeightVersions:
        """Each row's weight version (all unknown when the batch carries none)."""
        return WeightVersions.unknown(self.num_rows) if self.weight_versions is None else self.weight_versions

    def to_record_batch(self, flags: np.ndarray | None = None,
                        metadata: dict[str, str] | None = None) -> pa.RecordBatch:
        """The rows as a record batch (`flags` replaces theirs; the service writes its verdicts)."""
        return build_rows(self.meta.shape, (self.request_ids, self.request_index), self.positions, self.experts,
                          self.token_ids, self.flags if flags is None else flags, metadata, self.weight_versions)


RequestIds = Any  # one id per row (list/array of str), a pyarrow DictionaryArray, or (names, int index per row)


def request_dictionary(request_ids: RequestIds, n: int) -> pa.DictionaryArray:
    """Any accepted spelling of per-row request ids as a dictionary<int32, utf8> array."""
    if isinstance(request_ids, pa.DictionaryArray):
        array = request_ids
    elif isinstance(request_ids, tuple):
        names, index = request_ids
        array = pa.DictionaryArray.from_arrays(pa.array(np.asarray(index, np.int32)), pa.array(list(names), pa.utf8()))
    else:
        array = pa.array(list(request_ids), pa.utf8()).dictionary_encode()
    if len(array) != n:
        raise FormatError(f"{len(array)} request ids for {n} rows")
    return array


def token_array(token_ids: np.ndarray | None, n: int) -> pa.Array:
    """The `token_id` column: NO_TOKEN (or any negative id) becomes an Arrow null."""
    if token_ids is None:
        return pa.nulls(n, pa.int32())
    tokens = np.asarray(token_ids)
    missing = tokens < 0
    values = tokens.astype(np.int32, copy=False)
    return pa.array(values, mask=missing) if missing.any() else pa.array(values)


def build_rows(
    meta_or_shape: RowsMeta | RunShape,
    request_ids: RequestIds,
    positions: np.ndarray,
    experts: np.ndarray,
    token_ids: np.ndarray | None = None,
    flags: np.ndarray | None = None,
    metadata: dict[str, str] | None = None,
    weight_versions: WeightVersions | None = None,
) -> pa.RecordBatch:
    """One record batch; `experts` is `(n, L, K)` or `(n, L*K)` in the run's dtype.

    With a `RowsMeta` the batch carries its metadata (what ingest needs); with a bare
    `RunShape` the format, its version and `metadata` (a segment passes `segment.SegmentMeta.to_metadata()`).
    `weight_versions` (one per row) adds the `weight_version` column; without it the batch has none.
    """
    if isinstance(meta_or_shape, RowsMeta):
        shape, md = meta_or_shape.shape, meta_or_shape.to_metadata()
    else:
        shape, md = meta_or_shape, {"format": FORMAT, "format_version": str(VERSION), **(metadata or {})}
    arrays = row_arrays(shape, request_ids, positions, experts, token_ids, flags, weight_versions)
    schema = rows_schema(shape, md)
    if weight_versions is not None:
        schema = schema.append(pa.field(VERSION_COLUMN, WEIGHT_COLUMN_TYPE))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def row_arrays(shape: RunShape, request_ids: RequestIds, positions: np.ndarray, experts: np.ndarray,
               token_ids: np.ndarray | None = None, flags: np.ndarray | None = None,
               weight_versions: WeightVersions | None = None) -> list[pa.Array]:
    """The columns of `build_rows`, in `rows_schema` order, `weight_version` last when given: for a writer that
    holds its schema already (a route answer's batches share one)."""
    experts = np.ascontiguousarray(experts)
    n = experts.shape[0]
    if experts.dtype != shape.dtype:
        raise FormatError(f"experts dtype {experts.dtype} != run dtype {shape.dtype}")
    if experts.size != n * shape.row_width:
        raise FormatError(f"experts of shape {experts.shape} do not hold {n} rows of {shape.row_width} ids")
    arrays = [
        request_dictionary(request_ids, n),
        pa.array(np.asarray(positions, np.int32)),
        token_array(token_ids, n),
        pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1), shape.arrow_type), shape.row_width),
        pa.array(np.zeros(n, np.uint16) if flags is None else np.asarray(flags, np.uint16)),
    ]
    if weight_versions is not None:
        if weight_versions.num_rows != n:
            raise FormatError(f"{weight_versions.num_rows} weight versions for {n} rows")
        arrays.append(weight_versions.to_arrow())
    return arrays


def encode_stream(batches: list[pa.RecordBatch] | pa.RecordBatch, schema: pa.Schema | None = None) -> bytes:
    """Batches as one Arrow IPC stream."""
    if isinstance(batches, pa.RecordBatch):
        batches = [batches]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema or batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def read_stream(body: bytes | memoryview) -> tuple[pa.Table, dict[str, str]]:
    """An Arrow IPC stream fully validated (offsets, dictionary indices, UTF-8) and its decoded metadata.

    A damaged stream is an UndecodableError naming what is wrong, never an exception deeper in.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        table.validate(full=True)
        table.schema.names  # noqa: B018 - field names must decode as UTF-8
    except (pa.ArrowException, OSError) as exc:
        raise UndecodableError(f"body is not a valid Arrow IPC stream: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UndecodableError(f"body is not a valid Arrow IPC stream: a name is not UTF-8 ({exc})") from None
    try:
        md = decode_metadata(table.schema.metadata, "Arrow stream")
    except FormatError as exc:
        raise UndecodableError(f"body is not a valid Arrow IPC stream: {exc}") from None
    return table, md


def _integer_column(column: pa.Array, name: str, allow_null: bool) -> np.ndarray:
    if not pa.types.is_integer(column.type):
        raise FormatError(f"column {name!r} has type {column.type}, expected an integer type")
    if column.null_count and not allow_null:
        raise FormatError(f"column {name!r} has {column.null_count} null values")
    if column.null_count:
        return column.fill_null(NO_TOKEN).to_numpy().astype(np.int64)
    return column.to_numpy(zero_copy_only=False)


def narrow_ids(values: np.ndarray, num_experts: int, usable: np.ndarray | None = None,
               what: str = "experts") -> np.ndarray:
    """Integer ids narrowed to uint8/uint16; an id that does not fit is a FormatError, never wrapped.

    `usable` masks the rows whose content matters (padding rows are dropped later).
    """
    dtype = expert_dtype(num_experts)
    if values.dtype == dtype:
        return values
    if not np.issubdtype(values.dtype, np.integer):
        raise FormatError(f"{what} must hold integer ids, got {values.dtype}")
    checked = values if usable is None else values[usable]
    if checked.size:
        low, high = int(checked.min()), int(checked.max())
        if low < 0 or high > np.iinfo(dtype).max:
            raise FormatError(
                f"{what} holds id {low if low < 0 else high}, which does not fit {dtype} (num_experts={num_experts}); "
                "mark padding rows with the PADDING flag instead of writing -1"
            )
    return values.astype(dtype)


def _request_column(column: pa.Array) -> tuple[list[str], np.ndarray]:
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.dictionary_encode()
    elif not (pa.types.is_dictionary(column.type)
              and (pa.types.is_string(column.type.value_type) or pa.types.is_large_string(column.type.value_type))):
        raise FormatError(f"column 'request_id' has type {column.type}, expected dictionary<int32, utf8>")
    if column.null_count:
        raise FormatError("column 'request_id' has null values")
    request_ids = [str(v) for v in column.dictionary.to_pylist()]
    request_index = column.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    for i in np.unique(request_index):
        check_id("request_id", request_ids[i])
    if len(set(request_ids)) != len(request_ids):
        # A dictionary with repeated strings: fold it so one request has one index.
        remap = {rid: k for k, rid in enumerate(dict.fromkeys(request_ids))}
        request_index = np.array([remap[r] for r in request_ids], np.int32)[request_index]
        request_ids = list(remap)
    return request_ids, request_index


def read_rows(table: pa.Table, meta: RowsMeta) -> Rows:
    """A validated table of rows in the shape `meta` names; FormatError naming the first problem."""
    shape = meta.shape
    names = table.schema.names
    if len(set(names)) != len(names):
        raise FormatError(f"schema repeats a column: {names}")
    for required in ("request_id", "position", "experts"):
        if required not in names:
            raise FormatError(f"schema lacks column {required!r}; columns are {names}")
    unknown = set(names) - {*COLUMNS, VERSION_COLUMN}
    if unknown:
        raise FormatError(f"schema has unknown columns {sorted(unknown)}")
    if table.num_rows == 0:
        raise FormatError("batch holds no rows")
    table = table.combine_chunks()
    n = table.num_rows

    experts_col = table.column("experts").chunk(0)
    if not pa.types.is_fixed_size_list(experts_col.type):
        raise FormatError(f"column 'experts' has type {experts_col.type}, expected fixed_size_list<uint8|uint16>[L*K]")
    width = experts_col.type.list_size
    if width != shape.row_width:
        raise FormatError(
            f"column 'experts' holds {width} ids per row but num_moe_layers*top_k = "
            f"{shape.num_moe_layers}*{shape.top_k} = {shape.row_width}"
        )
    if experts_col.null_count or experts_col.values.null_count:
        raise FormatError("column 'experts' has null rows or ids")
    if not pa.types.is_integer(experts_col.values.type):
        raise FormatError(f"column 'experts' holds {experts_col.values.type}, expected uint8 or uint16 ids")

    request_ids, request_index = _request_column(table.column("request_id").chunk(0))
    positions = _integer_column(table.column("position").chunk(0), "position", allow_null=False)
    if positions.min() < 0 or positions.max() > POSITION_MAX:
        raise FormatError(f"column 'position' holds {int(positions.min())}..{int(positions.max())}; "
                          f"positions are 0..{POSITION_MAX}")
    positions = positions.astype(np.int32, copy=False)
    token_ids = np.full(n, NO_TOKEN, np.int32)
    if "token_id" in names:
        tokens = _integer_column(table.column("token_id").chunk(0), "token_id", allow_null=True)
        if tokens.size and (tokens.min() < NO_TOKEN or tokens.max() > 2**31 - 1):
            raise FormatError("column 'token_id' holds ids outside 0..2**31-1")
        token_ids = tokens.astype(np.int32)
    flags = np.zeros(n, np.uint16)
    if "flags" in names:
        given = _integer_column(table.column("flags").chunk(0), "flags", allow_null=False)
        if int(given.min()) < 0 or int(np.bitwise_or.reduce(given.astype(np.int64))) & ~FLAG_MASK:
            raise FormatError(f"column 'flags' sets bits outside the defined flags (mask {FLAG_MASK})")
        flags = given.astype(np.uint16)

    flat = experts_col.values.to_numpy(zero_copy_only=False)
    if experts_col.offset:
        flat = flat[experts_col.offset * width : (experts_col.offset + n) * width]
    experts = narrow_ids(flat.reshape(n, width), shape.num_experts, usable=(flags & Flag.PADDING) == 0)
    versions = WeightVersions.from_arrow(table.column(VERSION_COLUMN).chunk(0)) if VERSION_COLUMN in names else None
    return Rows(meta, request_ids, request_index, positions, token_ids, experts, flags, versions)


def experts_view(column: pa.FixedSizeListArray, shape: RunShape) -> np.ndarray:
    """Zero-copy `(n, L, K)` numpy view of an `experts` column (read-only when Arrow owns the memory)."""
    values = column.values
    if column.offset:
        values = values.slice(column.offset * shape.row_width, len(column) * shape.row_width)
    flat = values.to_numpy(zero_copy_only=True)
    return flat.reshape(len(column), shape.num_moe_layers, shape.top_k)
