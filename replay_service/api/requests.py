"""Request-level reads: listing, summary, one route, many routes at once."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, ID_RULE, parse_flag, valid_id
from replay_format.rows import rows_schema
from replay_service import encode
from replay_service.errors import InvalidInput
from replay_service.api.deps import RequestId, RunId, Settings, Store

router = APIRouter(prefix="/v1", tags=["requests"])


@router.get("/runs/{run}/requests", summary="Requests of a run, filtered by flag, paginated by cursor")
def list_requests(
    run: RunId,
    store: Store,
    settings: Settings,
    flag: str | None = Query(None, description="only requests with rows carrying this flag (e.g. STALE, GAP)"),
    cursor: str | None = Query(None, description="next_cursor of the previous page"),
    limit: int = Query(100, ge=1),
) -> dict:
    try:
        wanted = parse_flag(flag) if flag else None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return store.list_requests(run, wanted, cursor, min(limit, settings.page_limit_max))


@router.get("/runs/{run}/requests/{request}", summary="One request: status, rows, counts per flag")
def request_summary(run: RunId, request: RequestId, store: Store) -> dict:
    return store.request_summary(run, request)


@router.get(
    "/runs/{run}/requests/{request}/routes",
    summary="A request's route: Arrow IPC (default), .npy or JSON by Accept or format",
    responses={200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}, "application/x-npy": {}, "application/json": {}}}},
)
async def get_route(
    run: RunId,
    request: RequestId,
    store: Store,
    settings: Settings,
    start: int = Query(0, ge=0),
    end: int | None = Query(None, ge=0, description="exclusive; default: T-1 when finished, else last position + 1"),
    strict: bool = Query(False, description="409 instead of data when any row in range is flagged or missing"),
    format: str | None = Query(None, description="arrow | npy | json (overrides Accept)"),
    accept: str | None = Header(None),
) -> Response:
    kind = encode.pick_format(format, accept)

    def work() -> Response:
        route = store.read_route(run, request, start, end)
        stop = start + route.num_rows
        if strict:
            encode.refuse_if_flagged(route, settings.strict_report_rows, f"request {request!r}")
        headers = {"X-Route-Start": str(start), "X-Route-End": str(stop)}
        if kind == "json":
            if route.num_rows > settings.max_json_rows:
                raise InvalidInput(
                    f"{route.num_rows} rows is more than JSON serves ({settings.max_json_rows}); "
                    "use start/end, or format=arrow or npy",)
            return Response(
                content=_json_bytes(encode.route_json(run, route, start, stop)),
                media_type="application/json",
                headers=headers,
            )
        counts = encode.flag_counts(route.flags)
        headers["X-Route-Flags"] = ",".join(f"{k}={v}" for k, v in counts.items()) or "none"
        if kind == "npy":
            return Response(encode.npy_bytes(route.experts_3d()), media_type=encode.FORMATS["npy"], headers=headers)
        batch = route.to_batch(encode.route_metadata(run, route, start, stop))
        return Response(encode.arrow_stream([batch]), media_type=ARROW_STREAM_MEDIA_TYPE, headers=headers)

    return await run_in_threadpool(work)


def _json_bytes(doc: dict) -> bytes:
    import json

    return json.dumps(doc, separators=(",", ":")).encode()


class BatchQuery(BaseModel):
    requests: list[str] = Field(min_length=1, description="request ids, answered in this order")
    start: int = Field(0, ge=0)
    end: int | None = Field(None, ge=0)
    strict: bool = False


class _Chunks:
    """A write-only file object that hands Arrow's output to a generator."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


@router.post(
    "/runs/{run}/routes/batch",
    summary="Many routes at once: one Arrow IPC stream, one record batch per request, in order",
    responses={200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
)
async def batch_routes(run: RunId, body: BatchQuery, store: Store, settings: Settings) -> Response:
    if len(body.requests) > settings.max_batch_requests:
        raise InvalidInput(f"{len(body.requests)} requests exceeds max_batch_requests={settings.max_batch_requests}")
    for rid in body.requests:
        if not valid_id(rid):
            raise InvalidInput(f"request id {rid!r} is not a valid id: {ID_RULE}")
    shape = store.run_shape(run)

    def check_all() -> None:
        for rid in body.requests:
            route = store.read_route(run, rid, body.start, body.end)
            if body.strict:
                encode.refuse_if_flagged(route, settings.strict_report_rows, f"request {rid!r}")

    # Every request is read once before the first byte goes out, so a missing
    # request or a strict refusal is a clean 404/409 instead of a cut stream.
    await run_in_threadpool(check_all)
    metadata = {"run_id": run, "num_layers": str(shape.num_moe_layers), "top_k": str(shape.top_k),
                "num_experts": str(shape.num_experts), "requests": str(len(body.requests))}

    def stream() -> Iterator[bytes]:
        sink = _Chunks()
        writer = pa.ipc.new_stream(sink, rows_schema(shape, metadata))
        for rid in body.requests:
            route = store.read_route(run, rid, body.start, body.end)
            writer.write_batch(route.to_batch())
            yield sink.take()
        writer.close()
        yield sink.take()

    return StreamingResponse(stream(), media_type=ARROW_STREAM_MEDIA_TYPE)
