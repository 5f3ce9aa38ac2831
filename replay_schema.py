"""The routing-row format: Arrow schema, schema metadata, flags and id rules.

This is the one module both sides use: `capture/` writes batches with it and
`replay_service/` reads and checks them. DESIGN.md ("Wire and disk format") is
the contract; this module is its code form. It imports only numpy and pyarrow.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
NPY_MEDIA_TYPE = "application/x-npy"

SOURCES = ("vllm-plugin", "vllm-output", "sglang-output", "trainer", "synthetic")

# Run, request and writer ids travel in URL paths and name files on disk: a
# conservative charset, no path separators, no "..", bounded length.
ID_MAX_LEN = 128
ID_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,127}$")
ID_RULE = f"1-{ID_MAX_LEN} characters of A-Z a-z 0-9 . _ : @ + = -, not starting with '.' or '-', no '..'"


class Flag(enum.IntFlag):
    """Per-row flag bits (DESIGN.md, "Flags")."""

    ZERO = 1
    DUPLICATE = 2
    OUT_OF_RANGE = 4
    STALE = 8
    CONFLICT = 16
    GAP = 32
    PADDING = 64


ALL_FLAGS = tuple(Flag)
FLAG_MASK = int(sum(ALL_FLAGS))
# Bits a writer may set itself; the rest are the service's verdicts, recomputed on ingest.
WRITER_FLAGS = Flag.STALE | Flag.PADDING


def flag_names(bits: int) -> list[str]:
    return [f.name for f in ALL_FLAGS if bits & f]


def parse_flag(name: str) -> Flag:
    try:
        return Flag[name.upper()]
    except KeyError:
        raise ValueError(f"unknown flag {name!r}; flags are {', '.join(f.name for f in ALL_FLAGS)}") from None


def valid_id(value: str) -> bool:
    return bool(ID_PATTERN.match(value)) and ".." not in value


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not valid_id(value):
        raise ValueError(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    return value


def expert_dtype(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts, else uint16; never int32 on the wire or on disk."""
    if num_experts < 1 or num_experts > 65536:
        raise ValueError(f"num_experts must be in 1..65536, got {num_experts}")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def arrow_expert_type(num_experts: int) -> pa.DataType:
    return pa.from_numpy_dtype(expert_dtype(num_experts))


def row_schema(num_layers: int, top_k: int, num_experts: int, metadata: dict[str, str] | None = None) -> pa.Schema:
    """The record-batch schema for one run's rows."""
    return pa.schema(
        [
            pa.field("request_id", pa.dictionary(pa.int32(), pa.utf8()), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
            pa.field("token_id", pa.int32(), nullable=True),
            pa.field("experts", pa.list_(arrow_expert_type(num_experts), num_layers * top_k), nullable=False),
            pa.field("flags", pa.uint16(), nullable=False),
        ],
        metadata=metadata,
    )


@dataclass(frozen=True)
class RunShape:
    """What a run's rows look like: L MoE layers, top-k, expert count, which model layers are MoE."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.top_k < 1:
            raise ValueError(f"num_layers and top_k must be >= 1, got {self.num_layers} and {self.top_k}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        expert_dtype(self.num_experts)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers lists {len(self.moe_layers)} layers but num_layers is {self.num_layers}")

    @property
    def dtype(self) -> np.dtype:
        return expert_dtype(self.num_experts)

    @property
    def row_width(self) -> int:
        return self.num_layers * self.top_k

    def schema(self, metadata: dict[str, str] | None = None) -> pa.Schema:
        return row_schema(self.num_layers, self.top_k, self.num_experts, metadata)


@dataclass(frozen=True)
class BatchMeta:
    """Schema metadata of one ingest batch (DESIGN.md)."""

    run_id: str
    writer_id: str
    seq: int
    shape: RunShape
    source: str = "synthetic"
    extra: dict[str, str] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, str]:
        return {
            **self.extra,
            "run_id": self.run_id,
            "writer_id": self.writer_id,
            "seq": str(self.seq),
            "num_layers": str(self.shape.num_layers),
            "top_k": str(self.shape.top_k),
            "num_experts": str(self.shape.num_experts),
            "moe_layers": json.dumps(list(self.shape.moe_layers)),
            "source": self.source,
        }

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> "BatchMeta":
        """Parse and validate; raises ValueError naming the missing or bad key."""
        md = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
        missing = [k for k in ("run_id", "writer_id", "seq", "num_layers", "top_k", "num_experts") if k not in md]
        if missing:
            raise ValueError(f"schema metadata lacks {', '.join(missing)}")
        ints = {}
        for key in ("seq", "num_layers", "top_k", "num_experts"):
            try:
                ints[key] = int(md[key])
            except ValueError:
                raise ValueError(f"schema metadata {key}={md[key]!r} is not an integer") from None
        if ints["seq"] < 0:
            raise ValueError(f"schema metadata seq must be >= 0, got {ints['seq']}")
        moe_layers: tuple[int, ...] = ()
        if md.get("moe_layers"):
            try:
                moe_layers = tuple(int(x) for x in json.loads(md["moe_layers"]))
            except (ValueError, TypeError):
                raise ValueError(f"schema metadata moe_layers={md['moe_layers']!r} is not a JSON list of ints") from None
        source = md.get("source", "synthetic")
        if source not in SOURCES:
            raise ValueError(f"schema metadata source={source!r} is not one of {', '.join(SOURCES)}")
        shape = RunShape(ints["num_layers"], ints["top_k"], ints["num_experts"], moe_layers)
        known = {"run_id", "writer_id", "seq", "num_layers", "top_k", "num_experts", "moe_layers", "source"}
        return cls(
            run_id=check_id("run_id", md["run_id"]),
            writer_id=check_id("writer_id", md["writer_id"]),
            seq=ints["seq"],
            shape=shape,
            source=source,
            extra={k: v for k, v in md.items() if k not in known},
        )


def build_batch(
    meta: BatchMeta,
    request_ids: list[str] | np.ndarray | pa.Array,
    positions: np.ndarray,
    experts: np.ndarray,
    token_ids: np.ndarray | None = None,
    flags: np.ndarray | None = None,
) -> pa.RecordBatch:
    """Build one record batch; `experts` is `(n, L, K)` (or `(n, L*K)`) in the run's dtype."""
    shape = meta.shape
    experts = np.ascontiguousarray(experts)
    n = experts.shape[0]
    if experts.dtype != shape.dtype:
        raise ValueError(f"experts dtype {experts.dtype} != run dtype {shape.dtype}")
    if experts.size != n * shape.row_width:
        raise ValueError(f"experts of shape {experts.shape} do not hold {n} rows of {shape.row_width} ids")
    if isinstance(request_ids, pa.DictionaryArray):
        req = request_ids
    else:
        req = pa.array(request_ids, pa.utf8()).dictionary_encode()
    values = pa.array(experts.reshape(-1), pa.from_numpy_dtype(shape.dtype))
    arrays = [
        req,
        pa.array(np.asarray(positions, np.int32)),
        pa.array(np.asarray(token_ids, np.int32)) if token_ids is not None else pa.nulls(n, pa.int32()),
        pa.FixedSizeListArray.from_arrays(values, shape.row_width),
        pa.array(np.zeros(n, np.uint16) if flags is None else np.asarray(flags, np.uint16)),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=shape.schema(meta.to_metadata()))


def experts_view(column: pa.FixedSizeListArray, shape: RunShape) -> np.ndarray:
    """Zero-copy `(n, L, K)` numpy view of an `experts` column (read-only when Arrow owns the memory)."""
    values = column.values
    if column.offset:
        values = values.slice(column.offset * shape.row_width, len(column) * shape.row_width)
    flat = values.to_numpy(zero_copy_only=True)
    return flat.reshape(len(column), shape.num_layers, shape.top_k)


def encode_stream(batches: list[pa.RecordBatch] | pa.RecordBatch, schema: pa.Schema | None = None) -> bytes:
    """Serialize batches as one Arrow IPC stream."""
    if isinstance(batches, pa.RecordBatch):
        batches = [batches]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema or batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()
