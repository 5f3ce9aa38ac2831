"""Every request the clients send, built once, and every answer decoded once: no I/O here.

Contract: each operation is a generator function taking the method's own arguments: it yields `Call`s, is sent each
one's answer (the parsed JSON, or for a `bulk` call the whole body in one writable buffer) and returns the method's
typed result. `ReplayClient` (client.py) and `AsyncReplayClient` (async_client.py) only drive them: send each call
through their transport and hand the answer back (`synchronous` and `asynchronous` make an operation a method). An
operation that needs another's answer first (a comparison needs the run's shape) yields from it.
Design: docs/design/trainer_client.md ("One request, two clients").
"""

from __future__ import annotations

import base64
import functools
import inspect
import io
import json
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import pyarrow as pa

from replay_client.health import HealthReport, RoutingUnhealthy, batch_request_ids, gate_level
from replay_client.openai_ids import Endpoint, choice_request_ids, stored_request_id
from replay_client.records import ExpertLoad, IngestAnswer, RequestSummary, ResponseAnswer, RunSummary
from replay_client.route import Route, npy_view, routes_from_stream
from replay_client.trainer import TrainerBatch, compare_body, megatron_query, verl_query
from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, Flag, LayerAxis
from replay_format.trajectory import read_trajectory_info
from replay_format.vllm_response import request_output_json
from replay_format.weight_versions import RecomputeRule, span_json

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Call:
    """One HTTP request of an operation; `bulk`: its answer is a large body, read whole into one writable buffer
    (`accept` names its media type), else JSON."""

    method: str
    url: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] | None = None
    bulk: bool = False
    accept: str = ARROW_STREAM_MEDIA_TYPE


Exchange = Generator[Call, Any, R]  # an operation: yields its calls, is sent their answers, returns the result


def synchronous(op: Callable[P, Exchange[R]]) -> Callable[Concatenate[Any, P], R]:
    """`op` as a method of a client whose `_drive(exchange)` runs it to its result."""

    @functools.wraps(op)
    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._drive(op(*args, **kwargs))

    _answers_result(method, op)
    return method


def asynchronous(op: Callable[P, Exchange[R]]) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """`op` as a coroutine method of a client whose `_drive(exchange)` is awaited to its result."""

    @functools.wraps(op)
    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._drive(op(*args, **kwargs))

    _answers_result(method, op)
    return method


def _answers_result(method: Any, op: Callable) -> None:
    """The method's signature as its users see it: `self`, the operation's parameters, its result's type (the
    documentation and `inspect.signature` read it)."""
    sig = inspect.signature(op)
    result = str(sig.return_annotation).removeprefix("Exchange[").removesuffix("]")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()]
    method.__signature__ = sig.replace(parameters=params, return_annotation=result)


def _json(method: str, url: str, **kw: Any) -> Call:
    return Call(method, url, **kw)


def _bulk(method: str, url: str, doc: dict | None = None, params: dict | None = None,
          accept: str = ARROW_STREAM_MEDIA_TYPE) -> Call:
    return Call(method, url, params=params, json=doc, bulk=True, accept=accept)


def _layers(values: Sequence[int]) -> str:
    return ",".join(str(int(x)) for x in values)


def _version_options(weight_versions: Sequence[Any] | None, weight_version: str | None,
                     prompt_tokens: int | None) -> dict[str, Any]:
    """The weight-version fields of an engine-output upload (the service checks them: 422 naming a bad span)."""
    out: dict[str, Any] = {}
    if weight_versions is not None:
        out["weight_versions"] = [span_json(s) for s in weight_versions]
    if weight_version is not None:
        out["weight_version"] = weight_version
    if prompt_tokens is not None:
        out["prompt_tokens"] = int(prompt_tokens)
    return out


def _selection(recompute: RecomputeRule | str, weight_version: str | None) -> dict[str, Any]:
    """The read parameters that pick among a position's computations; only those that are not the defaults (so a
    service before weight versions takes the rest)."""
    out: dict[str, Any] = {}
    if RecomputeRule(recompute) is not RecomputeRule.FIRST:
        out["recompute"] = RecomputeRule(recompute).value
    if weight_version is not None:
        out["weight_version"] = weight_version
    return out


def _route_params(start: int, end: int | None, strict: bool, layer_axis: LayerAxis | str,
                  recompute: RecomputeRule | str, weight_version: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"start": start, "strict": str(strict).lower(), "layer_axis": LayerAxis(layer_axis).value,
                              **_selection(recompute, weight_version)}
    if end is not None:
        params["end"] = end
    return params


# ---- writers ----------------------------------------------------------------------------------------------------


def ingest(batch: pa.RecordBatch | bytes) -> Exchange[IngestAnswer]:
    """Post one row batch (replay_format/rows.md; metadata with run_id, writer_id, seq); what became of it."""
    if isinstance(batch, pa.RecordBatch):
        from replay_format.rows import encode_stream

        batch = encode_stream(batch)
    return IngestAnswer.from_json((yield _json("POST", "/v1/ingest", content=batch,
                                               headers={"content-type": ARROW_STREAM_MEDIA_TYPE})))


def finish(run_id: str, request_id: str, num_tokens: int, status: str = "finished") -> Exchange[RequestSummary]:
    """Say a request ended with `num_tokens` tokens (`status`: finished or aborted); its summary comes back."""
    return RequestSummary.from_json((yield _json("POST", f"/v1/runs/{run_id}/requests/{request_id}/finish",
                                                 json={"num_tokens": num_tokens, "status": status})))


def upload_route(
    run_id: str,
    request_id: str,
    route: np.ndarray,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    finish: bool = True,
    start: int = 0,
    num_hidden_layers: int | None = None,
    weight_versions: Sequence[Any] | None = None,
    weight_version: str | None = None,
    prompt_tokens: int | None = None,
) -> Exchange[IngestAnswer]:
    """A route `(rows, model layers or MoE layers, K)` (e.g. vLLM's `routed_experts`), sent as .npy.

    `start`: the first row's position (vLLM's `routed_experts_prompt_start`: a later turn's rows);
    they land at `start .. start+rows-1`, and `finish` ends (or extends) the request at
    `start + rows + 1` tokens. `moe_layers` (model-layer indices) says which layers are MoE
    layers; a new run whose array has an all-zero layer needs it (the service never guesses).
    `weight_versions`: vLLM's `CompletionOutput.weight_versions` as returned (`WeightVersionSpan`s,
    `VersionSpan`s, dicts or triples; spans over OUTPUT tokens), or `weight_version` one label for every row;
    `prompt_tokens` the prompt's length where the spans do not say it (rows.md, "Weight versions"). A -1 is an
    engine's padding (docs/guides/http_api.md, "-1 in an engine's array").
    """
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(route), allow_pickle=False)
    params: dict[str, Any] = {"finish": str(finish).lower(), "start": int(start)}
    if num_experts is not None:
        params["num_experts"] = num_experts
    if moe_layers is not None:
        params["moe_layers"] = _layers(moe_layers)
    if num_hidden_layers is not None:
        params["num_hidden_layers"] = int(num_hidden_layers)
    params.update(_version_options(weight_versions, weight_version, prompt_tokens))
    if "weight_versions" in params:
        params["weight_versions"] = json.dumps(params["weight_versions"], separators=(",", ":"))
    return IngestAnswer.from_json((yield _json("POST", f"/v1/runs/{run_id}/requests/{request_id}/routes",
                                               content=buf.getvalue(), params=params,
                                               headers={"content-type": NPY_MEDIA_TYPE})))


def upload_sglang_output(
    run_id: str,
    request_id: str,
    routed_experts: str | np.ndarray,
    num_layers: int,
    top_k: int,
    num_experts: int | None = None,
    token_ids: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
    start: int | None = None,
    num_hidden_layers: int | None = None,
    finish: bool = True,
    weight_versions: Sequence[Any] | None = None,
    weight_version: str | None = None,
    prompt_tokens: int | None = None,
    routed_experts_dtype: str | None = None,
) -> Exchange[IngestAnswer]:
    """SGLang's `meta_info["routed_experts"]` (base64 ids; `num_layers` as SGLang counts them).

    `routed_experts_dtype`: `meta_info["routed_experts_dtype"]` as returned (uint8, uint16 or int32: what SGLang
    sent; None: int32, as SGLang's readers assume). An array is sent as int32. `start` is the request's
    `routed_experts_start_len` (sent under SGLang's name); `token_ids` are the tokens from `start` (rows or
    rows + 1 of them) or the whole sequence. `weight_versions` (`meta_info["weight_versions"]`, spans over
    output tokens) or `weight_version` (one label) as for `upload_route`. A whole `/generate` answer:
    `upload_sglang_response`.
    """
    if not isinstance(routed_experts, str):
        routed_experts = base64.b64encode(np.ascontiguousarray(routed_experts, np.int32).tobytes()).decode()
        if routed_experts_dtype not in (None, "int32"):
            raise ValueError(f"an array is sent as int32, not routed_experts_dtype={routed_experts_dtype!r}")
    doc: dict[str, Any] = {"routed_experts": routed_experts, "num_layers": num_layers, "top_k": top_k}
    if routed_experts_dtype is not None:
        doc["routed_experts_dtype"] = routed_experts_dtype
    if num_experts is not None:
        doc["num_experts"] = num_experts
    if token_ids is not None:
        doc["token_ids"] = [int(t) for t in token_ids]
    if moe_layers is not None:
        doc["moe_layers"] = [int(x) for x in moe_layers]
    if start is not None:
        doc["routed_experts_start_len"] = int(start)
    if num_hidden_layers is not None:
        doc["num_hidden_layers"] = int(num_hidden_layers)
    doc.update(_version_options(weight_versions, weight_version, prompt_tokens))
    return IngestAnswer.from_json((yield _json("POST", f"/v1/runs/{run_id}/requests/{request_id}/routes", json=doc,
                                               params={"finish": str(finish).lower()})))


def _response_params(start: int, finish: bool, moe_layers: Sequence[int] | None, **counts: int | None
                     ) -> dict[str, Any]:
    params: dict[str, Any] = {"start": int(start), "finish": str(finish).lower()}
    params.update({name: int(value) for name, value in counts.items() if value is not None})
    if moe_layers is not None:
        params["moe_layers"] = _layers(moe_layers)
    return params


def upload_sglang_response(
    run_id: str,
    response: dict | Sequence[dict],
    request_ids: Sequence[str] | dict[str, str] | None = None,
    start: int = 0,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    moe_layers: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
    finish: bool = True,
) -> Exchange[ResponseAnswer]:
    """A whole SGLang `/generate` answer as returned (its JSON: one item, or a batch's list), in one call.

    Each item is stored under its `meta_info["id"]` (or `request_ids`: a list in item order, or a dict from
    SGLang's id to yours) at `start` (the request's `routed_experts_start_len`, one for the whole call), with
    `meta_info["routed_experts_dtype"]` (absent: int32) and `meta_info["weight_versions"]` (else
    `weight_version`). SGLang does not send the array's shape: `top_k` (and `num_layers`, else the ids of a row
    over top_k) for a new run. The service checks every item first: a `ReplayError` names the item's index and
    request id, and nothing of the answer is stored. The answer's `items` say what became of each.
    """
    items = [response] if isinstance(response, dict) else list(response)
    body: Any = response if isinstance(response, dict) else items
    if request_ids is not None:
        if isinstance(request_ids, dict):
            ids = [item.get("meta_info", {}).get("id") for item in items]
            missing = [i for i in ids if i not in request_ids]
            if missing:
                raise ValueError(f"request_ids maps no stored id for SGLang's ids {missing[:5]}")
            request_ids = [request_ids[i] for i in ids]
        body = {"response": body, "request_ids": list(request_ids)}
    params = _response_params(start, finish, moe_layers, num_experts=num_experts, num_layers=num_layers, top_k=top_k,
                              num_hidden_layers=num_hidden_layers)
    return ResponseAnswer.from_json((yield _json("POST", f"/v1/runs/{run_id}/responses/sglang", json=body,
                                                 params=params)))


def upload_vllm_response(
    run_id: str,
    response: Any,
    n: int | None = None,
    start: int = 0,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
    finish: bool = True,
) -> Exchange[ResponseAnswer]:
    """A whole vLLM answer as returned, every choice in one call (replay_format/vllm_response.md).

    `response`: the `openai` client's `Completion` or `ChatCompletion`, their JSON (a dict), or an offline
    `RequestOutput` (its outputs' `routed_experts` and `weight_versions` as vLLM hands them out). Each choice is
    stored under the id the plugin would store it under (`replay_format.vllm_ids`), at `start` (the request's
    `routed_experts_prompt_start`). `n`: the request's n, needed for a completions answer with several choices.
    The service checks every choice first: a `ReplayError` names the choice's index and request id, and nothing
    of the answer is stored. The answer's `items` say what became of each.
    """
    if isinstance(response, dict):
        body = response
    elif hasattr(response, "model_dump"):  # the openai client's objects keep vLLM's extra fields
        body = response.model_dump(mode="json")
    elif hasattr(response, "request_id") and hasattr(response, "outputs"):
        body = request_output_json(response)
    else:
        raise TypeError(f"not a vLLM completions/chat answer or RequestOutput: {type(response).__name__}")
    params = _response_params(start, finish, moe_layers, n=n, num_experts=num_experts,
                              num_hidden_layers=num_hidden_layers)
    return ResponseAnswer.from_json((yield _json("POST", f"/v1/runs/{run_id}/responses/vllm", json=body,
                                                 params=params)))


# ---- readers ----------------------------------------------------------------------------------------------------


def runs() -> Exchange[list[RunSummary]]:
    """Every run's summary."""
    return [RunSummary.from_json(run) for run in (yield _json("GET", "/v1/runs"))["runs"]]


def run(run_id: str) -> Exchange[RunSummary]:
    """One run's summary: its shape (`num_moe_layers`, `top_k`, `num_experts`, `moe_layers`: `.shape`), counts,
    rows per flag."""
    return RunSummary.from_json((yield _json("GET", f"/v1/runs/{run_id}")))


def request(run_id: str, request_id: str) -> Exchange[RequestSummary]:
    """One request's summary."""
    return RequestSummary.from_json((yield _json("GET", f"/v1/runs/{run_id}/requests/{request_id}")))


@dataclass(frozen=True)
class RequestPage:
    """One page of a run's request summaries and the cursor of the next (None after the last)."""

    items: list[RequestSummary]
    next_cursor: str | None


def requests_page(run_id: str, flag: str | Flag | None = None, page_size: int = 500,
                  cursor: str | None = None) -> Exchange[RequestPage]:
    """One page of a run's request summaries (optionally only those with `flag`) from `cursor`."""
    params: dict[str, Any] = {"limit": page_size}
    if flag is not None:
        params["flag"] = flag.name if isinstance(flag, Flag) else flag
    if cursor:
        params["cursor"] = cursor
    page = yield _json("GET", f"/v1/runs/{run_id}/requests", params=params)
    return RequestPage([RequestSummary.from_json(item) for item in page["items"]], page["next_cursor"] or None)


def expert_load(run_id: str) -> Exchange[ExpertLoad]:
    """Tokens per expert per MoE layer over the run's clean rows."""
    return ExpertLoad.from_json((yield _json("GET", f"/v1/runs/{run_id}/expert-load")))


def get_route(
    run_id: str, request_id: str, start: int = 0, end: int | None = None, strict: bool = False,
    layer_axis: LayerAxis | str = LayerAxis.MOE, recompute: RecomputeRule | str = RecomputeRule.FIRST,
    weight_version: str | None = None,
) -> Exchange[Route]:
    """One request's rows `[start, end)` (default: all); `strict` raises StrictReadError on a flagged row.

    `layer_axis="model"`: every model layer, dense ones zero, as vLLM's `routed_experts`.
    `recompute="latest"`: where a position was computed again under other weights, the newest computation
    (default `first`: the rows the sampled tokens were produced with); `weight_version`: that version's rows
    only (other positions GAP). `route.versions()` gives each row's weight version.
    """
    params = _route_params(start, end, strict, layer_axis, recompute, weight_version)
    return routes_from_stream((yield _bulk("GET", f"/v1/runs/{run_id}/requests/{request_id}/routes",
                                           params=params)))[0]


def get_routes(
    run_id: str, request_ids: Sequence[str], start: int = 0, end: int | None = None, strict: bool = False,
    layer_axis: LayerAxis | str = LayerAxis.MOE, recompute: RecomputeRule | str = RecomputeRule.FIRST,
    weight_version: str | None = None,
) -> Exchange[list[Route]]:
    """Many routes in one round trip, in the order asked, on one layer axis (`recompute`, `weight_version`:
    as in `get_route`)."""
    doc = {"requests": list(request_ids), "start": start, "end": end, "strict": strict,
           "layer_axis": LayerAxis(layer_axis).value, **_selection(recompute, weight_version)}
    return routes_from_stream((yield _bulk("POST", f"/v1/runs/{run_id}/routes/batch", doc)))


def get_trajectory(
    run_id: str, turns: Sequence[str], recompute: RecomputeRule | str = RecomputeRule.FIRST,
    strict: bool = False, layer_axis: LayerAxis | str = LayerAxis.MOE,
) -> Exchange[Route]:
    """The turns of one conversation or resubmitted rollout (request ids, first to last) as one route.

    Positions `0 .. rows of the last turn - 1`; `recompute="first"` (default) takes each from the first turn
    that holds a row there (each turn's rows as it sampled them: earlier turns immutable), `"latest"` from the
    last. The route is named after the last turn; `route.trajectory` lists the turns and spans, `route.turn`
    gives the turn of each row, `route.versions()` each row's weight version. ReplayError 409 when a turn does
    not continue the one before it (a token that differs, fewer rows).
    """
    doc = {"turns": list(turns), "recompute": RecomputeRule(recompute).value, "strict": strict,
           "layer_axis": LayerAxis(layer_axis).value}
    body = yield _bulk("POST", f"/v1/runs/{run_id}/routes/trajectory", doc)
    route = routes_from_stream(body)[0]
    route.trajectory = read_trajectory_info(body)
    return route


def get_route_npy(run_id: str, request_id: str, start: int = 0, end: int | None = None, strict: bool = False,
                  layer_axis: LayerAxis | str = LayerAxis.MOE, recompute: RecomputeRule | str = RecomputeRule.FIRST,
                  weight_version: str | None = None) -> Exchange[np.ndarray]:
    """One request's ids `(n, layers, K)` as the service's .npy answer (the parameters as in `get_route`; the
    versions travel in a header: `get_route` gives them)."""
    params = {**_route_params(start, end, strict, layer_axis, recompute, weight_version), "format": "npy"}
    return npy_view((yield _bulk("GET", f"/v1/runs/{run_id}/requests/{request_id}/routes", params=params,
                                 accept=NPY_MEDIA_TYPE)))


def get_openai_route(
    run_id: str, response_id: str, prompt_index: int = 0, choice_index: int = 0,
    endpoint: Endpoint | str = Endpoint.COMPLETIONS, n: int = 1, strict: bool = False,
    layer_axis: LayerAxis | str = LayerAxis.MOE,
) -> Exchange[Route]:
    """One choice's route from what a vLLM user holds (`replay_client.openai_ids.stored_request_id`).

    `response_id`: the response's `id` (or offline `RequestOutput.request_id`); `prompt_index`:
    the prompt of a completions request; `choice_index`: the sample (0..n-1); `n`: the request's n.
    """
    rid = stored_request_id(response_id, endpoint=endpoint, prompt_index=prompt_index, choice_index=choice_index, n=n)
    return (yield from get_route(run_id, rid, strict=strict, layer_axis=layer_axis))


def get_openai_routes(run_id: str, response: Any, n: int | None = None, strict: bool = False,
                      layer_axis: LayerAxis | str = LayerAxis.MOE) -> Exchange[list[Route]]:
    """Every choice's route of an `openai` response (or a vLLM `RequestOutput`), in `choices` order.

    `n`: the request's n, needed for a completions response with several choices.
    """
    return (yield from get_routes(run_id, choice_request_ids(response, n), strict=strict, layer_axis=layer_axis))


# ---- trainers ---------------------------------------------------------------------------------------------------


def megatron_batch(sequences, packing: str = "thd", **options: Any) -> Exchange[TrainerBatch]:
    """This rank's `RouterReplay` data for a micro-batch of (run, request) (`replay_client.trainer`).

    `options` are `megatron_query`'s (cp/tp size and rank, pad_multiple or seq_length,
    moe_ordinals or model_layer_range for this pipeline stage, strict). Only this rank's
    slice travels.
    """
    query = megatron_query(sequences, packing, **options)
    return TrainerBatch.read((yield _bulk("POST", "/v1/trainer/megatron", query.to_json())))


def verl_batch(sequences, prompt_lengths: Sequence[int], prompt_width: int, response_width: int,
               **options: Any) -> Exchange[TrainerBatch]:
    """verl's dense `[batch, prompt_width + response_width, L, K]` and its mask (options: `verl_query`'s)."""
    query = verl_query(sequences, prompt_lengths, prompt_width, response_width, **options)
    return TrainerBatch.read((yield _bulk("POST", "/v1/trainer/verl", query.to_json())))


# ---- comparisons ------------------------------------------------------------------------------------------------


def compare(run_id: str, request_ids, positions, experts, label: str | None = None, step: int | None = None,
            weight_version: str | None = None) -> Exchange[dict]:
    """Post the trainer's own top-k (n, L, K) per (request, position); the stored comparison comes back.

    `step`: the training step it was made at (comparisons with a step form the run's agreement series,
    `agreement_series`); `weight_version`: the trainer's weight version it was made against. Both are kept in
    the stored answer.
    """
    shape = (yield from run(run_id)).shape
    body = compare_body(run_id, shape, request_ids, positions, experts)
    params: dict[str, Any] = {}
    if label is not None:
        params["label"] = label
    if step is not None:
        params["step"] = int(step)
    if weight_version is not None:
        params["weight_version"] = weight_version
    return (yield _json("POST", f"/v1/runs/{run_id}/compare", content=body, params=params or None,
                        headers={"content-type": ARROW_STREAM_MEDIA_TYPE}))


def compares(run_id: str) -> Exchange[list[dict]]:
    """A run's stored comparisons, newest first."""
    return (yield _json("GET", f"/v1/runs/{run_id}/compares"))["compares"]


def compare_result(run_id: str, compare_id: str) -> Exchange[dict]:
    """One stored comparison."""
    return (yield _json("GET", f"/v1/runs/{run_id}/compares/{compare_id}"))


def compare_request(run_id: str, compare_id: str, request_id: str, start: int = 0,
                    end: int | None = None) -> Exchange[dict]:
    """Per position and MoE layer, 0|1 mismatch of one request in a stored comparison."""
    params: dict[str, Any] = {"start": start}
    if end is not None:
        params["end"] = end
    return (yield _json("GET", f"/v1/runs/{run_id}/compares/{compare_id}/requests/{request_id}", params=params))


def agreement_series(run_id: str) -> Exchange[list[dict]]:
    """The run's comparisons posted with a `step`, in step order (ties by creation time): each point's `step`,
    `weight_version`, `compare_id`, `created_at`, `label`, `tokens`, `router_mismatch`, `token_mismatch`,
    `jaccard` and `worst_layers` (up to 3: `layer`, `model_layer`, `router_mismatch`)."""
    return (yield _json("GET", f"/v1/runs/{run_id}/agreement"))["points"]


# ---- run health -------------------------------------------------------------------------------------------------


def run_health(run_id: str, window_s: float | None = None) -> Exchange[HealthReport]:
    """The health verdict on a whole run, or on its requests written in the last `window_s` seconds.

    Run scope never judges OPEN (requests still being written are normal in a live run) nor MISSING.
    """
    params = None if window_s is None else {"window_s": float(window_s)}
    return HealthReport.from_json((yield _json("GET", f"/v1/runs/{run_id}/health", params=params)))


def batch_health(run_id: str, request_ids: Sequence[Any], weight_version: str | None = None
                 ) -> Exchange[HealthReport]:
    """The health verdict on the requests of one training batch (at most the service's
    REPLAY_MAX_BATCH_REQUESTS, 4096 by default).

    `request_ids`: ids, or the sequences given to `megatron_batch` / `verl_batch` ((run, request) pairs or
    dicts). `weight_version`: the trainer's current weight version, against which rows of other versions count
    as stale (STALENESS, `r3/version_stale_frac`); without it the service takes the run's newest.
    """
    doc: dict[str, Any] = {"requests": batch_request_ids(run_id, request_ids)}
    if weight_version is not None:
        doc["weight_version"] = weight_version
    return HealthReport.from_json((yield _json("POST", f"/v1/runs/{run_id}/health", json=doc)))


def check_batch(run_id: str, request_ids: Sequence[Any], weight_version: str | None = None,
                fail_on: str = "fail") -> Exchange[dict[str, float]]:
    """The training-loop gate: call it after the rollout batch is assembled, before its routes are fetched and
    replayed (docs/health.md shows where in each trainer).

    Raises `RoutingUnhealthy` (carrying the `HealthReport`; its message names each failed check, its count,
    value and limit, and the first requests with their first positions) when the batch's verdict is
    `fail_on` ("fail", the default, or "warn") or worse. Otherwise returns the report's flat metrics
    (`r3/verdict`, `r3/fallback_frac`, `r3/router_mismatch`, ...: stable names, floats, absent figures left
    out) to log as they are: `wandb.log(metrics, step=step)`, `mlflow.log_metrics(metrics, step=step)`, or
    TensorBoard's `writer.add_scalar(name, value, step)` per item.
    """
    level = gate_level(fail_on)
    report = yield from batch_health(run_id, request_ids, weight_version)
    if report.verdict.at_least(level):
        raise RoutingUnhealthy(report, level)
    return dict(report.metrics)


def health_thresholds(run_id: str) -> Exchange[dict]:
    """The limits a run's checks are judged against: `{"run_id", "thresholds": {CHECK: {"warn", "fail"}},
    "overridden": [CHECK, ...]}` (a limit of None: never reached; 0: any count reaches it)."""
    return (yield _json("GET", f"/v1/runs/{run_id}/health/thresholds"))


def set_health_thresholds(run_id: str, thresholds: dict[str, dict[str, float | None]]) -> Exchange[dict]:
    """Override some of a run's limits, merged over the defaults: `{"ZERO": {"warn": 0, "fail": 0.01}}`
    (ReplayError 422 naming an unknown check). Answers as `health_thresholds`."""
    return (yield _json("PUT", f"/v1/runs/{run_id}/health/thresholds", json=thresholds))


def reset_health_thresholds(run_id: str) -> Exchange[dict]:
    """Drop a run's overrides: every check back to the default limits. Answers as `health_thresholds`."""
    return (yield _json("DELETE", f"/v1/runs/{run_id}/health/thresholds"))
