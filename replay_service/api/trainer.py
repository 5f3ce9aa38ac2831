"""Trainer layouts: Megatron-core RouterReplay per rank, verl dense batches (see replay_service/layouts.py)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, ID_RULE, valid_id
from replay_service import layouts
from replay_service.errors import InvalidInput
from replay_service.api.deps import Settings, Store
from replay_service.layout_reads import SequenceRef, common_shape, encode, gather, layer_selection, sequence_specs

router = APIRouter(prefix="/v1/trainer", tags=["trainer"])


class Sequence(BaseModel):
    run: str = Field(description="run id")
    request: str = Field(description="request id")
    start: int = Field(0, ge=0, description="first position fed (multi-turn: only rows from here on)")
    num_tokens: int | None = Field(
        None, ge=1, description="tokens fed from start; default: the whole request (rows + 1)"
    )


class _Common(BaseModel):
    sequences: list[Sequence] = Field(min_length=1, description="the micro-batch, in order")
    layers: list[int] | None = Field(None, description="MoE ordinals of this pipeline stage (default: all)")
    model_layers: tuple[int, int] | None = Field(None, description="this stage's model layers [lo, hi)")
    strict: bool = Field(False, description="409 instead of filler when a token's recorded row is flagged or missing")


class MegatronQuery(_Common):
    packing: Literal["thd", "bshd"] = "thd"
    pad_multiple: int | None = Field(None, ge=1, description="THD: pad each sequence to this multiple (default tp*cp*2 with CP, else tp)")
    seq_length: int | None = Field(None, ge=1, description="BSHD: padded sequence length (default: longest, rounded up)")
    cp_size: int = Field(1, ge=1)
    cp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1, description="sequence-parallel size (TP size with SP on; 1 with SP off)")
    tp_rank: int = Field(0, ge=0)


class VerlQuery(_Common):
    prompt_lengths: list[int] = Field(description="prompt tokens of each sequence (before left padding)")
    prompt_width: int = Field(ge=1, description="padded prompt length (left-padded)")
    response_width: int = Field(ge=0, description="padded response length (right-padded)")


def _refs(body: _Common, settings) -> list[SequenceRef]:
    if len(body.sequences) > settings.max_batch_requests:
        raise InvalidInput(f"{len(body.sequences)} sequences exceeds max_batch_requests={settings.max_batch_requests}")
    for s in body.sequences:
        for kind, value in (("run id", s.run), ("request id", s.request)):
            if not valid_id(value):
                raise InvalidInput(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    return [SequenceRef(s.run, s.request, s.start, s.num_tokens) for s in body.sequences]


def _answer(store, settings, body: _Common, refs, make_plan, layout: dict) -> Response:
    shape = common_shape(store, refs)
    sel = layer_selection(shape, body.layers, body.model_layers)
    specs = sequence_specs(store, refs)
    try:
        plan = make_plan(specs)
    except layouts.LayoutError as exc:
        raise InvalidInput(str(exc)) from None
    if plan.num_tokens > settings.max_read_rows:
        raise InvalidInput(
            f"this rank's slice is {plan.num_tokens} tokens, more than one read returns "
            f"(REPLAY_MAX_READ_ROWS={settings.max_read_rows}); use smaller micro-batches")
    experts, valid = gather(store, refs, specs, plan, shape, sel, body.strict, settings.strict_report_rows)
    layout = {**layout, "tokens": plan.num_tokens, "total_tokens": plan.total_tokens,
              "seq_length": plan.seq_length, "cu_seqlens": plan.cu_seqlens,
              "cu_seqlens_padded": plan.cu_seqlens_padded, "sequences": len(refs)}
    parts = encode(plan, specs, experts, valid, shape, sel, layout)
    headers = {"X-Layout-Tokens": str(plan.num_tokens), "X-Layout-Valid": str(int(valid.sum())),
               "Content-Length": str(sum(len(p) for p in parts))}
    # the parts reference the gathered arrays: no copy of the ids between the gather and the socket
    return StreamingResponse(iter([memoryview(p) for p in parts]), media_type=ARROW_STREAM_MEDIA_TYPE,
                             headers=headers)


@router.post(
    "/megatron",
    summary="One rank's RouterReplay data: router tokens in Megatron order (THD/BSHD, CP and SP slices)",
    responses={200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
)
async def megatron(body: MegatronQuery, store: Store, settings: Settings) -> Response:
    refs = _refs(body, settings)

    def make_plan(specs):
        return layouts.megatron_plan(
            [s.num_tokens for s in specs], body.packing, body.pad_multiple, body.seq_length,
            body.cp_size, body.cp_rank, body.tp_size, body.tp_rank,
        )

    layout = {"kind": "megatron", "packing": body.packing, "cp_size": body.cp_size, "cp_rank": body.cp_rank,
              "tp_size": body.tp_size, "tp_rank": body.tp_rank}
    return await run_in_threadpool(_answer, store, settings, body, refs, make_plan, layout)


@router.post(
    "/verl",
    summary="verl's dense [batch, prompt_width + response_width, L, K]: left-padded prompts, right-padded responses",
    responses={200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
)
async def verl(body: VerlQuery, store: Store, settings: Settings) -> Response:
    refs = _refs(body, settings)
    if len(body.prompt_lengths) != len(refs):
        raise InvalidInput(f"prompt_lengths has {len(body.prompt_lengths)} entries for {len(refs)} sequences")

    def make_plan(specs):
        return layouts.verl_plan(body.prompt_lengths, [s.num_tokens for s in specs], body.prompt_width,
                                 body.response_width)

    layout = {"kind": "verl", "batch": len(refs), "prompt_width": body.prompt_width,
              "response_width": body.response_width, "prompt_lengths": body.prompt_lengths}
    return await run_in_threadpool(_answer, store, settings, body, refs, make_plan, layout)
