"""Writers: batches of rows, whole routes from engine outputs, and request ends.

Thin: each handler reads its body, hands it to the app's ingest pipeline (`replay_service.ingest`), counts the
outcome and shapes the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ARROW_STREAM_MEDIA_TYPE, JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, FormatError, RunShape
from replay_format.rows import POSITION_MAX
from replay_service.api.deps import (
    BodyLimits,
    Ingest,
    Metrics,
    RequestId,
    RunId,
    Settings,
    Store,
    arriving_body,
    get_body_budget,
)
from replay_service.api.models import BODY_LIMITS, CONFLICT, ERRORS, STORAGE_FULL, RequestSummary
from replay_service.errors import ServiceError, UnsupportedMediaType
from replay_service.ingest.decode import (
    BodyKind,
    UploadOptions,
    decode_batch,
    decode_route,
    media_type,
    parse_moe_layers,
    parse_weight_versions,
)
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ingest.responses import ResponseItem
from replay_service.ingest.result import IngestOutcome, IngestResult
from replay_service.ingest.sglang_responses import ResponseOptions, decode_sglang_response
from replay_service.ingest.uploads import store_items, store_upload
from replay_service.ingest.vllm_responses import VllmResponseOptions, decode_vllm_response
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ServiceSettings
from replay_service.store import RequestStatus

T = TypeVar("T")

router = APIRouter(prefix="/v1", tags=["ingest"], responses=ERRORS)
WEIGHT_VERSIONS_HELP = (
    'JSON list of spans [{"version", "start", "end"}] over OUTPUT tokens (vLLM\'s CompletionOutput.weight_versions; '
    "a JSON body's own field of that name does as well): output token j is the row at position P-1+j, prompt rows "
    "take output token 0's version; every row covered, no overlap")


# Query parameters every engine answer's upload takes (an answer says its ids, not its model's shape)
NUM_EXPERTS = Query(None, ge=1, le=65536, description="needed when the run is new")
MOE_LAYERS = Query(None, description="comma-separated model-layer indices of the MoE layers; needed for a new run "
                                    "whose array has an all-zero layer")
NUM_HIDDEN_LAYERS = Query(None, ge=1, le=65535, description="the model's layer count")


class IngestAnswer(BaseModel):
    """What became of one batch (or one whole route)."""

    stored: bool = Field(description="this call stored the rows")
    duplicate: bool = Field(description="this (run_id, writer_id, seq) was stored before: nothing written")
    rows: int = Field(description="rows in the batch, padding dropped")
    padding_dropped: int = Field(description="rows flagged PADDING by the writer, or an engine route's rows of -1: "
                                             "dropped, counted on the request")
    flagged: dict[str, int] = Field(description="rows of this batch per flag, where not 0")
    bytes: int = Field(description="bytes of the segment written (0 for a duplicate)")
    recomputed: int = Field(0, description="positions this batch computed again under another weight version than "
                                           "the rows held there (kept, not CONFLICT), counted once per position")
    padding_slots_dropped: int = Field(0, description="an engine route's trailing top-k slots of -1 on every row "
                                                      "(an engine-internal slot past top_k): dropped")


class ResponseItemAnswer(IngestAnswer):
    """What became of one item of an engine's answer."""

    index: int = Field(description="the item's place in the answer")
    request_id: str = Field(description="the id its rows are stored under")
    start: int = Field(description="the position of its first row")


class ResponseAnswer(BaseModel):
    """What became of each item of an engine's answer, in the answer's order."""

    items: list[ResponseItemAnswer]


# The finish body of replay_format/request_notes.md (`Finish.body` writes it, under these field names);
# the bounds and error messages are this API's.
class FinishBody(BaseModel):
    """A request's end."""

    num_tokens: int = Field(ge=0, le=POSITION_MAX + 2,
                            description="final token count T (prompt + generated); the route has T-1 rows")
    status: Literal[RequestStatus.FINISHED, RequestStatus.ABORTED] = RequestStatus.FINISHED


def _answer(metrics: ServiceMetrics, result: IngestResult) -> IngestAnswer:
    metrics.batches.labels(result.outcome.value).inc()
    if result.stored:
        metrics.rows_ingested.inc(result.rows)
        metrics.bytes_stored.inc(result.bytes)
        metrics.padding_dropped.inc(result.padding_dropped)
        for name, count in result.flagged.items():
            metrics.rows_flagged.labels(name).inc(count)
    return IngestAnswer(stored=result.stored, duplicate=not result.stored, rows=result.rows,
                        padding_dropped=result.padding_dropped, flagged=result.flagged, bytes=result.bytes,
                        recomputed=result.recomputed, padding_slots_dropped=result.padding_slots_dropped)


@router.post("/ingest", summary="Store a batch of rows (Arrow IPC stream, idempotent on run_id, writer_id, seq)",
             response_model=IngestAnswer, responses={**CONFLICT, **BODY_LIMITS, **STORAGE_FULL},
             openapi_extra={"requestBody": {"required": True, "content": {ARROW_STREAM_MEDIA_TYPE: {}}}})
async def ingest(request: Request, pipeline: Ingest, settings: Settings, metrics: Metrics) -> IngestAnswer:
    """The body is a row batch (replay_format/rows.md); a retry of a stored batch is answered `duplicate`."""
    content_type = request.headers.get("content-type", "")
    # Bodies in memory are bounded by the byte budget, held from the body's first byte; the slot
    # bounds the work, taken once the whole body is here, so a slow upload never holds one. The
    # body's buffer goes back to the pool only when nothing reads it any more.
    async with arriving_body(request, BodyLimits.of(settings), get_body_budget(request),
                             request.app.state.body_buffers) as body:
        async with request.app.state.ingest_slots:
            try:
                result = await run_in_threadpool(lambda: pipeline.ingest(decode_batch(content_type, body)))
            except (ServiceError, FormatError):
                metrics.batches.labels(IngestOutcome.REJECTED.value).inc()
                raise
    return _answer(metrics, result)


@router.post("/runs/{run}/requests/{request}/finish", summary="Mark a request finished or aborted",
             response_model=RequestSummary, responses=CONFLICT)
def finish(run: RunId, request: RequestId, body: FinishBody, store: Store) -> dict:
    """The request's summary afterwards; 409 when it already ended with another count or status."""
    return store.finish(run, request, body.num_tokens, body.status).to_json()


@router.post(
    "/runs/{run}/requests/{request}/routes",
    summary="Store a whole route, or one turn of it from `start`: .npy (rows, layers, K), SGLang base64 JSON, or Arrow",
    response_model=IngestAnswer,
    responses={**CONFLICT, **BODY_LIMITS, **STORAGE_FULL},
    openapi_extra={"requestBody": {"required": True, "content": {
        NPY_MEDIA_TYPE: {}, JSON_MEDIA_TYPE: {}, ARROW_STREAM_MEDIA_TYPE: {}}}},
)
async def upload_route(
    run: RunId,
    request: RequestId,
    http: Request,
    pipeline: Ingest,
    settings: Settings,
    metrics: Metrics,
    num_experts: int | None = Query(None, ge=1, le=65536, description="needed when the run is new (npy)"),
    moe_layers: str | None = Query(None, description="comma-separated model-layer indices of the MoE layers; needed "
                                                     "for a new run whose array has an all-zero layer"),
    num_hidden_layers: int | None = Query(None, ge=1, le=65535,
                                          description="the model's layer count (an array of that many layers holds "
                                                      "every model layer, dense ones zero)"),
    start: int | None = Query(None, ge=0, le=POSITION_MAX,
                              description="position of the first row: vLLM's routed_experts_prompt_start, SGLang's "
                                          "routed_experts_start_len (default 0; an Arrow body's positions say it)"),
    finish: bool = Query(True, description="also mark the request finished with T = start + rows + 1 tokens (a later "
                                           "turn extends a finished request)"),
    weight_versions: str | None = Query(None, description=WEIGHT_VERSIONS_HELP),
    weight_version: str | None = Query(None, description="one weight version for every row (SGLang's "
                                                         "meta_info.weight_version)"),
    prompt_tokens: int | None = Query(None, ge=1, le=2**31 - 1,
                                      description="P, the prompt's tokens (default: T minus the output tokens the "
                                                  "spans cover)"),
) -> IngestAnswer:
    """One request's route (or one turn of it) as the engine handed it out; stored like a batch of rows.

    The rows land at positions `start .. start+n-1`; each (start, rows) is its own idempotent batch.
    Which layers the array holds comes from `moe_layers`, else from the run, never from guessing. Weight versions
    come as the engine gives them (spans over output tokens, or one version); a 422 names spans that leave a row
    uncovered or overlap, and labels that break the rule (nothing stored).
    """
    content_type = http.headers.get("content-type", "")
    options = UploadOptions(num_experts, parse_moe_layers(moe_layers), num_hidden_layers, start,
                            parse_weight_versions(weight_versions), weight_version, prompt_tokens)

    def store_route(body: bytes | memoryview) -> IngestResult:
        store = pipeline.store
        run_shape = store.run_shape(run) if store.has_run(run) else None
        upload = decode_route(content_type, body, run, request, run_shape, options)
        return store_upload(pipeline, run, request, upload, finish)  # refused before anything is stored

    return _answer(metrics, await _store_body(http, settings, metrics, store_route))


async def _store_body(http: Request, settings: ServiceSettings, metrics: ServiceMetrics,
                      work: Callable[[bytes | memoryview], T]) -> T:
    """`work(body)` in a worker thread once the body arrived. As for a batch: the body holds its bytes of the
    budget from its first byte, an ingest slot once it is whole; a refusal counts as a rejected batch."""
    async with arriving_body(http, BodyLimits.of(settings), get_body_budget(http)) as body:
        async with http.app.state.ingest_slots:
            try:
                return await run_in_threadpool(work, body)
            except (ServiceError, FormatError):
                metrics.batches.labels(IngestOutcome.REJECTED.value).inc()
                raise


@router.post(
    "/runs/{run}/responses/sglang",
    summary="Store a whole SGLang /generate answer as returned (one item or a batch's list), each item under its "
            "meta_info.id, in one call",
    response_model=ResponseAnswer,
    responses={**CONFLICT, **BODY_LIMITS, **STORAGE_FULL},
    openapi_extra={"requestBody": {"required": True, "content": {JSON_MEDIA_TYPE: {}}}},
)
async def upload_sglang_response(
    run: RunId,
    http: Request,
    pipeline: Ingest,
    settings: Settings,
    metrics: Metrics,
    num_experts: int | None = NUM_EXPERTS,
    moe_layers: str | None = MOE_LAYERS,
    num_hidden_layers: int | None = NUM_HIDDEN_LAYERS,
    num_layers: int | None = Query(None, ge=1, le=65535,
                                   description="layers of each item's array (SGLang: num_hidden_layers); default: "
                                               "the ids of a row over top_k"),
    top_k: int | None = Query(None, ge=1, le=65535, description="experts per token; needed when the run is new"),
    start: int = Query(0, ge=0, le=POSITION_MAX,
                       description="the request's routed_experts_start_len (one for the whole /generate call)"),
    finish: bool = Query(True, description="also mark each request finished at prompt_tokens + completion_tokens"),
) -> ResponseAnswer:
    """SGLang's answer as returned: `{"text", "output_ids", "meta_info"}` or a list of them (or `{"response": ...,
    "request_ids": [...]}` to store the items under ids of the caller's, in item order).

    Each item's rows are `meta_info.routed_experts` (of `meta_info.routed_experts_dtype`: uint8, uint16 or int32;
    absent: int32) at positions `start .. prompt_tokens + completion_tokens - 2`, with `meta_info.weight_versions`
    (else `weight_version`) and, when returned, `prompt_token_ids` + `output_ids` as tokens. Every item is checked
    before any is stored: a 4xx names the item's index and request id, and nothing of the answer is stored.
    """
    options = ResponseOptions(num_experts, parse_moe_layers(moe_layers), num_hidden_layers, num_layers, top_k, start,
                              settings.max_batch_requests)
    return await _store_answer(http, pipeline, settings, metrics, run, finish, "an SGLang answer",
                               lambda body, shape: decode_sglang_response(body, run, shape, options))


async def _store_answer(http: Request, pipeline: IngestPipeline, settings: ServiceSettings, metrics: ServiceMetrics,
                        run: str, finish: bool, what: str,
                        decode: Callable[[bytes | memoryview, RunShape | None], list[ResponseItem]]) -> ResponseAnswer:
    """An engine's whole answer (JSON), decoded by `decode` into items, every item checked before any is stored."""
    if BodyKind.of(http.headers.get("content-type", "")) != BodyKind.JSON:
        raise UnsupportedMediaType(f"{what} is {JSON_MEDIA_TYPE}, got "
                                   f"{media_type(http.headers.get('content-type', '')) or 'no content type'}")

    def store_answer(body: bytes | memoryview) -> list[tuple[ResponseItem, IngestResult]]:
        store = pipeline.store
        items = decode(body, store.run_shape(run) if store.has_run(run) else None)
        return list(zip(items, store_items(pipeline, run, items, finish), strict=True))  # all checked before any stored

    done = await _store_body(http, settings, metrics, store_answer)
    return ResponseAnswer(items=[ResponseItemAnswer(index=item.index, request_id=item.request_id,
                                                    start=item.upload.start, **_answer(metrics, result).model_dump())
                                 for item, result in done])


@router.post(
    "/runs/{run}/responses/vllm",
    summary="Store a whole vLLM answer as returned (a completions or chat response, or an offline RequestOutput), "
            "each choice under the id the plugin would store it under, in one call",
    response_model=ResponseAnswer,
    responses={**CONFLICT, **BODY_LIMITS, **STORAGE_FULL},
    openapi_extra={"requestBody": {"required": True, "content": {JSON_MEDIA_TYPE: {}}}},
)
async def upload_vllm_response(
    run: RunId,
    http: Request,
    pipeline: Ingest,
    settings: Settings,
    metrics: Metrics,
    num_experts: int | None = NUM_EXPERTS,
    moe_layers: str | None = MOE_LAYERS,
    num_hidden_layers: int | None = NUM_HIDDEN_LAYERS,
    start: int = Query(0, ge=0, le=POSITION_MAX, description="the request's routed_experts_prompt_start"),
    n: int | None = Query(None, ge=1, le=4096, description="the request's n: needed for a completions answer with "
                                                           "several choices (several prompts and n > 1 both give "
                                                           "several)"),
    finish: bool = Query(True, description="also mark each request finished at start + rows + 1 tokens"),
) -> ResponseAnswer:
    """vLLM's answer as returned (replay_format/vllm_response.md): `/v1/completions`' (`"object": "text_completion"`)
    or `/v1/chat/completions`' (`"chat.completion"`) JSON, or an offline `RequestOutput` as the client writes it
    (`"vllm.request_output"`).

    Each choice's `routed_experts` (vLLM's base64 `.npy`, any integer dtype) is stored under the id the plugin would
    store it under (`cmpl-<id>-<prompt>`, `chatcmpl-<id>`, the offline request id; `<i>_` before it when n > 1) at
    positions `start ..`, with its tokens when the answer carries them and the offline output's weight-version spans.
    Every choice is checked before any is stored: a 4xx names the choice's index and request id (no routes, a start
    beyond its prompt, an array its tokens or the answer's usage disagree with), and nothing of the answer is stored.
    """
    options = VllmResponseOptions(num_experts, parse_moe_layers(moe_layers), num_hidden_layers, start, n,
                                  settings.max_batch_requests)
    return await _store_answer(http, pipeline, settings, metrics, run, finish, "a vLLM answer",
                               lambda body, shape: decode_vllm_response(body, run, shape, options))
