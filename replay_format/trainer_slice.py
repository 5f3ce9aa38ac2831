"""Trainer slices: one rank's router tokens with their recorded ids (spec: trainer_slice.md).

The service builds them (`build_slice`: the answer of `POST /v1/trainer/megatron` and
`POST /v1/trainer/verl`); the trainer reads them (`read_slice`). One row per router token of
the rank, in the order its router sees them, with the weight version of the row replayed; the
metadata (`SliceMeta`) names the layers held (on the MoE or the model-layer axis), the
missing-row policy that produced it, the version labels, and the token layout (`SliceLayout`)
the rows follow. (Over 400 lines on purpose: the layout's typed fields,
their JSON form and their checks are one description of one message; split, the slice's
metadata would be read in two places.)
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from replay_format.core import (
    Backing,
    FormatError,
    FormatVersion,
    LayerAxis,
    UndecodableError,
    decode_metadata,
    expert_dtype,
    ipc_stream_parts,
    metadata_int,
    writable_view,
)
from replay_format.weight_versions import UNKNOWN, check_label

FORMAT = "routing-replay.trainer-slice"
VERSION = FormatVersion(1, 2)
COLUMNS = ("experts", "valid", "sequence", "position")  # required; 1.1 adds `fallback` (absent in 1.0: zeros)
VERSION_COLUMN = "weight_version"  # 1.2: int16 index into the metadata's `weight_versions`, -1 unknown (absent: all)
VERSION_TYPE = np.int16
WHAT = "trainer slice"


class LayoutKind(enum.StrEnum):
    """Which trainer's token layout the rows follow."""

    MEGATRON = "megatron"  # megatron-core RouterReplay: one rank's router tokens (THD or BSHD, CP and SP slices)
    VERL = "verl"  # verl's dense [batch, prompt_width + response_width]


class Packing(enum.StrEnum):
    """How Megatron lays a micro-batch's sequences out."""

    THD = "thd"  # packed back to back, each padded to a multiple
    BSHD = "bshd"  # [b, s] right-padded to one length, seen by the router sequence-first


class CpSplit(enum.StrEnum):
    """How context parallelism splits the tokens over CP ranks."""

    ZIGZAG = "zigzag"  # each (padded) sequence in 2*cp chunks, rank r keeps r and 2cp-1-r (megatron-core, verl)
    CONTIGUOUS = "contiguous"  # the whole padded stream in cp contiguous parts (slime/miles --allgather-cp)


class TotalPad(enum.StrEnum):
    """Where the tokens that pad the whole micro-batch to `total_multiple` go."""

    LAST_SEQUENCE = "last_sequence"  # the last sequence absorbs them before the CP split (verl fp8, NeMo-RL)
    TAIL = "tail"  # after the CP split, at the end of every CP rank's stream (slime, miles)


class Convention(enum.StrEnum):
    """A trainer whose THD packing rule the service applies (fixes pad_multiple, total_multiple, total_pad)."""

    VERL = "verl"  # preprocess_packed_seqs / preprocess_thd_engine (verl 0.9.1), fp8 padding optional
    SLIME = "slime"  # prepare_routed_experts_for_routing_replay (slime/backends/megatron_utils/cp_utils.py)
    MILES = "miles"  # fill_replay_data (miles/backends/training_utils/replay_data.py): slime's rule


class MissingPolicy(enum.StrEnum):
    """What a real token gets when its recorded row is flagged or missing (padding and last tokens: always filler)."""

    STRICT = "strict"  # refuse the slice (409) naming the rows: the default, safe without trainer cooperation
    ROUTER = "router"  # `fallback == 1`: the trainer's router picks that token's experts itself (NeMo-RL's -1)
    FILLER = "filler"  # filler ids, valid 0: the token's hidden state then differs from the rollout's


@dataclass(frozen=True)
class SliceLayout:
    """The token layout of a slice (trainer_slice.md, "Layout"); `kind` says which fields apply."""

    kind: LayoutKind
    tokens: int  # router tokens in this slice: the rows
    total_tokens: int  # router tokens of the whole micro-batch over all ranks
    seq_length: int  # BSHD: padded length S; THD: padded tokens in all; verl: prompt_width + response_width
    sequences: int  # sequences in the micro-batch (verl: the batch size)
    cu_seqlens: list[int] = field(default_factory=list)  # THD: cumulative real lengths
    cu_seqlens_padded: list[int] = field(default_factory=list)  # THD: cumulative padded lengths
    # megatron
    packing: Packing | None = None
    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1  # TP size; the tokens are split over it when sequence_parallel (1.0: the SP size)
    tp_rank: int = 0
    # megatron, 1.1 (a 1.0 slice reads as the defaults, which is what 1.0 did)
    sequence_parallel: bool = True
    cp_split: CpSplit = CpSplit.ZIGZAG
    pad_multiple: int = 1  # THD: each sequence padded to a multiple of this
    total_multiple: int = 1  # THD: the whole micro-batch (all CP ranks) padded to a multiple of this
    total_pad: TotalPad = TotalPad.LAST_SEQUENCE
    convention: Convention | None = None  # the preset that chose the four fields above, if any
    # verl
    prompt_width: int = 0
    response_width: int = 0
    prompt_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))
        for name, kind in (("packing", Packing), ("convention", Convention)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "cp_split", CpSplit(self.cp_split))
        object.__setattr__(self, "total_pad", TotalPad(self.total_pad))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the `layout` metadata key: the common fields and those of its kind."""
        drop = _VERL_FIELDS if self.kind is LayoutKind.MEGATRON else _MEGATRON_FIELDS | _MEGATRON_OPTIONAL
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in drop}  # flat: no deep copy
        return {k: (v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, list) else v)
                for k, v in doc.items()}

    @classmethod
    def from_dict(cls, doc: Any) -> SliceLayout:
        """Parse the `layout` object; FormatError naming a missing or bad field (unknown fields are ignored)."""
        if not isinstance(doc, dict):
            raise FormatError(f"{WHAT}: layout is not a JSON object")
        try:
            kind = LayoutKind(str(doc.get("kind")))
        except ValueError:
            raise FormatError(f"{WHAT}: layout kind {doc.get('kind')!r} is not one of "
                              f"{', '.join(k.value for k in LayoutKind)}") from None
        wanted = _COMMON_FIELDS | (_MEGATRON_FIELDS if kind is LayoutKind.MEGATRON else _VERL_FIELDS)
        missing = sorted(wanted - doc.keys())
        if missing:
            raise FormatError(f"{WHAT}: a {kind.value} layout lacks {', '.join(missing)}")
        optional = _MEGATRON_OPTIONAL if kind is LayoutKind.MEGATRON else frozenset()
        values = {k: doc[k] for k in wanted | (optional & doc.keys())}
        for name, value in values.items():
            if name in _LIST_FIELDS:
                ok = isinstance(value, list) and all(_is_int(x) for x in value)
            elif name in _ENUM_FIELDS:
                ok = value in {e.value for e in _ENUM_FIELDS[name]} or (name == "convention" and value is None)
            elif name == "sequence_parallel":
                ok = isinstance(value, bool)
            else:
                ok = name == "kind" or _is_int(value)
            if not ok:
                raise FormatError(f"{WHAT}: layout field {name}={value!r} is not valid")
        return cls(**values)


_COMMON_FIELDS = frozenset({"kind", "tokens", "total_tokens", "seq_length", "sequences", "cu_seqlens",
                            "cu_seqlens_padded"})
_MEGATRON_FIELDS = frozenset({"packing", "cp_size", "cp_rank", "tp_size", "tp_rank"})
# added in 1.1: absent from a 1.0 layout, read as their defaults
_MEGATRON_OPTIONAL = frozenset({"sequence_parallel", "cp_split", "pad_multiple", "total_multiple", "total_pad",
                                "convention"})
_VERL_FIELDS = frozenset({"prompt_width", "response_width", "prompt_lengths"})
_LIST_FIELDS = frozenset({"cu_seqlens", "cu_seqlens_padded", "prompt_lengths"})
_ENUM_FIELDS: dict[str, type[enum.Enum]] = {"packing": Packing, "cp_split": CpSplit, "total_pad": TotalPad,
                                            "convention": Convention}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(md: dict[str, str], key: str) -> list[int]:
    try:
        value = json.loads(md[key])
    except KeyError:
        raise FormatError(f"{WHAT}: schema metadata lacks {key}") from None
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(_is_int(x) for x in value):
        raise FormatError(f"{WHAT}: schema metadata {key}={md[key][:100]!r} is not a JSON list of ints")
    return value


@dataclass(frozen=True)
class SliceMeta:
    """Schema metadata of a trainer slice (trainer_slice.md, "Metadata").

    `layers` are the model layers of the ids' second axis, in order: the MoE layers held
    (`moe_layers`) on the `moe` axis; on the `model` axis a run of model layers, dense ones
    included (their ids are zero), of which `moe_layers` are the MoE ones.
    """

    top_k: int
    num_experts: int
    moe_ordinals: list[int]  # the run's MoE ordinals held, in row order (a pipeline stage's)
    moe_layers: list[int]  # their model-layer indices
    layout: SliceLayout
    version: FormatVersion = VERSION
    layer_axis: LayerAxis = LayerAxis.MOE
    layers: list[int] = field(default_factory=list)  # model-layer index per held layer; default: moe_layers
    num_hidden_layers: int = 0  # the model's layer count; 0: unknown (max(moe_layers) + 1)
    missing: MissingPolicy = MissingPolicy.FILLER  # the policy that built it (1.0 slices were filler or refused)
    weight_versions: list[str] = field(default_factory=list)  # 1.2: the labels the `weight_version` column indexes

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_axis", LayerAxis(self.layer_axis))
        object.__setattr__(self, "missing", MissingPolicy(self.missing))
        if len(self.moe_ordinals) != len(self.moe_layers) or not self.moe_ordinals:
            raise FormatError(f"{WHAT}: {len(self.moe_ordinals)} MoE ordinals for {len(self.moe_layers)} MoE layers; "
                              "a slice holds at least one")
        layers = list(self.layers) or list(self.moe_layers)
        object.__setattr__(self, "layers", layers)
        hidden = self.num_hidden_layers or max(layers) + 1
        object.__setattr__(self, "num_hidden_layers", hidden)
        if any(b <= a for a, b in zip(layers, layers[1:])) or min(layers) < 0 or max(layers) >= hidden:
            raise FormatError(f"{WHAT}: layers {layers} are not increasing model layers below num_hidden_layers="
                              f"{hidden}")
        if self.layer_axis is LayerAxis.MOE and layers != list(self.moe_layers):
            raise FormatError(f"{WHAT}: on the moe axis the layers held are the MoE layers {self.moe_layers}, "
                              f"not {layers}")
        if not set(self.moe_layers) <= set(layers):
            raise FormatError(f"{WHAT}: MoE layers {self.moe_layers} are not among the layers held {layers}")

    @property
    def num_moe_layers(self) -> int:
        """MoE layers held by this slice (not the run's count)."""
        return len(self.moe_ordinals)

    @property
    def num_layers(self) -> int:
        """Layers on the ids' second axis: `num_moe_layers` on the moe axis, model layers on the model axis."""
        return len(self.layers)

    @property
    def moe_positions(self) -> list[int]:
        """Where each MoE layer held sits on the ids' second axis (0..num_moe_layers-1 on the moe axis)."""
        at = {layer: i for i, layer in enumerate(self.layers)}
        return [at[layer] for layer in self.moe_layers]

    @property
    def dtype(self) -> np.dtype:
        """The ids' dtype: uint8 up to 256 experts, else uint16."""
        return expert_dtype(self.num_experts)

    @property
    def row_width(self) -> int:
        """Ids per row: num_layers * top_k."""
        return self.num_layers * self.top_k

    def to_metadata(self) -> dict[str, str]:
        """The metadata dict written into the schema (always the current version)."""
        return {
            "format": FORMAT,
            "format_version": str(VERSION),
            "num_moe_layers": str(self.num_moe_layers),
            "top_k": str(self.top_k),
            "num_experts": str(self.num_experts),
            "moe_ordinals": json.dumps(list(self.moe_ordinals)),
            "moe_layers": json.dumps(list(self.moe_layers)),
            "layout": json.dumps(self.layout.to_dict()),
            "layer_axis": self.layer_axis.value,
            "layers": json.dumps(list(self.layers)),
            "num_hidden_layers": str(self.num_hidden_layers),
            "missing": self.missing.value,
            "weight_versions": json.dumps(list(self.weight_versions)),
        }

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> SliceMeta:
        """Parse and validate decoded metadata; FormatError naming the missing or bad key."""
        if md.get("format") != FORMAT:
            raise FormatError(f"{WHAT}: schema metadata format={md.get('format')!r}, expected {FORMAT!r}")
        if "format_version" not in md:
            raise FormatError(f"{WHAT}: schema metadata lacks format_version")
        version = FormatVersion.parse(md["format_version"], WHAT).check(WHAT, VERSION)
        num_moe_layers = metadata_int(md, "num_moe_layers", WHAT, 1, 65535)
        ordinals, layers = _int_list(md, "moe_ordinals"), _int_list(md, "moe_layers")
        if not len(ordinals) == len(layers) == num_moe_layers:
            raise FormatError(f"{WHAT}: num_moe_layers={num_moe_layers} but moe_ordinals lists {len(ordinals)} "
                              f"and moe_layers {len(layers)}")
        try:
            layout = json.loads(md["layout"])
        except KeyError:
            raise FormatError(f"{WHAT}: schema metadata lacks layout") from None
        except ValueError:
            raise FormatError(f"{WHAT}: schema metadata layout is not JSON") from None
        num_experts = metadata_int(md, "num_experts", WHAT, 1, 65536)
        return cls(
            top_k=metadata_int(md, "top_k", WHAT, 1, num_experts),
            num_experts=num_experts,
            moe_ordinals=ordinals,
            moe_layers=layers,
            layout=SliceLayout.from_dict(layout),
            version=version,
            # 1.1 keys; a 1.0 slice has none of them and reads as the MoE axis, filler
            layer_axis=_enum_key(md, "layer_axis", LayerAxis, LayerAxis.MOE),
            layers=_int_list(md, "layers") if "layers" in md else [],
            num_hidden_layers=metadata_int(md, "num_hidden_layers", WHAT, 1, 65535) if "num_hidden_layers" in md
            else 0,
            missing=_enum_key(md, "missing", MissingPolicy, MissingPolicy.FILLER),
            weight_versions=_labels(md),  # 1.2; before, no version is known
        )


def _labels(md: dict[str, str]) -> list[str]:
    """The `weight_versions` key: a JSON list of distinct labels (absent: none)."""
    if "weight_versions" not in md:
        return []
    try:
        labels = json.loads(md["weight_versions"])
    except ValueError:
        labels = None
    if not isinstance(labels, list) or len(set(map(str, labels))) != len(labels):
        raise FormatError(f"{WHAT}: schema metadata weight_versions={md['weight_versions'][:100]!r} is not a JSON "
                          "list of distinct labels")
    return [check_label(label, f"{WHAT}: weight version") for label in labels]


def _enum_key(md: dict[str, str], key: str, kind: type[enum.StrEnum], default):
    if key not in md:
        return default
    try:
        return kind(md[key])
    except ValueError:
        raise FormatError(f"{WHAT}: schema metadata {key}={md[key][:100]!r} is not one of "
                          f"{', '.join(k.value for k in kind)}") from None


def slice_schema(meta: SliceMeta) -> pa.Schema:
    """The record-batch schema of a slice."""
    return pa.schema(
        [
            pa.field("experts", pa.list_(pa.from_numpy_dtype(meta.dtype), meta.row_width), nullable=False),
            pa.field("valid", pa.uint8(), nullable=False),
            pa.field("sequence", pa.int32(), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
            pa.field("fallback", pa.uint8(), nullable=False),
            pa.field(VERSION_COLUMN, pa.from_numpy_dtype(VERSION_TYPE), nullable=False),
        ],
        metadata=meta.to_metadata(),
    )


@dataclass
class TrainerSlice:
    """One rank's router tokens, in the router's order (arrays view the received body, writable)."""

    meta: SliceMeta
    experts: np.ndarray  # (m, num_layers, top_k) uint8/uint16 (num_layers: meta.layers; dense layers zero)
    valid: np.ndarray  # (m,) uint8: 1 = a clean recorded row; 0 = filler (padding, last token, flagged or missing)
    sequence: np.ndarray  # (m,) int32: index into the micro-batch's sequences, -1 for padding
    position: np.ndarray  # (m,) int32: position in its request, -1 for padding
    fallback: np.ndarray  # (m,) uint8: 1 = no recorded route, the router must choose (missing=router); 1.0: zeros
    weight_version: np.ndarray  # (m,) int16: index into `weight_versions` of the replayed row's version; -1 unknown

    @property
    def num_tokens(self) -> int:
        """Router tokens of this slice."""
        return len(self.valid)

    @property
    def layout(self) -> SliceLayout:
        """The token layout the rows follow."""
        return self.meta.layout

    @property
    def moe_ordinals(self) -> list[int]:
        """The run's MoE ordinals held, in the order of `experts`' second axis."""
        return self.meta.moe_ordinals

    @property
    def moe_layers(self) -> list[int]:
        """Their model-layer indices."""
        return self.meta.moe_layers

    @property
    def layers(self) -> list[int]:
        """The model layers of `experts`' second axis (the MoE layers on the moe axis)."""
        return self.meta.layers

    @property
    def layer_axis(self) -> LayerAxis:
        """Whether `experts` holds MoE layers only or a run of model layers (dense ones zero)."""
        return self.meta.layer_axis

    @property
    def missing(self) -> MissingPolicy:
        """The missing-row policy the slice was built with."""
        return self.meta.missing

    @property
    def num_experts(self) -> int:
        """Experts of the run's routers."""
        return self.meta.num_experts

    @property
    def weight_versions(self) -> list[str]:
        """The version labels `weight_version` indexes (those of the rows replayed, first seen first)."""
        return self.meta.weight_versions

    def versions(self) -> list[str | None]:
        """Each token's weight version label: the version of the row replayed; None for filler (padding, the last
        token, a flagged or missing row) and rows written before versions existed."""
        table = [*self.meta.weight_versions, None]
        return [table[i] for i in self.weight_version.tolist()]


def build_slice(meta: SliceMeta, experts: np.ndarray, valid: np.ndarray, sequence: np.ndarray,
                position: np.ndarray, fallback: np.ndarray | None = None,
                weight_version: np.ndarray | None = None) -> list[memoryview]:
    """The slice as one Arrow IPC stream, in parts to write out in order.

    `experts` is `(m, num_layers * top_k)` (or `(m, num_layers, K)`) in the run's dtype, C-contiguous;
    `fallback` defaults to zeros, `weight_version` (int16 indices into `meta.weight_versions`) to -1
    (unknown). The large parts are the arrays' own buffers: nothing is copied between the gather and
    the socket.
    """
    m = meta.layout.tokens
    if experts.dtype != meta.dtype or experts.size != m * meta.row_width or not experts.flags.c_contiguous:
        raise FormatError(f"{WHAT}: experts {experts.dtype} {experts.shape} are not {m} contiguous rows of "
                          f"{meta.row_width} {meta.dtype} ids")
    if fallback is None:
        fallback = np.zeros(m, np.uint8)
    if weight_version is None:
        weight_version = np.full(m, UNKNOWN, VERSION_TYPE)
    columns = {"valid": (valid, np.uint8), "sequence": (sequence, np.int32), "position": (position, np.int32),
               "fallback": (fallback, np.uint8), VERSION_COLUMN: (weight_version, VERSION_TYPE)}
    for name, (array, dtype) in columns.items():
        if array.shape != (m,) or array.dtype != dtype:
            raise FormatError(f"{WHAT}: column {name!r} is {array.dtype} {array.shape}, expected {np.dtype(dtype)} "
                              f"({m},)")
    _check_version_index(weight_version, meta)
    schema = slice_schema(meta)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), meta.row_width),
            pa.array(valid),
            pa.array(sequence),
            pa.array(position),
            pa.array(fallback),
            pa.array(weight_version),
        ],
        schema=schema,
    )
    return [part for parts in ipc_stream_parts(schema, [batch]) for part in parts]


def read_slice(backing: Backing) -> TrainerSlice:
    """A received slice; its arrays are writable views of `backing` (no copy).

    UndecodableError when the body is not an Arrow IPC stream; FormatError naming what does not
    follow trainer_slice.md (an unknown major version among them).
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(backing))
        batches = list(reader)
    except (pa.ArrowException, OSError) as exc:
        raise UndecodableError(f"{WHAT} is not a valid Arrow IPC stream: {exc}") from None
    meta = SliceMeta.from_metadata(decode_metadata(reader.schema.metadata, WHAT))
    if len(batches) != 1:
        raise FormatError(f"{WHAT}: the stream holds {len(batches)} record batches, expected 1")
    batch = batches[0]
    if batch.num_rows != meta.layout.tokens:
        raise FormatError(f"{WHAT}: {batch.num_rows} rows but the layout says {meta.layout.tokens} tokens")
    names = batch.schema.names
    for name in COLUMNS:
        if name not in names:
            raise FormatError(f"{WHAT}: schema lacks column {name!r}; columns are {names}")
    checked = [("valid", pa.uint8()), ("sequence", pa.int32()), ("position", pa.int32())]
    if "fallback" in names:
        checked.append(("fallback", pa.uint8()))
    if VERSION_COLUMN in names:
        checked.append((VERSION_COLUMN, pa.from_numpy_dtype(VERSION_TYPE)))
    for name, wanted in checked:
        column = batch.column(name)
        if column.type != wanted or column.null_count:
            raise FormatError(f"{WHAT}: column {name!r} is {column.type} with {column.null_count} nulls, "
                              f"expected {wanted} without nulls")
    experts = batch.column("experts")
    if not pa.types.is_fixed_size_list(experts.type) or experts.type.list_size != meta.row_width:
        raise FormatError(f"{WHAT}: column 'experts' is {experts.type}, expected {meta.row_width} ids per row")
    ids = experts.flatten()
    if ids.type != pa.from_numpy_dtype(meta.dtype) or ids.null_count:
        raise FormatError(f"{WHAT}: ids are {ids.type} with {ids.null_count} nulls, but {meta.num_experts} "
                          f"experts means {meta.dtype}")
    m = batch.num_rows
    fallback = writable_view(batch.column("fallback"), backing) if "fallback" in names else np.zeros(m, np.uint8)
    if VERSION_COLUMN in names:  # 1.2
        weight_version = writable_view(batch.column(VERSION_COLUMN), backing)
        _check_version_index(weight_version, meta)
    else:
        weight_version = np.full(m, UNKNOWN, VERSION_TYPE)
    return TrainerSlice(
        meta=meta,
        experts=writable_view(ids, backing).reshape(m, meta.num_layers, meta.top_k),
        valid=writable_view(batch.column("valid"), backing),
        sequence=writable_view(batch.column("sequence"), backing),
        position=writable_view(batch.column("position"), backing),
        fallback=fallback,
        weight_version=weight_version,
    )


def _check_version_index(weight_version: np.ndarray, meta: SliceMeta) -> None:
    """FormatError when an index is neither -1 nor one of the metadata's labels."""
    if weight_version.size and (weight_version.min() < UNKNOWN or weight_version.max() >= len(meta.weight_versions)):
        raise FormatError(f"{WHAT}: column {VERSION_COLUMN!r} holds indices {int(weight_version.min())}.."
                          f"{int(weight_version.max())}, but weight_versions lists {len(meta.weight_versions)} labels")


__all__ = ["FORMAT", "VERSION", "Convention", "CpSplit", "LayoutKind", "MissingPolicy", "Packing", "SliceLayout",
           "SliceMeta", "TotalPad", "TrainerSlice", "build_slice", "read_slice", "slice_schema"]
