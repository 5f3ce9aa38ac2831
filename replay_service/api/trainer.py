"""Trainer slices over HTTP: Megatron-core RouterReplay per rank, verl dense batches (replay_service/trainer/).

The bodies here validate what the trainer runs and become the trainer query (replay_format/trainer_query.md);
`replay_service.trainer.reads.read_slice` plans its tokens and builds the slice.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, LayerAxis, ReplayDeprecationWarning
from replay_format import trainer_query as tq
from replay_format.trainer_slice import Convention, CpSplit, MissingPolicy, Packing, TotalPad
from replay_service.api.deps import Settings, SliceBuilds, Store
from replay_service.api.encode import joined_small
from replay_service.api.models import CONFLICT, ERRORS, LAYOUT_LIMITS, binary_answer
from replay_service.api.parts_response import PartsResponse
from replay_service.trainer.plans import SliceLimits
from replay_service.trainer.reads import read_slice

router = APIRouter(prefix="/v1/trainer", tags=["trainer"], responses=ERRORS)

# Static bounds on every number of a body: each fits int32 (positions do), so no value reaches numpy or
# SQLite that they cannot hold; what a size may allocate is then bounded by the settings (`_check_size`).
INT32_MAX = 2**31 - 1
MAX_PARALLEL = 1 << 16  # TP and CP sizes and ranks
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]

SLICE_ANSWER = {200: binary_answer(ARROW_STREAM_MEDIA_TYPE, description="a trainer slice: one row per router token "
                                   "of this rank (replay_format/trainer_slice.md)"), **CONFLICT, **LAYOUT_LIMITS}


class SequenceRefBody(BaseModel):
    """One sequence of the micro-batch (the body's form of the query's `SequenceRef`)."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="run id")
    request: str = Field(description="request id")
    start: int = Field(0, ge=0, le=INT32_MAX, description="first position fed (multi-turn: only rows from here on)")
    num_tokens: int | None = Field(
        None, ge=1, le=INT32_MAX, description="tokens fed from start; default: the whole request (rows + 1)"
    )

    def ref(self) -> tq.SequenceRef:
        """This sequence as the query names it."""
        return tq.SequenceRef(self.run, self.request, self.start, self.num_tokens)


class _Common(BaseModel):
    # an unknown field is refused, never ignored: a misspelt (or pre-rename) stage field would serve every layer
    model_config = ConfigDict(extra="forbid")

    sequences: list[SequenceRefBody] = Field(min_length=1, description="the micro-batch, in order")
    moe_ordinals: list[Int32] | None = Field(None, description="MoE ordinals of this pipeline stage (default: all; "
                                           "moe axis only)")
    model_layer_range: tuple[Int32, Int32] | None = Field(
        None, description="or: this stage's model layers [lo, hi); the MoE layers among them (model axis: all of "
        "them, dense ones zero)")
    layer_axis: LayerAxis = Field(LayerAxis.MOE, description="moe: the MoE layers only; model: every model layer, "
                                  "dense ones zero, as vLLM's routed_experts (slime, miles, verl index by model "
                                  "layer)")
    missing: MissingPolicy | None = Field(
        None, description="a real token whose recorded row is flagged or missing: strict (default) answers 409 "
        "naming the rows; router sets fallback=1 (the trainer's router picks that token's experts: NeMo-RL's -1 "
        "rows); filler replays filler ids (valid=0), which changes every later token's hidden state")
    strict: bool | None = Field(None, description="deprecated alias: true = missing=strict, false = missing=filler")
    versions: tq.VersionPolicy = Field(
        tq.VersionPolicy.ANY, description="any (default): rows as recorded, each token's weight version in the "
        "slice; single: 409 naming every sequence whose rows were computed by more than one weight version")

    QUERY: ClassVar[type[tq.MegatronQuery] | type[tq.VerlQuery]]  # the trainer query a body of this kind is

    def query(self) -> tq.TrainerQuery:
        """This body as the trainer query (replay_format/trainer_query.md): the same fields, typed and frozen.

        The fields of a kind (Megatron's, verl's) go over by name, lists as tuples.
        """
        own = {name: getattr(self, name) for name in type(self).model_fields if name not in _Common.model_fields}
        layers = tq.StageLayers(None if self.moe_ordinals is None else tuple(self.moe_ordinals),
                                self.model_layer_range, self.layer_axis)
        return self.QUERY(sequences=tuple(s.ref() for s in self.sequences), layers=layers, missing=self.missing,
                          strict=self.strict, versions=self.versions, **{k: _frozen(v) for k, v in own.items()})


def _frozen(value: Any) -> Any:
    """A body's value as a frozen record holds it: a list as a tuple."""
    return tuple(value) if isinstance(value, list) else value


class MegatronQueryBody(_Common):
    """One rank of a Megatron micro-batch (the body of the query's `MegatronQuery`)."""

    packing: Packing = Packing.THD
    convention: Convention | None = Field(
        None, description="THD: pad as this trainer does (verl, slime, miles); fixes pad_multiple, total_multiple "
        "and total_pad, which are then refused")
    pad_multiple: int | None = Field(None, ge=1, le=INT32_MAX, description="pad each sequence to this multiple "
                                     "(default tp*cp*2 with CP, else tp: verl's rule; BSHD: the default seq_length's)")
    total_multiple: int | None = Field(None, ge=1, le=INT32_MAX, description="THD: pad the whole micro-batch (all CP "
                                       "ranks) to a multiple of this (default 1)")
    total_pad: TotalPad | None = Field(None, description="THD: where those tokens go: last_sequence (default; verl "
                                       "fp8, NeMo-RL) or tail (after the CP split, each rank's stream: slime/miles)")
    cp_split: CpSplit = Field(CpSplit.ZIGZAG, description="zigzag: each sequence in 2*cp chunks, rank r keeps r "
                              "and 2cp-1-r; contiguous: the padded stream in cp parts (slime/miles --allgather-cp)")
    data_pad_size_multiplier: int | None = Field(None, ge=1, le=INT32_MAX, description="convention slime/miles: their "
                                                 "--data-pad-size-multiplier (default 128)")
    fp8_padding: bool | None = Field(None, description="convention verl: tf_config.fp8 is e4m3 or hybrid "
                                     "(use_fp8_padding)")
    seq_length: int | None = Field(None, ge=1, le=INT32_MAX, description="BSHD: padded sequence length (default: "
                                   "longest, rounded up)")
    cp_size: int = Field(1, ge=1, le=MAX_PARALLEL)
    cp_rank: int = Field(0, ge=0, le=MAX_PARALLEL)
    tp_size: int = Field(1, ge=1, le=MAX_PARALLEL, description="TP size; the tokens are split over it when "
                         "sequence_parallel")
    tp_rank: int = Field(0, ge=0, le=MAX_PARALLEL)
    sequence_parallel: bool = Field(True, description="split this CP rank's tokens over TP (megatron-core's SP "
                                    "scatter; verl always does)")

    QUERY = tq.MegatronQuery


class VerlQueryBody(_Common):
    """A verl micro-batch, dense (the body of the query's `VerlQuery`)."""

    QUERY = tq.VerlQuery

    prompt_lengths: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        description="prompt tokens of each sequence (before left padding)")
    prompt_width: int = Field(ge=1, le=INT32_MAX, description="padded prompt length (left-padded)")
    response_width: int = Field(ge=0, le=INT32_MAX, description="padded response length (right-padded)")


# The bodies' names before they took `Body` (`Sequence` hid `collections.abc.Sequence`, the others the trainer
# query's records): deprecated, answered by `__getattr__` with a DeprecationWarning, for one release.
_RENAMED = {"Sequence": "SequenceRefBody", "MegatronQuery": "MegatronQueryBody", "VerlQuery": "VerlQueryBody"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: it is {new}", ReplayDeprecationWarning, stacklevel=2)
    return globals()[new]


async def _answered(store: Store, query: tq.TrainerQuery, settings: Settings, builds: SliceBuilds) -> PartsResponse:
    async with builds:  # a worker's builds take turns: threads contending for the GIL cost more CPU than they overlap
        answer = await run_in_threadpool(read_slice, store, query, SliceLimits.of(settings))
    headers = {"X-Layout-Tokens": str(answer.tokens), "X-Layout-Valid": str(answer.valid)}
    # the parts reference the gathered arrays: no copy of the ids between the gather and the socket; the
    # small framing parts joined, so the whole slice goes out in a few writes (not one loop round trip a part)
    return PartsResponse(joined_small(answer.parts), ARROW_STREAM_MEDIA_TYPE, headers)


@router.post(
    "/megatron",
    summary="One rank's RouterReplay data: router tokens in Megatron order (THD/BSHD, CP and SP slices)",
    response_class=PartsResponse,
    responses=SLICE_ANSWER,
)
async def megatron(body: MegatronQueryBody, store: Store, settings: Settings, builds: SliceBuilds) -> PartsResponse:
    return await _answered(store, body.query(), settings, builds)


@router.post(
    "/verl",
    summary="verl's dense [batch, prompt_width + response_width, L, K]: left-padded prompts, right-padded responses",
    response_class=PartsResponse,
    responses=SLICE_ANSWER,
)
async def verl(body: VerlQueryBody, store: Store, settings: Settings, builds: SliceBuilds) -> PartsResponse:
    return await _answered(store, body.query(), settings, builds)
