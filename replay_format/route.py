"""Route answers: a run's rows served back, one record batch per request (spec: route.md).

The service builds them (`encode_routes`: `GET .../requests/{request}/routes` and
`POST .../routes/batch`); the client reads them (`read_routes`), and the web view's
`web/js/routedata.js` mirrors the reader. A batch is a row batch (rows.md columns);
the stream's metadata (`RouteMeta`) names the run, its shape, the range served and the layer
axis of the `experts` column: the run's MoE layers (`LayerAxis.MOE`, the default) or every model
layer with dense ones zero (`LayerAxis.MODEL`, as vLLM's and SGLang's `routed_experts`), the rule that chose
among a position's computations (`RecomputeRule`) and the weight version selected, if any. Since 1.2 every
batch carries each row's weight version (`weight_version`, rows.md "Weight versions").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import rows
from replay_format.core import (
    Backing,
    FormatError,
    FormatVersion,
    LayerAxis,
    RunShape,
    check_id,
    decode_metadata,
    flag_names,
    ipc_stream_parts,
    metadata_int,
    metadata_version,
    token_ids,
    writable_view,
)
from replay_format.weight_versions import COLUMN_TYPE, RecomputeRule, WeightVersions, check_label

FORMAT = "routing-replay.route"
# 1.1 added layer_axis (and carries num_hidden_layers, rows.md 2.1); 1.2 the weight_version column and the
# recompute and weight_version keys
VERSION = FormatVersion(1, 2)
# An answer without format_version came from a service older than this spec: same columns,
# `num_layers` where 1.0 says `num_moe_layers`. Read as such.
LEGACY_VERSION = FormatVersion(0, 0)
POSITION_MAX = rows.POSITION_MAX


@dataclass(frozen=True)
class RouteMeta:
    """Schema metadata of a route answer (route.md, "Metadata")."""

    run_id: str
    shape: RunShape
    requests: int = 1  # record batches in the stream, one per request asked
    start: int = 0  # first position of every batch
    end: int | None = None  # exclusive end asked for; None: each request up to its own last row
    layer_axis: LayerAxis = LayerAxis.MOE  # which layers the `experts` column holds
    version: FormatVersion = VERSION
    recompute: RecomputeRule = RecomputeRule.FIRST  # which computation of a position was served (1.2)
    weight_version: str | None = None  # only rows of this version were served (1.2); None: every version

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_axis", LayerAxis(self.layer_axis))  # a plain string names one too
        object.__setattr__(self, "recompute", RecomputeRule(self.recompute))

    @property
    def layers(self) -> tuple[int, ...]:
        """The model-layer index of each layer of the `experts` column, in column order."""
        if self.layer_axis == LayerAxis.MODEL:
            return tuple(range(self.shape.num_hidden_layers))
        return self.shape.moe_layers

    @property
    def column_shape(self) -> RunShape:
        """The shape of the `experts` column's rows: `len(layers)` x top-k ids of the run's dtype."""
        if self.layer_axis == LayerAxis.MOE:
            return self.shape
        return RunShape(len(self.layers), self.shape.top_k, self.shape.num_experts)

    def to_metadata(self) -> dict[str, str]:
        """The metadata dict written into the stream's schema (always the current version)."""
        md = {
            "format": FORMAT,
            "format_version": str(VERSION),
            "run_id": self.run_id,
            **rows.shape_metadata(self.shape),
            "requests": str(self.requests),
            "start": str(self.start),
            "layer_axis": self.layer_axis.value,
            "recompute": self.recompute.value,
        }
        if self.end is not None:
            md["end"] = str(self.end)
        if self.weight_version is not None:
            md["weight_version"] = self.weight_version
        return md

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> RouteMeta:
        """Parse and validate decoded metadata; FormatError naming the missing or bad key."""
        what = "route answer"
        if md.get("format", FORMAT) != FORMAT:
            raise FormatError(f"{what}: schema metadata format={md['format']!r}, expected {FORMAT!r}")
        version = metadata_version(md, what, VERSION, LEGACY_VERSION)
        if "run_id" not in md:
            raise FormatError(f"{what}: schema metadata lacks run_id")
        shape_version = rows.LEGACY_VERSION if version == LEGACY_VERSION else rows.VERSION
        try:
            axis = LayerAxis(md.get("layer_axis", LayerAxis.MOE.value))
        except ValueError:
            raise FormatError(f"{what}: schema metadata layer_axis={md['layer_axis']!r} is not one of "
                              f"{', '.join(a.value for a in LayerAxis)}") from None
        try:
            recompute = RecomputeRule(md.get("recompute", RecomputeRule.FIRST.value))
        except ValueError:
            raise FormatError(f"{what}: schema metadata recompute={md['recompute']!r} is not one of "
                              f"{', '.join(r.value for r in RecomputeRule)}") from None
        selected = md.get("weight_version")
        return cls(
            run_id=check_id("run_id", md["run_id"]),
            shape=rows.shape_from_metadata(md, what, shape_version),
            requests=metadata_int(md, "requests", what) if "requests" in md else 1,
            start=metadata_int(md, "start", what, 0, POSITION_MAX + 1) if "start" in md else 0,
            end=metadata_int(md, "end", what, 0, POSITION_MAX + 1) if "end" in md else None,
            layer_axis=axis,
            version=version,
            recompute=recompute,
            weight_version=None if selected is None else check_label(selected, f"{what}: weight_version"),
        )


@dataclass
class RequestRoute:
    """One request's rows `[start, start + n)`, dense by position (a position never received is a GAP row)."""

    request_id: str
    positions: np.ndarray  # int32 (n,)
    token_ids: np.ndarray  # int32 (n,), NO_TOKEN where unknown
    experts: np.ndarray  # (n, layers, top_k) in the run's dtype, layers on the answer's axis ((n, L*K) accepted)
    flags: np.ndarray  # uint16 (n,)
    weight_versions: WeightVersions | None = None  # each row's weight version; None: none known (or before 1.2)

    def versions(self) -> WeightVersions:
        """Each row's weight version (all unknown when none is known)."""
        return WeightVersions.unknown(self.num_rows) if self.weight_versions is None else self.weight_versions

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    @property
    def clean(self) -> bool:
        """True when no row carries a flag."""
        return not self.flags.any()

    def flagged_rows(self) -> list[tuple[int, list[str]]]:
        """(position, flag names) of every flagged row."""
        return [(int(self.positions[i]), flag_names(int(self.flags[i]))) for i in np.flatnonzero(self.flags)]


def encode_routes(meta: RouteMeta, routes: Iterable[RequestRoute]) -> Iterator[list[memoryview]]:
    """The answer as an Arrow IPC stream, in parts: one list per request (read lazily), then the end marker.

    Each route's `experts` are already on `meta.layer_axis` (`RunShape.to_model_axis` expands MoE rows).
    The parts reference the routes' arrays (no copy of the ids); write them out in order. Every batch carries the
    `weight_version` column (null where a row's version is unknown).
    """
    md = meta.to_metadata()
    columns = meta.column_shape

    schema = rows.rows_schema(columns, md).append(pa.field(rows.VERSION_COLUMN, COLUMN_TYPE))

    def batches() -> Iterator[pa.RecordBatch]:
        for route in routes:
            request = ([route.request_id], np.zeros(route.num_rows, np.int32))
            yield pa.RecordBatch.from_arrays(rows.row_arrays(columns, request, route.positions, route.experts,
                                                             route.token_ids, route.flags, route.versions()),
                                             schema=schema)

    return ipc_stream_parts(schema, batches())


def read_routes(backing: Backing) -> tuple[RouteMeta, list[RequestRoute]]:
    """A received route answer; the arrays are writable views of `backing` (token ids: a copy when any is null).

    FormatError names what does not follow route.md (an unknown major version among them).
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(backing))
        batches = list(reader)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"route answer is not a valid Arrow IPC stream: {exc}") from None
    meta = RouteMeta.from_metadata(decode_metadata(reader.schema.metadata, "route answer"))
    return meta, [_read_batch(batch, meta.column_shape, backing) for batch in batches]


def _read_batch(batch: pa.RecordBatch, shape: RunShape, backing: Backing) -> RequestRoute:
    """One record batch; `shape` is the `experts` column's (`RouteMeta.column_shape`)."""
    names = batch.schema.names
    for required in rows.COLUMNS:
        if required not in names:
            raise FormatError(f"route answer: a batch lacks column {required!r}")
    request = batch.column("request_id")
    if not pa.types.is_dictionary(request.type) or len(request.dictionary) != 1:
        raise FormatError("route answer: column 'request_id' must be a dictionary of exactly the batch's request")
    for name, wanted in (("position", pa.int32()), ("token_id", pa.int32()), ("flags", pa.uint16())):
        if batch.column(name).type != wanted:
            raise FormatError(f"route answer: column {name!r} is {batch.column(name).type}, expected {wanted}")
    experts = batch.column("experts")
    if not pa.types.is_fixed_size_list(experts.type) or experts.type.list_size != shape.row_width:
        raise FormatError(f"route answer: column 'experts' is {experts.type}, expected {shape.row_width} ids per row")
    ids = experts.flatten()
    if ids.type != shape.arrow_type:
        raise FormatError(f"route answer: ids are {ids.type}, but {shape.num_experts} experts means {shape.arrow_type}")
    return RequestRoute(
        request_id=str(request.dictionary[0].as_py()),
        positions=writable_view(batch.column("position"), backing),
        token_ids=token_ids(batch.column("token_id"), backing),
        experts=writable_view(ids, backing).reshape(batch.num_rows, shape.num_moe_layers, shape.top_k),
        flags=writable_view(batch.column("flags"), backing),
        weight_versions=(WeightVersions.from_arrow(batch.column(rows.VERSION_COLUMN), f"route answer: column "
                                                   f"{rows.VERSION_COLUMN!r}")
                         if rows.VERSION_COLUMN in names else None),
    )
