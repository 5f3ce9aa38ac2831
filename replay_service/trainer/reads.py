"""One rank's trainer slice: plan its tokens, read only their rows from the store, build the answer.

The answer is a trainer slice (replay_format/trainer_slice.md): one row per router token
of the rank, in the router's order. Tokens without a clean recorded row get
`layouts.filler_rows` and `valid == 0`; a strict read refuses them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from replay_format import ID_RULE, RunShape, flag_names, valid_id
from replay_format.trainer_slice import SliceMeta, build_slice
from replay_service.errors import Conflict, InvalidInput, StrictRefusal
from replay_service.store import RouteStore
from replay_service.trainer import layouts


@dataclass(frozen=True)
class SequenceRef:
    """One sequence of a micro-batch: a request's tokens from `start` (`num_tokens` of them; None: all)."""

    run: str
    request: str
    start: int = 0
    num_tokens: int | None = None


@dataclass(frozen=True)
class SliceQuery:
    """What one rank asks for, whatever the trainer: the micro-batch and the MoE layers of its stage."""

    sequences: list[SequenceRef]
    moe_ordinals: list[int] | None = None  # MoE ordinals of this pipeline stage
    model_layer_range: tuple[int, int] | None = None  # or: the stage's model layers [lo, hi)
    strict: bool = False  # refuse a flagged or missing row instead of giving filler


@dataclass(frozen=True)
class SliceLimits:
    """The service's bounds on one slice (from its settings)."""

    max_sequences: int
    max_tokens: int
    strict_report_rows: int  # bad rows named in a strict refusal


@dataclass
class SliceAnswer:
    """A built slice: the Arrow stream in parts (the gathered arrays' own buffers, uncopied) and two counts."""

    parts: list[memoryview]
    tokens: int
    valid: int

    @property
    def size(self) -> int:
        """Bytes of the whole stream."""
        return sum(p.nbytes for p in self.parts)


MakePlan = Callable[[list[layouts.SequenceSpec]], layouts.TokenPlan]


def read_rank_slice(store: RouteStore, query: SliceQuery, make_plan: MakePlan, limits: SliceLimits) -> SliceAnswer:
    """The slice of one rank: `make_plan` lays the micro-batch's sequences out (megatron or verl)."""
    refs = query.sequences
    if not refs:
        raise InvalidInput("a micro-batch needs at least one sequence")
    if len(refs) > limits.max_sequences:
        raise InvalidInput(f"{len(refs)} sequences exceeds max_batch_requests={limits.max_sequences}")
    for ref in refs:
        for kind, value in (("run id", ref.run), ("request id", ref.request)):
            if not valid_id(value):
                raise InvalidInput(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    shape = common_shape(store, refs)
    ordinals = moe_selection(shape, query.moe_ordinals, query.model_layer_range)
    specs = sequence_specs(store, refs)
    plan = make_plan(specs)
    if plan.num_tokens > limits.max_tokens:
        raise InvalidInput(
            f"this rank's slice is {plan.num_tokens} tokens, more than one read returns "
            f"(REPLAY_MAX_READ_ROWS={limits.max_tokens}); use smaller micro-batches")
    experts, valid = gather(store, refs, specs, plan, shape, ordinals, query.strict, limits.strict_report_rows)
    starts = np.array([s.start for s in specs], np.int64)
    position = np.where(plan.sequence >= 0, starts[np.maximum(plan.sequence, 0)] + plan.offset, -1).astype(np.int32)
    meta = SliceMeta(top_k=shape.top_k, num_experts=shape.num_experts, moe_ordinals=ordinals.tolist(),
                     moe_layers=[shape.moe_layers[i] for i in ordinals], layout=plan.layout)
    parts = build_slice(meta, experts, valid, plan.sequence, position)
    return SliceAnswer(parts, plan.num_tokens, int(valid.sum()))


def common_shape(store: RouteStore, refs: list[SequenceRef]) -> RunShape:
    """The one run shape of the micro-batch's runs; Conflict when two differ."""
    shape = store.run_shape(refs[0].run)
    for ref in refs[1:]:
        s = store.run_shape(ref.run)
        if s != shape:
            raise Conflict(
                f"run {ref.run!r} records {s.num_moe_layers} x top-{s.top_k} of {s.num_experts} (MoE layers "
                f"{list(s.moe_layers)}), unlike the micro-batch's first run; one micro-batch needs one model shape")
    return shape


def moe_selection(shape: RunShape, moe_ordinals: list[int] | None,
                  model_layer_range: tuple[int, int] | None) -> np.ndarray:
    """MoE ordinals of this pipeline stage: given directly, or by the stage's model layers [lo, hi); default all."""
    if moe_ordinals is not None and model_layer_range is not None:
        raise InvalidInput("give either moe_ordinals or model_layer_range ([lo, hi) of model layers), not both")
    if moe_ordinals is not None:
        sel = np.asarray(moe_ordinals, np.int64)
        if not sel.size or sel.min() < 0 or sel.max() >= shape.num_moe_layers:
            raise InvalidInput(f"moe_ordinals {moe_ordinals} are not MoE ordinals 0..{shape.num_moe_layers - 1}")
        return sel
    if model_layer_range is not None:
        lo, hi = model_layer_range
        sel = np.array([i for i, m in enumerate(shape.moe_layers) if lo <= m < hi], np.int64)
        if not sel.size:
            raise InvalidInput(f"model layers [{lo}, {hi}) hold no MoE layer (MoE layers are {list(shape.moe_layers)})")
        return sel
    return np.arange(shape.num_moe_layers, dtype=np.int64)


def sequence_specs(store: RouteStore, refs: list[SequenceRef]) -> list[layouts.SequenceSpec]:
    """Each sequence's rows, checked against the length rule (`layouts.sequence_spec`)."""
    return [
        layouts.sequence_spec(store.request_summary(ref.run, ref.request)["expected_rows"], ref.start, ref.num_tokens,
                              f"sequence {i} ({ref.run}/{ref.request})")
        for i, ref in enumerate(refs)
    ]


def gather(store: RouteStore, refs: list[SequenceRef], specs: list[layouts.SequenceSpec], plan: layouts.TokenPlan,
           shape: RunShape, ordinals: np.ndarray, strict: bool, report_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The plan's ids `(m, len(ordinals) * K)` and validity; StrictRefusal for a flagged or missing row when strict."""
    flagged: list[dict] = []

    def read_rows(i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        ref, spec = refs[i], specs[i]
        route = store.read_route(ref.run, ref.request, spec.start + lo, spec.start + hi)
        ok = route.flags == 0
        if strict and not ok.all() and len(flagged) < report_rows:
            for j in np.flatnonzero(~ok)[: report_rows - len(flagged)]:
                flagged.append({"run_id": ref.run, "request_id": ref.request, "position": int(route.positions[j]),
                                "flags": flag_names(int(route.flags[j]))})
        return route.experts, ok

    experts, valid = layouts.gather_rows(plan, specs, read_rows, shape.num_moe_layers, shape.top_k,
                                         shape.num_experts, ordinals, shape.dtype)
    if strict:
        rows_of = np.array([s.rows for s in specs], np.int64)
        needed = (plan.sequence >= 0) & (plan.offset < rows_of[np.maximum(plan.sequence, 0)])
        bad = np.flatnonzero(needed & (valid == 0))
        if bad.size:
            first = flagged[0]["position"] if flagged else int(specs[plan.sequence[bad[0]]].start + plan.offset[bad[0]])
            raise StrictRefusal(
                f"strict read refused: {bad.size} tokens of this rank have a flagged or missing row, the first at "
                f"position {first}", flagged,
            )
    return experts, valid
