"""Rollout-vs-training agreement: post a trainer's routing, read stored comparisons."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_service.compare import run_compare
from replay_service.errors import InvalidInput, UnsupportedMediaType
from replay_service.api.deps import RequestId, RunId, Settings, Store, read_body

router = APIRouter(prefix="/v1", tags=["compare"])

ARROW_TYPES = (ARROW_STREAM_MEDIA_TYPE, "application/octet-stream")


@router.post(
    "/runs/{run}/compare",
    summary="Compare a trainer's own top-k (Arrow IPC rows) with the recorded routes; stored and answered",
)
async def compare(
    run: RunId,
    request: Request,
    store: Store,
    settings: Settings,
    label: str | None = Query(None, max_length=200, description="free text naming this comparison"),
) -> dict:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media not in ARROW_TYPES:
        raise UnsupportedMediaType(f"compare takes {ARROW_STREAM_MEDIA_TYPE}, got {media}")
    async with request.app.state.ingest_slots:  # bounds bodies held in memory, like ingest
        body = await read_body(request, settings.max_body_bytes)

    def work() -> dict:
        doc, per_request = run_compare(store, run, body, label)
        store.compares.save(doc, per_request)
        return doc

    return await run_in_threadpool(work)


@router.get("/runs/{run}/compares", summary="Stored comparisons of a run, newest first")
def list_compares(run: RunId, store: Store) -> dict:
    store.run_shape(run)  # 404 for an unknown run
    return {"compares": store.compares.list(run)}


@router.get("/runs/{run}/compares/{compare_id}", summary="One stored comparison")
def get_compare(run: RunId, compare_id: str, store: Store) -> dict:
    return store.compares.get(run, compare_id)


@router.get(
    "/runs/{run}/compares/{compare_id}/requests/{request}",
    summary="Per-position, per-layer mismatch (0|1) of one request in a stored comparison",
)
def compare_request(
    run: RunId,
    compare_id: str,
    request: RequestId,
    store: Store,
    settings: Settings,
    start: int = Query(0, ge=0),
    end: int | None = Query(None, ge=0, description="exclusive; default: after the last position compared"),
) -> dict:
    positions, bits, num_layers = store.compares.request_mismatch(run, compare_id, request)
    if end is None:
        end = int(positions[-1]) + 1 if len(positions) else start
    if end < start:
        raise InvalidInput(f"bad range start={start} end={end}")
    keep = (positions >= start) & (positions < end)
    if int(keep.sum()) > settings.max_json_rows:
        raise InvalidInput(
            f"{int(keep.sum())} positions is more than JSON serves ({settings.max_json_rows}); use start/end")
    return {
        "request_id": request,
        "start": start,
        "end": end,
        "num_layers": num_layers,
        "positions": positions[keep].tolist(),
        "mismatch": bits[keep].tolist(),
    }
