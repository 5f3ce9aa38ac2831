"""Fill a token plan with ids: the recorded rows, filler, and the missing-row policy (pure numpy).

`gather_rows(plan, specs, read_rows, held, ...)` reads the plan's tokens' rows through a callback (never the store)
and copies each token's ids once, from where the callback says they are (`IdRows`: a segment's mapping),
keeps the layers the slice holds (`held_layers`: the MoE axis, or the model-layer axis with dense layers zero), and
gives padding and the last token of each sequence filler ids with `valid == 0`. A real token whose row is flagged or
missing follows `MissingPolicy`: `strict` refuses the slice, `router` marks it `fallback == 1` (the trainer's router
picks), `filler` gives it filler ids. Each replayed token carries its row's weight version (an index into the
slice's labels); filler carries -1.

Design: docs/design/trainer_layouts.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from replay_format import LayerAxis, RunShape
from replay_format.trainer_query import StageLayers
from replay_format.trainer_slice import VERSION_TYPE, MissingPolicy
from replay_format.weight_versions import UNKNOWN
from replay_service.errors import InvalidInput
from replay_service.store.requests.rows import contiguous_runs
from replay_service.trainer.layouts import SequenceSpec, TokenPlan, filler_rows


class IdRows(Protocol):
    """Where a sequence's recorded ids are: `copy_ids(out, dst, offsets, ordinals)` sets `out[dst[j]]` to the ids of
    row `offsets[j]` (of the MoE layers `ordinals`; None: all of them, `out` then `(m, L*K)`)."""

    def copy_ids(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray,
                 ordinals: np.ndarray | None = None) -> None: ...


@dataclass(frozen=True)
class DenseIds:
    """`IdRows` over ids already in one array `(n, L*K)`."""

    experts: np.ndarray
    shape: RunShape

    def copy_ids(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray,
                 ordinals: np.ndarray | None = None) -> None:
        """As `IdRows.copy_ids`: runs that step by one on both sides go as plain copies."""
        experts = self.experts if ordinals is None else self.experts.reshape(
            len(self.experts), self.shape.num_moe_layers, self.shape.top_k)[:, ordinals]
        runs = contiguous_runs(dst, offsets)
        if runs is None:
            out[dst] = experts[offsets]
            return
        for a, b in runs:  # THD: one run per sequence (two under zigzag CP)
            out[dst[a] : dst[a] + b - a] = experts[offsets[a] : offsets[a] + b - a]


@dataclass(frozen=True)
class RowsRead:
    """Recorded rows of one sequence's offsets `[lo, hi)`: where their ids are, which are clean, each row's version."""

    ids: IdRows  # offsets 0 .. hi-lo-1; every MoE layer of the run
    ok: np.ndarray  # (hi-lo,) bool: a clean recorded row
    version: np.ndarray  # (hi-lo,) int16: index into the slice's version labels, UNKNOWN where none is known


# read_rows(i, lo, hi): sequence i's offsets [lo, hi)
ReadRows = Callable[[int, int, int], RowsRead]


@dataclass(frozen=True)
class HeldLayers:
    """The layers a slice holds: which of the run's MoE ordinals, and where they sit on the ids' second axis."""

    shape: RunShape
    axis: LayerAxis
    moe_ordinals: np.ndarray  # int64: the run's MoE ordinals held, in order
    layers: list[int]  # the model layer of each position of the ids' second axis

    @property
    def moe_layers(self) -> list[int]:
        """Model-layer indices of the MoE layers held."""
        return [self.shape.moe_layers[i] for i in self.moe_ordinals.tolist()]

    @property
    def positions(self) -> np.ndarray:
        """Position of each MoE layer held on the ids' second axis."""
        at = {layer: i for i, layer in enumerate(self.layers)}
        return np.array([at[layer] for layer in self.moe_layers], np.int64)


def held_layers(shape: RunShape, stage: StageLayers) -> HeldLayers:
    """The layers of this pipeline stage: by MoE ordinals or by model layers [lo, hi); default all.

    On the model axis a stage is named by its model layers only (MoE ordinals do not say which
    dense layers to hold), and the slice holds every model layer of the range, dense ones zero.
    """
    moe_ordinals, model_layer_range, axis = stage.moe_ordinals, stage.model_layer_range, stage.layer_axis
    if moe_ordinals is not None and model_layer_range is not None:
        raise InvalidInput("give either moe_ordinals or model_layer_range ([lo, hi) of model layers), not both")
    if moe_ordinals is not None:
        if axis is LayerAxis.MODEL:
            raise InvalidInput("layer_axis=model holds a run of model layers: name the stage by model_layer_range "
                               "[lo, hi), not moe_ordinals")
        sel = np.asarray(moe_ordinals, np.int64)
        if not sel.size or sel.min() < 0 or sel.max() >= shape.num_moe_layers:
            raise InvalidInput(f"moe_ordinals {list(moe_ordinals)} are not MoE ordinals "
                               f"0..{shape.num_moe_layers - 1}")
        return HeldLayers(shape, axis, sel, [shape.moe_layers[i] for i in sel.tolist()])
    lo, hi = model_layer_range if model_layer_range is not None else (0, shape.num_hidden_layers)
    if axis is LayerAxis.MODEL and not 0 <= lo < hi <= shape.num_hidden_layers:
        raise InvalidInput(f"model_layer_range [{lo}, {hi}) is not inside the model's {shape.num_hidden_layers} "
                           "layers")
    sel = np.array([i for i, m in enumerate(shape.moe_layers) if lo <= m < hi], np.int64)
    if not sel.size:
        raise InvalidInput(f"model layers [{lo}, {hi}) hold no MoE layer (MoE layers are {list(shape.moe_layers)})")
    layers = list(range(lo, hi)) if axis is LayerAxis.MODEL else [shape.moe_layers[i] for i in sel.tolist()]
    return HeldLayers(shape, axis, sel, layers)


@dataclass
class Gathered:
    """A plan's ids and masks, ready for the slice."""

    experts: np.ndarray  # (m, len(layers) * K), the run's dtype, C-contiguous
    valid: np.ndarray  # (m,) uint8: a clean recorded row
    fallback: np.ndarray  # (m,) uint8: the router must choose (missing=router)
    broken: np.ndarray  # int64: plan indices of real tokens whose recorded row is flagged or missing
    version: np.ndarray  # (m,) int16: the replayed row's version (index into the slice's labels), UNKNOWN for filler


def gather_rows(plan: TokenPlan, specs: list[SequenceSpec], read_rows: ReadRows, held: HeldLayers,
                missing: MissingPolicy) -> Gathered:
    """Ids of every token of `plan` for the `held` layers, and who gets filler or the router's own choice.

    `read_rows(i, lo, hi)` returns the `RowsRead` of sequence `i`'s offsets `[lo, hi)`, all the
    run's MoE layers. Tokens without a clean row get `filler_rows` (router-valid ids), `valid == 0`
    and no version; under `missing=router` the real ones among them (not padding, not a last token)
    also get `fallback == 1`.
    """
    shape = held.shape
    num_moe_layers, top_k = shape.num_moe_layers, shape.top_k
    ordinals = held.moe_ordinals
    m = plan.num_tokens
    out = np.empty((m, len(ordinals), top_k), shape.dtype)
    every_layer = len(ordinals) == num_moe_layers
    target, subset = (out.reshape(m, -1), None) if every_layer else (out, ordinals)
    valid = np.zeros(m, np.uint8)
    version = np.full(m, UNKNOWN, VERSION_TYPE)
    needs_row = np.zeros(m, bool)
    order = np.argsort(plan.sequence, kind="stable")
    seq_sorted = plan.sequence[order]
    bounds = np.searchsorted(seq_sorted, np.arange(-1, len(specs) + 1))
    for i, spec in enumerate(specs):
        idx = order[bounds[i + 1] : bounds[i + 2]]
        if not idx.size:
            continue
        offs = plan.offset[idx]
        has_row = offs < spec.rows
        idx_rows, offs_rows = idx[has_row], offs[has_row]
        if not idx_rows.size:
            continue
        needs_row[idx_rows] = True
        lo, hi = int(offs_rows.min()), int(offs_rows.max()) + 1
        read = read_rows(i, lo, hi)
        local = offs_rows - lo
        good = read.ok[local]
        read.ids.copy_ids(target, idx_rows[good], local[good], subset)  # straight from where they are: one copy
        valid[idx_rows[good]] = 1
        version[idx_rows[good]] = read.version[local[good]]
    without = np.flatnonzero(valid == 0)
    if without.size:
        fill = filler_rows(plan.global_index[without], num_moe_layers, top_k, shape.num_experts)[:, ordinals]
        out[without] = fill.astype(shape.dtype)
    broken = np.flatnonzero(needs_row & (valid == 0))
    fallback = np.zeros(m, np.uint8)
    if missing is MissingPolicy.ROUTER:
        fallback[broken] = 1
    if held.axis is LayerAxis.MODEL:  # every model layer of the range, dense ones zero (vLLM's routed_experts)
        full = np.zeros((m, len(held.layers), top_k), shape.dtype)
        full[:, held.positions] = out
        out = full
    return Gathered(out.reshape(m, -1), valid, fallback, broken, version)
