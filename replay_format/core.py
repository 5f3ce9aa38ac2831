"""What every format shares: flags, ids, the expert dtype, a run's shape, versions, errors.

Imports only numpy and pyarrow: the inference worker, the sink process, the service and the trainer all import it.
Each message format is a module beside this one with its spec (`<name>.md`) next to it; `README.md` lists them.

Vocabulary (one meaning per word, in code, on the wire and in the API):
- *model layer*: index of a decoder layer in the model, `0 .. num_hidden_layers-1`.
- *MoE layer*: a model layer with a router. `moe_layers` lists their model-layer indices; a row holds
  `num_moe_layers` of them, in that order.
- *MoE ordinal*: position in `moe_layers` (`0 .. num_moe_layers-1`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
NPY_MEDIA_TYPE = "application/x-npy"
JSON_MEDIA_TYPE = "application/json"

# In memory a missing input token id is NO_TOKEN in an int32 array; on the wire it is an
# Arrow null in the nullable int32 `token_id` column. Nothing else spells it.
NO_TOKEN = -1

# Run, request and writer ids travel in URL paths and name files on disk: a
# conservative charset, no path separators, no "..", bounded length.
ID_MAX_LEN = 128
ID_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,127}$")
ID_RULE = f"1-{ID_MAX_LEN} characters of A-Z a-z 0-9 . _ : @ + = -, not starting with '.' or '-', no '..'"


class FormatError(ValueError):
    """Bytes or metadata that do not follow a format's spec; the message names what is wrong."""


class ReplayDeprecationWarning(DeprecationWarning):
    """A name, or a way of reading an answer, that routing-replay keeps for one release more; the message names
    what to use instead. Its own category, so a user's filter (and the project's own tests) can turn exactly these
    into errors."""


class UndecodableError(FormatError):
    """The bytes are not the container the format needs at all (not Arrow IPC, not .npy, not JSON)."""


class Flag(enum.IntFlag):
    """Per-row flag bits (rows.md, "Flags"). `web/js/dom.js` mirrors this table (a test ties them)."""

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
    """The names of the flags set in `bits`, in bit order."""
    return [f.name for f in ALL_FLAGS if bits & f and f.name is not None]


def parse_flag(name: str) -> Flag:
    """A flag by name (any case); FormatError naming the known flags otherwise."""
    try:
        return Flag[name.upper()]
    except KeyError:
        raise FormatError(f"unknown flag {name!r}; flags are {', '.join(flag_names(FLAG_MASK))}") from None


class Source(enum.StrEnum):
    """Who produced a batch of rows."""

    VLLM_PLUGIN = "vllm-plugin"
    VLLM_OUTPUT = "vllm-output"
    SGLANG_OUTPUT = "sglang-output"
    TRAINER = "trainer"
    SYNTHETIC = "synthetic"


class LayerAxis(enum.StrEnum):
    """Which layers a read's rows hold: the stored MoE layers, or every model layer (dense ones zero, like vLLM)."""

    MOE = "moe"
    MODEL = "model"


def valid_id(value: str) -> bool:
    """True when `value` follows ID_RULE."""
    return isinstance(value, str) and bool(ID_PATTERN.match(value)) and ".." not in value


def check_id(kind: str, value: str) -> str:
    """`value` if it is a valid id, else FormatError naming `kind` and the rule."""
    if not valid_id(value):
        raise FormatError(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    return value


def expert_dtype(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts, else uint16; never int32 on the wire or on disk."""
    if num_experts < 1 or num_experts > 65536:
        raise FormatError(f"num_experts must be in 1..65536, got {num_experts}")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@dataclass(frozen=True)
class RunShape:
    """What a run's rows look like: `num_moe_layers` x top-k ids of `num_experts`, and which model layers those are.

    `num_hidden_layers` is the model's layer count (dense layers included): what a read on the
    model-layer axis returns, as vLLM's and SGLang's `routed_experts` do. 0 means unknown, taken
    as `max(moe_layers) + 1`.
    """

    num_moe_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...] = ()
    num_hidden_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_moe_layers < 1 or self.top_k < 1:
            raise FormatError(f"num_moe_layers and top_k must be >= 1, got {self.num_moe_layers} and {self.top_k}")
        if self.top_k > self.num_experts:
            raise FormatError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        expert_dtype(self.num_experts)
        layers = tuple(int(x) for x in self.moe_layers) or tuple(range(self.num_moe_layers))
        object.__setattr__(self, "moe_layers", layers)
        if len(layers) != self.num_moe_layers:
            raise FormatError(f"moe_layers lists {len(layers)} layers but num_moe_layers is {self.num_moe_layers}")
        if min(layers) < 0 or any(b <= a for a, b in zip(layers, layers[1:])):
            raise FormatError(f"moe_layers {list(layers)} must be increasing model-layer indices >= 0")
        hidden = self.num_hidden_layers or layers[-1] + 1
        if hidden <= layers[-1]:
            raise FormatError(f"moe_layers {list(layers)} do not fit num_hidden_layers={hidden}")
        object.__setattr__(self, "num_hidden_layers", hidden)

    @property
    def dtype(self) -> np.dtype:
        return expert_dtype(self.num_experts)

    @property
    def arrow_type(self) -> pa.DataType:
        return pa.from_numpy_dtype(self.dtype)

    @property
    def row_width(self) -> int:
        return self.num_moe_layers * self.top_k

    def to_model_axis(self, experts: np.ndarray) -> np.ndarray:
        """`(n, num_moe_layers, K)` ids as `(n, num_hidden_layers, K)`, dense layers all zero (vLLM's layout)."""
        n = experts.shape[0]
        out = np.zeros((n, self.num_hidden_layers, self.top_k), experts.dtype)
        out[:, list(self.moe_layers)] = experts.reshape(n, self.num_moe_layers, self.top_k)
        return out


@dataclass(frozen=True, order=True)
class FormatVersion:
    """`major.minor`: a reader takes every minor of the majors it knows and refuses the rest."""

    major: int
    minor: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @classmethod
    def parse(cls, text: str, what: str) -> FormatVersion:
        """`"2.0"` -> FormatVersion(2, 0); FormatError naming `what` otherwise."""
        major, dot, minor = text.partition(".")
        if not (major.isdigit() and (not dot or minor.isdigit())):
            raise FormatError(f"{what}: format_version {text!r} is not MAJOR.MINOR")
        return cls(int(major), int(minor or 0))

    def check(self, what: str, known: FormatVersion) -> FormatVersion:
        """self, when a reader of `known` can read it (same major or older); else FormatError."""
        if self.major > known.major:
            raise FormatError(
                f"{what}: format_version {self} is newer than this reader knows ({known.major}.x); "
                "upgrade routing-replay on the reading side"
            )
        return self


def decode_metadata(metadata: dict[bytes, bytes] | None, what: str) -> dict[str, str]:
    """Arrow schema metadata as text; FormatError when a key or value is not UTF-8."""
    try:
        return {k.decode(): v.decode() for k, v in (metadata or {}).items()}
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what}: schema metadata is not UTF-8 ({exc})") from None


def metadata_int(md: dict[str, str], key: str, what: str, low: int = 0, high: int = 2**63 - 1) -> int:
    """An integer metadata value in [low, high]; FormatError naming the key otherwise."""
    if key not in md:
        raise FormatError(f"{what}: schema metadata lacks {key}")
    try:
        value = int(md[key])
    except ValueError:
        raise FormatError(f"{what}: schema metadata {key}={md[key]!r} is not an integer") from None
    if not low <= value <= high:
        raise FormatError(f"{what}: schema metadata {key}={value} is outside {low}..{high}")
    return value


def metadata_version(md: dict[str, str], what: str, known: FormatVersion, legacy: FormatVersion) -> FormatVersion:
    """The message's format_version (`legacy` when absent: written before versions existed), checked."""
    text = md.get("format_version")
    version = legacy if text is None else FormatVersion.parse(text, what)
    return version.check(what, known)


# A received body that readers hand out views of: a `bytearray`, or a 1-D uint8 numpy array (`np.empty`
# skips the zero-fill `bytearray(n)` pays: ~1 ms per MB on the bench machine, most of a large read's client time).
Backing = bytearray | np.ndarray


def writable_view(array: pa.Array, backing: Backing) -> np.ndarray:
    """A writable numpy view of a primitive Arrow array whose values lie inside `backing`.

    Readers of a received body (a buffer the client filled) hand out arrays that view it, so
    `torch.from_numpy` shares that memory too. Nulls are not looked at: callers fill them first.
    An array whose values are not inside `backing` (never for a stream read from it) is copied.
    """
    dtype = np.dtype(array.type.to_pandas_dtype())
    data = array.buffers()[1]
    base = np.frombuffer(backing, np.uint8).ctypes.data if len(backing) else 0
    start = (data.address - base + array.offset * dtype.itemsize) if data is not None else -1
    if len(array) and 0 <= start and start + len(array) * dtype.itemsize <= len(backing):
        return np.frombuffer(backing, dtype=dtype, count=len(array), offset=start)
    return np.array(array.to_numpy(zero_copy_only=False), dtype=dtype)  # a fresh, writable copy


def token_ids(tokens: pa.Array, backing: Backing | None = None) -> np.ndarray:
    """A `token_id` column as int32 with NO_TOKEN where null.

    No nulls: the column's own values (a writable view of `backing` when given, as `writable_view`).
    All null (a writer that sends no token ids): filled directly, no Arrow kernel. Some null: filled copy.
    """
    if not tokens.null_count:
        return writable_view(tokens, backing) if backing is not None else tokens.to_numpy()
    if tokens.null_count == len(tokens):
        return np.full(len(tokens), NO_TOKEN, np.int32)
    return np.array(tokens.fill_null(NO_TOKEN).to_numpy(zero_copy_only=False), np.int32)  # writable, as views are


class IpcParts:
    """A write-only file for `pa.ipc.new_stream` that keeps what Arrow hands it, uncopied.

    Arrow writes small framing as `bytes` and each large column buffer as the array's own
    `pa.Buffer`: the parts reference the arrays, so an answer reaches the socket without
    another copy of its ids. `take()` hands over what was written since the last call.
    """

    closed = False

    def __init__(self) -> None:
        self.parts: list[memoryview] = []

    def write(self, data) -> int:
        """Keep one piece (Arrow's calling convention for a file object)."""
        self.parts.append(memoryview(data))
        return len(self.parts[-1])

    def flush(self) -> None:
        """Nothing buffered."""

    def close(self) -> None:
        """Arrow closes the sink when the stream ends."""
        self.closed = True

    def take(self) -> list[memoryview]:
        """The parts written since the last `take`."""
        out, self.parts = self.parts, []
        return out


def ipc_stream_parts(schema: pa.Schema, batches) -> Iterator[list[memoryview]]:
    """An Arrow IPC stream of `batches` (any iterable, read lazily) as the parts of each batch in turn.

    The first list holds the schema and the first batch, the last the end-of-stream marker;
    a server streams them as they come, without holding every batch at once.
    """
    sink = IpcParts()
    writer = pa.ipc.new_stream(sink, schema)
    for batch in batches:
        writer.write_batch(batch)
        yield sink.take()
    writer.close()
    yield sink.take()
