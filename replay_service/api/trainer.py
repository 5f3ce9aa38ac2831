"""Trainer slices over HTTP: Megatron-core RouterReplay per rank, verl dense batches (replay_service/trainer/)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_format.trainer_slice import Packing
from replay_service.api.deps import Settings, Store
from replay_service.api.models import CONFLICT, ERRORS, binary_answer
from replay_service.settings import ServiceSettings
from replay_service.trainer import layouts
from replay_service.trainer.reads import SequenceRef, SliceAnswer, SliceLimits, SliceQuery, read_rank_slice

router = APIRouter(prefix="/v1/trainer", tags=["trainer"], responses=ERRORS)

SLICE_ANSWER = {200: binary_answer(ARROW_STREAM_MEDIA_TYPE, description="a trainer slice: one row per router token "
                                   "of this rank (replay_format/trainer_slice.md)"), **CONFLICT}


class Sequence(BaseModel):
    """One sequence of the micro-batch."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="run id")
    request: str = Field(description="request id")
    start: int = Field(0, ge=0, description="first position fed (multi-turn: only rows from here on)")
    num_tokens: int | None = Field(
        None, ge=1, description="tokens fed from start; default: the whole request (rows + 1)"
    )


class _Common(BaseModel):
    # an unknown field is refused, never ignored: a misspelt (or pre-rename) stage field would serve every layer
    model_config = ConfigDict(extra="forbid")

    sequences: list[Sequence] = Field(min_length=1, description="the micro-batch, in order")
    moe_ordinals: list[int] | None = Field(None, description="MoE ordinals of this pipeline stage (default: all)")
    model_layer_range: tuple[int, int] | None = Field(
        None, description="or: this stage's model layers [lo, hi); the MoE layers among them")
    strict: bool = Field(False, description="409 instead of filler when a token's recorded row is flagged or missing")

    def query(self) -> SliceQuery:
        """The domain query of this body."""
        refs = [SequenceRef(s.run, s.request, s.start, s.num_tokens) for s in self.sequences]
        return SliceQuery(refs, self.moe_ordinals, self.model_layer_range, self.strict)


class MegatronQuery(_Common):
    """One rank of a Megatron micro-batch."""

    packing: Packing = Packing.THD
    pad_multiple: int | None = Field(None, ge=1, description="THD: pad each sequence to this multiple "
                                     "(default tp*cp*2 with CP, else tp)")
    seq_length: int | None = Field(None, ge=1, description="BSHD: padded sequence length (default: longest, "
                                   "rounded up)")
    cp_size: int = Field(1, ge=1)
    cp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1, description="sequence-parallel size (TP size with SP on; 1 with SP off)")
    tp_rank: int = Field(0, ge=0)


class VerlQuery(_Common):
    """A verl micro-batch, dense."""

    prompt_lengths: list[int] = Field(description="prompt tokens of each sequence (before left padding)")
    prompt_width: int = Field(ge=1, description="padded prompt length (left-padded)")
    response_width: int = Field(ge=0, description="padded response length (right-padded)")


def _limits(settings: ServiceSettings) -> SliceLimits:
    return SliceLimits(settings.max_batch_requests, settings.max_read_rows, settings.strict_report_rows)


def _streamed(answer: SliceAnswer) -> StreamingResponse:
    headers = {"X-Layout-Tokens": str(answer.tokens), "X-Layout-Valid": str(answer.valid),
               "Content-Length": str(answer.size)}
    # the parts reference the gathered arrays: no copy of the ids between the gather and the socket
    return StreamingResponse(iter(answer.parts), media_type=ARROW_STREAM_MEDIA_TYPE, headers=headers)


@router.post(
    "/megatron",
    summary="One rank's RouterReplay data: router tokens in Megatron order (THD/BSHD, CP and SP slices)",
    response_class=StreamingResponse,
    responses=SLICE_ANSWER,
)
async def megatron(body: MegatronQuery, store: Store, settings: Settings) -> StreamingResponse:
    def make_plan(specs: list[layouts.SequenceSpec]) -> layouts.TokenPlan:
        return layouts.megatron_plan([s.num_tokens for s in specs], body.packing, body.pad_multiple, body.seq_length,
                                     body.cp_size, body.cp_rank, body.tp_size, body.tp_rank)

    return _streamed(await run_in_threadpool(read_rank_slice, store, body.query(), make_plan, _limits(settings)))


@router.post(
    "/verl",
    summary="verl's dense [batch, prompt_width + response_width, L, K]: left-padded prompts, right-padded responses",
    response_class=StreamingResponse,
    responses=SLICE_ANSWER,
)
async def verl(body: VerlQuery, store: Store, settings: Settings) -> StreamingResponse:
    def make_plan(specs: list[layouts.SequenceSpec]) -> layouts.TokenPlan:
        return layouts.verl_plan(body.prompt_lengths, [s.num_tokens for s in specs], body.prompt_width,
                                 body.response_width)

    return _streamed(await run_in_threadpool(read_rank_slice, store, body.query(), make_plan, _limits(settings)))
