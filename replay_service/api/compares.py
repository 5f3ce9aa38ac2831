"""Rollout-vs-training agreement: post a trainer's routing, read stored comparisons."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_format.weight_versions import check_label
from replay_service.api.deps import RequestId, RunId, Settings, Store, read_body
from replay_service.api.models import (
    BODY_LIMITS,
    CONFLICT,
    ERRORS,
    POSITION_END_MAX,
    CompareList,
    CompareRequestDetail,
    CompareResult,
)
from replay_service.compare.comparison import Posted, compare_request_detail, record_compare
from replay_service.errors import InvalidInput, UnsupportedMediaType

router = APIRouter(prefix="/v1", tags=["compare"], responses=ERRORS)

ARROW_TYPES = (ARROW_STREAM_MEDIA_TYPE, "application/octet-stream")


@router.post(
    "/runs/{run}/compare",
    summary="Compare a trainer's own top-k (a compare body, replay_format/compare.md) with the recorded routes; "
            "stored and answered",
    response_model=CompareResult,
    responses={**CONFLICT, **BODY_LIMITS},
    openapi_extra={"requestBody": {"required": True, "content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
)
async def compare(
    run: RunId,
    request: Request,
    store: Store,
    settings: Settings,
    label: str | None = Query(None, max_length=200, description="free text naming this comparison"),
    step: int | None = Query(None, ge=0, le=2**53, description="the training step it was made at (the agreement "
                             "series: GET /v1/runs/{run}/agreement)"),
    weight_version: str | None = Query(None, description="the weight version the trainer's routing is of"),
) -> dict:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media not in ARROW_TYPES:
        raise UnsupportedMediaType(f"compare takes {ARROW_STREAM_MEDIA_TYPE}, got {media}")
    async with request.app.state.ingest_slots:  # bounds bodies held in memory, like ingest
        body = await read_body(request, settings.max_body_bytes)
    if weight_version is not None:
        try:
            check_label(weight_version, "weight_version")
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
    return await run_in_threadpool(record_compare, store, run, body, label, Posted(step, weight_version))


@router.get("/runs/{run}/compares", summary="Stored comparisons of a run, newest first", response_model=CompareList)
def list_compares(run: RunId, store: Store) -> dict:
    store.run_shape(run)  # NotFound for an unknown run
    return {"compares": store.compares.list(run)}


@router.get("/runs/{run}/compares/{compare_id}", summary="One stored comparison", response_model=CompareResult)
def get_compare(run: RunId, compare_id: str, store: Store) -> dict:
    return store.compares.get(run, compare_id)


@router.get(
    "/runs/{run}/compares/{compare_id}/requests/{request}",
    summary="Per-position, per-MoE-layer mismatch (0|1) of one request in a stored comparison",
    response_model=CompareRequestDetail,
)
def compare_request(
    run: RunId,
    compare_id: str,
    request: RequestId,
    store: Store,
    settings: Settings,
    start: int = Query(0, ge=0, le=POSITION_END_MAX),
    end: int | None = Query(None, ge=0, le=POSITION_END_MAX,
                            description="exclusive; default: after the last position compared"),
) -> dict:
    return compare_request_detail(store, run, compare_id, request, start, end, settings.max_json_rows)
