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
from replay_service.trainer.layouts import SequenceSpec, TokenPlan, filler_rows, index_runs


class IdRows(Protocol):
    """Where a sequence's recorded ids are: `copy_ids(out, dst, offsets, ordinals)` sets `out[dst[j]]` to the ids of
    row `offsets[j]` (of the MoE layers `ordinals`; None: all of them, `out` then `(m, L*K)`); `copy_run(out, dst,
    offset, count, ordinals)` sets `out[dst:dst + count]` to rows `[offset, offset + count)`."""

    def copy_ids(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray,
                 ordinals: np.ndarray | None = None) -> None: ...

    def copy_run(self, out: np.ndarray, dst: int, offset: int, count: int,
                 ordinals: np.ndarray | None = None) -> None: ...


@dataclass(frozen=True)
class DenseIds:
    """`IdRows` over ids already in one array `(n, L*K)`."""

    experts: np.ndarray
    shape: RunShape

    def copy_ids(self, out: np.ndarray, dst: np.ndarray, offsets: np.ndarray,
                 ordinals: np.ndarray | None = None) -> None:
        """As `IdRows.copy_ids`: runs that step by one on both sides go as plain copies."""
        runs = contiguous_runs(dst, offsets)
        if runs is None:
            out[dst] = self._rows(offsets, ordinals)
            return
        for a, b in runs:  # THD: one run per sequence (two under zigzag CP)
            self.copy_run(out, int(dst[a]), int(offsets[a]), b - a, ordinals)

    def copy_run(self, out: np.ndarray, dst: int, offset: int, count: int,
                 ordinals: np.ndarray | None = None) -> None:
        """As `IdRows.copy_run`: one copy."""
        out[dst : dst + count] = self._rows(slice(offset, offset + count), ordinals)

    def _rows(self, which: np.ndarray | slice, ordinals: np.ndarray | None) -> np.ndarray:
        rows = self.experts[which]
        return rows if ordinals is None else rows.reshape(len(rows), self.shape.num_moe_layers,
                                                          self.shape.top_k)[:, ordinals]


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


_MAX_RUNS = 64  # a sequence in more runs than this is gathered token by token


@dataclass(frozen=True)
class RowRuns:
    """The plan's tokens that have a recorded row, as runs along which the plan index and the offset both step by
    one, by sequence (`row_runs`); THD gives one run per sequence, two under zigzag CP."""

    sequence: np.ndarray  # int64 (r,), ascending
    dst: np.ndarray  # int64 (r,): the run's first plan index
    offset: np.ndarray  # int64 (r,): its first token's offset in the sequence
    count: np.ndarray  # int64 (r,): its tokens


def row_runs(plan: TokenPlan, specs: list[SequenceSpec]) -> tuple[np.ndarray, RowRuns]:
    """Which plan tokens have a recorded row (not padding, not past their sequence's rows: its last token), and
    those tokens as runs (in plan order within a sequence)."""
    rows = np.array([spec.rows for spec in specs], np.int64)
    sequence = plan.sequence.astype(np.int64)
    needs_row = (sequence >= 0) & (plan.offset < rows[np.maximum(sequence, 0)])
    at = np.flatnonzero(needs_row)
    seq, off = sequence[at], plan.offset[at].astype(np.int64)
    steps = (np.diff(at) != 1) | (np.diff(off) != 1) | (np.diff(seq) != 0)
    firsts = np.flatnonzero(np.concatenate([[len(at) > 0], steps]))
    count = np.diff(np.append(firsts, len(at)))
    by_sequence = np.argsort(seq[firsts], kind="stable")
    firsts, count = firsts[by_sequence], count[by_sequence]
    return needs_row, RowRuns(seq[firsts], at[firsts], off[firsts], count)


@dataclass(frozen=True)
class _Copied:
    """One sequence's rows read, copied into the slice's arrays: ids, `valid`, version."""

    read: RowsRead
    target: np.ndarray
    subset: np.ndarray | None
    valid: np.ndarray
    version: np.ndarray

    def run(self, dst: int, offset: int, count: int) -> None:
        """Plan tokens `[dst, dst + count)` from the read's offsets `[offset, offset + count)`, the clean ones."""
        if not self.read.ok[offset : offset + count].all():
            self.tokens(np.arange(dst, dst + count), np.arange(offset, offset + count))
            return
        self.read.ids.copy_run(self.target, dst, offset, count, self.subset)
        self.valid[dst : dst + count] = 1
        self.version[dst : dst + count] = self.read.version[offset : offset + count]

    def tokens(self, dst: np.ndarray, offsets: np.ndarray) -> None:
        """Plan tokens `dst` from the read's `offsets`, the clean ones."""
        good = self.read.ok[offsets]
        dst, offsets = dst[good], offsets[good]
        self.read.ids.copy_ids(self.target, dst, offsets, self.subset)
        self.valid[dst] = 1
        self.version[dst] = self.read.version[offsets]


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
    needs_row, runs = row_runs(plan, specs)
    bounds = np.searchsorted(runs.sequence, np.arange(len(specs) + 1)).tolist()
    for i in range(len(specs)):
        a, b = bounds[i], bounds[i + 1]
        if a == b:
            continue
        dst, offset, count = runs.dst[a:b], runs.offset[a:b], runs.count[a:b]
        lo = int(offset.min())
        read = read_rows(i, lo, int((offset + count).max()))
        copied = _Copied(read, target, subset, valid, version)
        if b - a > _MAX_RUNS:  # scattered tokens (BSHD: one per row of the batch): one gather
            copied.tokens(index_runs(dst, count), index_runs(offset - lo, count))
            continue
        for d, o, n in zip(dst.tolist(), (offset - lo).tolist(), count.tolist()):
            copied.run(d, o, n)  # straight from where they are: one copy
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
