"""Request-level reads: listing, summary, one route, many routes at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, ID_RULE, parse_flag, valid_id
from replay_service.api import encode, lean
from replay_service.api.deps import RequestId, RunId, Settings, Store
from replay_service.api.models import (
    ARROW_ANSWER,
    CONFLICT,
    ERRORS,
    ROUTE_MEDIA_TYPES,
    RequestPage,
    RequestSummary,
    RouteJson,
    RouteParams,
    RouteQuery,
    binary_answer,
)
from replay_service.api.parts_response import PartsResponse
from replay_service.errors import InvalidInput
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ReadPlace, ServiceSettings
from replay_service.store import RouteStore, on_loop

router = APIRouter(prefix="/v1", tags=["requests"], responses=ERRORS)


@router.get("/runs/{run}/requests", summary="Requests of a run, filtered by flag, paginated by cursor",
            response_model=RequestPage)
def list_requests(
    run: RunId,
    store: Store,
    settings: Settings,
    flag: str | None = Query(None, description="only requests with rows carrying this flag (e.g. STALE, GAP)"),
    cursor: str | None = Query(None, description="next_cursor of the previous page"),
    limit: int = Query(100, ge=1),
) -> dict:
    wanted = parse_flag(flag) if flag else None
    return store.list_requests(run, wanted, cursor, min(limit, settings.page_limit_max)).to_json()


@router.get("/runs/{run}/requests/{request}", summary="One request: status, rows, counts per flag",
            response_model=RequestSummary)
def request_summary(run: RunId, request: RequestId, store: Store) -> dict:
    return store.request_summary(run, request).to_json()


@router.get(
    "/runs/{run}/requests/{request}/routes",
    summary="A request's route: Arrow IPC (default; replay_format/route.md), .npy or JSON by Accept or format; "
            "MoE layers or every model layer (layer_axis); which computation of a recomputed position (recompute), "
            "one weight version only (weight_version)",
    response_class=PartsResponse,
    responses={200: {**binary_answer(*ROUTE_MEDIA_TYPES, description="Arrow: route.md (a weight_version column); "
                                     ".npy: (n, layers, K) ids, the versions in the X-Replay-Weight-Versions header "
                                     "(spans JSON); JSON: RouteJson"), "model": RouteJson}, **CONFLICT},
    openapi_extra=lean.openapi_parameters(
        RouteParams, {"run": f"run id: {ID_RULE}", "request": f"request id: {ID_RULE}"}, headers=("accept",)),
)
async def get_route(request: Request) -> PartsResponse:
    """The hot read (the web view's and every script's first): parameters parsed by api/lean.py; read and
    encoded on the event loop when nothing there would wait (placement/on_loop.py: a local store, its segments
    opened, an Arrow or .npy answer), else in a thread; the parts sent as views of the route's arrays."""
    run = lean.path_id(request, "run", "run id")
    request_id = lean.path_id(request, "request", "request id")
    query = lean.query(request, RouteParams)
    store: RouteStore = request.app.state.store
    settings: ServiceSettings = request.app.state.settings
    kind = encode.pick_format(query.format, request.headers.get("accept"))
    selection = encode.Selection(query.recompute, query.weight_version)

    def work() -> encode.Answer:
        route = store.read_route(run, request_id, query.start, query.end, selection.rule, selection.weight_version)
        if query.strict:
            encode.refuse_if_flagged(route, settings.strict_report_rows, f"request {request_id!r}")
        return encode.route_answer(run, route, query.start, kind, settings.max_json_rows, query.layer_axis, selection)

    answer = _on_loop(work) if kind != encode.RouteFormat.JSON and store.reads_on_loop else None
    place = ReadPlace.EVENT_LOOP
    if answer is None:
        answer, place = await run_in_threadpool(work), ReadPlace.THREAD
    metrics: ServiceMetrics = request.app.state.metrics
    metrics.route_reads.labels(place.value).inc()
    return PartsResponse(answer.parts, answer.media_type, answer.headers)


def _on_loop(work: Callable[[], encode.Answer]) -> encode.Answer | None:
    """`work()` run here, on the event loop, or None when it would wait (then it is run in a thread)."""
    try:
        with on_loop.on_event_loop():
            return work()
    except on_loop.WouldWait:
        return None


@router.post(
    "/runs/{run}/routes/batch",
    summary="Many routes at once: one Arrow IPC stream (route.md), one record batch per request, in order",
    response_class=PartsResponse,
    responses={200: binary_answer(*ARROW_ANSWER, description="route.md: one record batch per request"), **CONFLICT},
)
async def batch_routes(run: RunId, body: RouteQuery, store: Store, settings: Settings) -> Response:
    if len(body.requests) > settings.max_batch_requests:
        raise InvalidInput(f"{len(body.requests)} requests exceeds max_batch_requests={settings.max_batch_requests}")
    for rid in body.requests:
        if not valid_id(rid):
            raise InvalidInput(f"request id {rid!r} is not a valid id: {ID_RULE}")
    answer = await run_in_threadpool(encode.batch_answer, store, run, body.requests, body.start, body.end,
                                     body.strict, settings.strict_report_rows, body.layer_axis,
                                     encode.Selection(body.recompute, body.weight_version))
    if isinstance(answer, encode.Answer):  # built whole: its parts in a few writes, Content-Length known
        return PartsResponse(answer.parts, answer.media_type, answer.headers)
    return StreamingResponse(_streamed(answer), media_type=ARROW_STREAM_MEDIA_TYPE)


async def _streamed(chunks: Iterator[list[memoryview]]) -> AsyncIterator[memoryview]:
    """Each request's parts as its read finishes: one thread hop per request (the read), none per part."""
    async for chunk in iterate_in_threadpool(chunks):
        for part in chunk:
            yield part
