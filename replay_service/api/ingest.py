"""Writers: batches of rows, whole routes from engine outputs, and request ends."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, FormatError

from replay_format.rows import RowsMeta, shape_metadata
from replay_service.decode import (
    EngineRoute,
    IncomingRows,
    decode_ingest,
    decode_npy,
    decode_sglang_json,
    engine_route_rows,
    parse_meta,
    read_arrow_body,
    rows_from_table,
)
from replay_service.api.deps import Metrics, RequestId, RunId, Settings, Store, pooled_body, read_body
from replay_service.errors import InvalidInput, ServiceError, UnsupportedMediaType
from replay_service.store import IngestResult, RouteStore

router = APIRouter(prefix="/v1", tags=["ingest"])

ARROW_TYPES = (ARROW_STREAM_MEDIA_TYPE, "application/octet-stream")


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _body(request: Request, settings) -> bytes:
    async with request.app.state.ingest_slots:  # bounds bodies held in memory
        return await read_body(request, settings.max_body_bytes)


def _record(metrics, result: IngestResult) -> dict:
    if result.stored:
        metrics.batches.labels("stored").inc()
        metrics.rows_ingested.inc(result.rows)
        metrics.bytes_stored.inc(result.bytes)
        metrics.padding_dropped.inc(result.padding_dropped)
        for name, count in result.flagged.items():
            metrics.rows_flagged.labels(name).inc(count)
    else:
        metrics.batches.labels("duplicate").inc()
    return {
        "stored": result.stored,
        "duplicate": not result.stored,
        "rows": result.rows,
        "padding_dropped": result.padding_dropped,
        "flagged": result.flagged,
        "bytes": result.bytes,
    }


@router.post("/ingest", summary="Store a batch of rows (Arrow IPC stream, idempotent on run_id, writer_id, seq)")
async def ingest(request: Request, store: Store, settings: Settings, metrics: Metrics) -> dict:
    media = _media_type(request)
    if media and media not in ARROW_TYPES:
        raise UnsupportedMediaType(f"ingest takes {ARROW_STREAM_MEDIA_TYPE}, got {media}")
    # The slot is held until the rows are stored: bodies in memory stay bounded, and
    # the body's buffer goes back to the pool only when nothing reads it any more.
    async with request.app.state.ingest_slots, pooled_body(
        request, settings.max_body_bytes, request.app.state.body_buffers
    ) as body:
        try:
            result = await run_in_threadpool(lambda: store.ingest(decode_ingest(body)))
        except (ServiceError, FormatError):
            metrics.batches.labels("rejected").inc()
            raise
    return _record(metrics, result)


class FinishBody(BaseModel):
    num_tokens: int = Field(ge=0, description="final token count T (prompt + generated); the route has T-1 rows")
    status: Literal["finished", "aborted"] = "finished"


@router.post("/runs/{run}/requests/{request}/finish", summary="Mark a request finished or aborted")
def finish(run: RunId, request: RequestId, body: FinishBody, store: Store) -> dict:
    return store.finish(run, request, body.num_tokens, body.status)


def _parse_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidInput(f"moe_layers={text!r} is not a comma-separated list of layer indices") from None


def _arrow_route_rows(store: RouteStore, run: str, request_id: str, body: bytes) -> IncomingRows:
    import pyarrow as pa

    table = read_arrow_body(body)
    md = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if store.has_run(run) and "num_moe_layers" not in md and "num_layers" not in md:
        md = {**shape_metadata(store.run_shape(run)), **md}
    md.update({"run_id": run, "writer_id": "upload", "seq": "0"})
    md.setdefault("source", "vllm-output")
    meta = parse_meta(md)
    meta = RowsMeta(run, f"upload/{request_id}", 0, meta.shape, meta.source)
    if "request_id" in table.schema.names:
        table = table.drop_columns(["request_id"])
    table = table.add_column(0, "request_id", pa.array([request_id] * table.num_rows, pa.utf8()))
    return rows_from_table(table, meta)


@router.post(
    "/runs/{run}/requests/{request}/routes",
    summary="Store a whole route: .npy (T-1, layers, K), SGLang base64 JSON, or Arrow",
)
async def upload_route(
    run: RunId,
    request: RequestId,
    http: Request,
    store: Store,
    settings: Settings,
    metrics: Metrics,
    num_experts: int | None = Query(None, ge=1, le=65536, description="needed when the run is new (npy)"),
    moe_layers: str | None = Query(None, description="comma-separated MoE layer indices of the array"),
    finish: bool = Query(True, description="also mark the request finished with T = rows + 1 tokens"),
) -> dict:
    media = _media_type(http)
    body = await _body(http, settings)

    def work() -> tuple[IngestResult, int]:
        run_shape = store.run_shape(run) if store.has_run(run) else None
        if media == NPY_MEDIA_TYPE:
            route = EngineRoute(decode_npy(body), None, _parse_layers(moe_layers), None, "vllm-output")
            rows = engine_route_rows(run, request, route, run_shape, num_experts)
        elif media == "application/json":
            route = decode_sglang_json(body)
            if moe_layers:
                route.moe_layers = _parse_layers(moe_layers)
            rows = engine_route_rows(run, request, route, run_shape, num_experts)
        elif media in ARROW_TYPES:
            rows = _arrow_route_rows(store, run, request, body)
        else:
            raise UnsupportedMediaType(f"a route is {NPY_MEDIA_TYPE}, application/json or {ARROW_STREAM_MEDIA_TYPE}; got {media or 'no content type'}")
        result = store.ingest(rows)
        if finish:
            store.finish(run, request, int(rows.positions.max()) + 2 if rows.num_rows else 1, "finished")
        return result, rows.num_rows

    result, _ = await run_in_threadpool(work)
    return _record(metrics, result)
