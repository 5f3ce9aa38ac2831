"""Server side of the trainer layouts: read only the rows one rank needs, encode them.

The answer is one Arrow IPC record batch, one row per router token of the rank,
in the router's order: `experts` (fixed_size_list of this stage's L_s * K ids,
layer-major, the run's dtype), `valid` (uint8: 1 = a clean recorded row, 0 =
padding, the last token of a sequence, or a flagged/missing row, all given
`layouts.filler_rows`), `sequence` and `position` (int32, -1 for padding).
Schema metadata carries the layout (JSON under `layout`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import RunShape, flag_names
from replay_service import layouts
from replay_service.errors import Conflict, InvalidInput, StrictRefusal
from replay_service.store import RouteStore


@dataclass
class SequenceRef:
    run: str
    request: str
    start: int = 0
    num_tokens: int | None = None


def common_shape(store: RouteStore, seqs: list[SequenceRef]) -> RunShape:
    shape = None
    for ref in seqs:
        s = store.run_shape(ref.run)
        if shape is None:
            shape = s
        elif s != shape:
            raise Conflict(
                f"run {ref.run!r} records {s.num_moe_layers} x top-{s.top_k} of {s.num_experts} (MoE layers "
                f"{list(s.moe_layers)}), unlike the micro-batch's first run; one micro-batch needs one model shape")
    return shape


def layer_selection(shape: RunShape, layers: list[int] | None, model_layers: tuple[int, int] | None) -> np.ndarray:
    """MoE ordinals of this pipeline stage: given directly, or by the stage's model-layer range [lo, hi)."""
    if layers is not None and model_layers is not None:
        raise InvalidInput("give either layers (MoE ordinals) or model_layers ([lo, hi) of model layers), not both")
    if layers is not None:
        sel = np.asarray(layers, np.int64)
        if not sel.size or sel.min() < 0 or sel.max() >= shape.num_moe_layers:
            raise InvalidInput(f"layers {layers} are not MoE ordinals 0..{shape.num_moe_layers - 1}")
        return sel
    if model_layers is not None:
        lo, hi = model_layers
        sel = np.array([i for i, m in enumerate(shape.moe_layers) if lo <= m < hi], np.int64)
        if not sel.size:
            raise InvalidInput(f"model layers [{lo}, {hi}) hold no MoE layer (MoE layers are {list(shape.moe_layers)})")
        return sel
    return np.arange(shape.num_moe_layers, dtype=np.int64)


def sequence_specs(store: RouteStore, seqs: list[SequenceRef]) -> list[layouts.SequenceSpec]:
    specs = []
    for i, ref in enumerate(seqs):
        expected = store.request_summary(ref.run, ref.request)["expected_rows"]
        try:
            specs.append(layouts.sequence_spec(expected, ref.start, ref.num_tokens, f"sequence {i} ({ref.run}/{ref.request})"))
        except layouts.LayoutError as exc:
            raise InvalidInput(str(exc)) from None
    return specs


def gather(store: RouteStore, seqs, specs, plan: layouts.Plan, shape: RunShape, sel: np.ndarray, strict: bool,
           report_rows: int) -> tuple[np.ndarray, np.ndarray]:
    flagged: list[dict] = []

    def read_rows(i: int, lo: int, hi: int):
        ref, spec = seqs[i], specs[i]
        route = store.read_route(ref.run, ref.request, spec.start + lo, spec.start + hi)
        ok = route.flags == 0
        if strict and not ok.all() and len(flagged) < report_rows:
            for j in np.flatnonzero(~ok)[: report_rows - len(flagged)]:
                flagged.append({"run_id": ref.run, "request_id": ref.request, "position": int(route.positions[j]),
                                "flags": flag_names(int(route.flags[j]))})
        return route.experts, ok

    experts, valid = layouts.gather_rows(plan, specs, read_rows, shape.num_moe_layers, shape.top_k, shape.num_experts,
                                         sel, shape.dtype)
    if strict:
        has_row = plan.sequence >= 0
        rows_of = np.array([s.rows for s in specs], np.int64)
        needed = has_row & (plan.offset < rows_of[np.maximum(plan.sequence, 0)])
        bad = np.flatnonzero(needed & (valid == 0))
        if bad.size:
            first = flagged[0] if flagged else {"position": int(specs[plan.sequence[bad[0]]].start + plan.offset[bad[0]])}
            raise StrictRefusal(
                f"strict read refused: {bad.size} tokens of this rank have a flagged or missing row, the first at "
                f"position {first['position']}", flagged,
            )
    return experts, valid


def encode(plan: layouts.Plan, specs, experts: np.ndarray, valid: np.ndarray, shape: RunShape, sel: np.ndarray,
           layout: dict) -> list:
    width = len(sel) * shape.top_k
    starts = np.array([s.start for s in specs], np.int64)
    position = np.where(plan.sequence >= 0, starts[np.maximum(plan.sequence, 0)] + plan.offset, -1).astype(np.int32)
    schema = pa.schema(
        [
            pa.field("experts", pa.list_(pa.from_numpy_dtype(shape.dtype), width), nullable=False),
            pa.field("valid", pa.uint8(), nullable=False),
            pa.field("sequence", pa.int32(), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
        ],
        metadata={
            "num_layers": str(len(sel)),
            "top_k": str(shape.top_k),
            "num_experts": str(shape.num_experts),
            "layers": json.dumps(sel.tolist()),
            "moe_layers": json.dumps([int(shape.moe_layers[i]) for i in sel]),
            "layout": json.dumps(layout),
        },
    )
    batch = pa.RecordBatch.from_arrays(
        [
            pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), width),
            pa.array(valid),
            pa.array(plan.sequence),
            pa.array(position),
        ],
        schema=schema,
    )
    sink = _Parts()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    return sink.parts


class _Parts:
    """A write-only sink that keeps what Arrow hands it: small framing as bytes, the large
    buffers as references to the arrays themselves (pyarrow passes them uncopied), so the
    answer goes out without another copy of the ids."""

    closed = False

    def __init__(self) -> None:
        self.parts: list = []

    def write(self, data) -> int:
        self.parts.append(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
