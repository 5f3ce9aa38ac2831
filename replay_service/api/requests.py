"""Request-level reads: listing, summary, one route, many routes at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, ID_RULE, parse_flag, valid_id
from replay_service.api import encode
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
)
async def get_route(
    run: RunId,
    request: RequestId,
    store: Store,
    settings: Settings,
    query: Annotated[RouteParams, Query()],
    accept: str | None = Header(None),
) -> PartsResponse:
    kind = encode.pick_format(query.format, accept)
    start, end, axis = query.start, query.end, query.layer_axis

    selection = encode.Selection(query.recompute, query.weight_version)

    def work() -> encode.Answer:
        route = store.read_route(run, request, start, end, selection.rule, selection.weight_version)
        if query.strict:
            encode.refuse_if_flagged(route, settings.strict_report_rows, f"request {request!r}")
        return encode.route_answer(run, route, start, kind, settings.max_json_rows, axis, selection)

    answer = await run_in_threadpool(work)
    # the parts view the route's arrays: no copy of the ids between the store and the socket
    return PartsResponse(answer.parts, answer.media_type, answer.headers)


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
