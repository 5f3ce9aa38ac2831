"""`ReplayClient`: the trainer's and writers' side of the replay service's HTTP API, synchronous.

Every method is an operation of calls.py (its request built there, its answer decoded there) sent through this
client's `Transport`; `AsyncReplayClient` (async_client.py) sends the same operations from an event loop. Routes and
trainer slices are views into the received body (no copy); every non-2xx answer raises `ReplayError` carrying the
server's detail; 429 and 503 are retried as `retries` says. `in_background` starts a call on the client's thread pool
(the next step's slice while this one trains).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import httpx

from replay_client import calls
from replay_client.calls import Exchange, synchronous
from replay_client.records import RequestSummary
from replay_client.route import Route, npy_view, routes_from_stream
from replay_client.transport import (
    DEFAULT_RETRIES,
    AnswerTooLarge,
    NotFoundError,
    ReplayError,
    Retries,
    StrictReadError,
    Transport,
)
from replay_format import Flag

TOKEN_ENV = "ROUTING_REPLAY_TOKEN"  # the bearer token, when none is given (the vLLM sink reads the same variable)
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["AnswerTooLarge", "NotFoundError", "ReplayClient", "ReplayError", "Retries", "Route", "StrictReadError",
           "npy_view", "routes_from_stream"]


class ReplayClient:
    """Write rows, read routes and trainer slices, post comparisons. Thread-safe for reads."""

    def __init__(self, base_url: str, timeout: float = 120.0, http: httpx.Client | None = None,
                 token: str | None = None, retries: Retries = DEFAULT_RETRIES,
                 max_answer_bytes: int | None = None) -> None:
        """`token`: the service's bearer token; default: ROUTING_REPLAY_TOKEN (the variable the vLLM sink reads).
        `retries`: how 429 and 503 answers are tried again; `max_answer_bytes`: refuse a larger answer before
        reading it (always: one larger than this host's free memory)."""
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._transport = Transport(base_url, timeout, http, token, retries, max_answer_bytes)
        self.http = self._transport.http
        self._background: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Close the connections (and the background thread, once its calls are done)."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._transport.close()

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drive(self, exchange: Exchange[R]) -> R:
        """Run an operation of calls.py to its result, sending each of its calls."""
        answer = None
        try:
            while True:
                answer = self._transport.send(exchange.send(answer))
        except StopIteration as done:
            return done.value

    def in_background(self, method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Start `method(*args, **kwargs)` (a method of this client) on the client's background thread and return
        its `Future` at once: e.g. the next step's slice while this step trains,
        `upcoming = client.in_background(client.megatron_batch, next_sequences, **layout)`, then
        `upcoming.result()` when it is needed (its error, if any, is raised there). Calls run one at a time, in
        the order started (reads are thread-safe; a separate connection carries them)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-client")
        return self._background.submit(method, *args, **kwargs)

    def requests(self, run_id: str, flag: str | Flag | None = None, page_size: int = 500) -> Iterator[RequestSummary]:
        """Every request summary of a run (optionally only those with `flag`), following the cursor."""
        cursor = None
        while True:
            page = self._drive(calls.requests_page(run_id, flag, page_size, cursor))
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    # ---- the operations (calls.py): writers, readers, trainers, comparisons, run health -----------------

    ingest = synchronous(calls.ingest)
    finish = synchronous(calls.finish)
    upload_route = synchronous(calls.upload_route)
    upload_vllm_output = upload_route
    upload_sglang_output = synchronous(calls.upload_sglang_output)
    upload_sglang_response = synchronous(calls.upload_sglang_response)
    upload_vllm_response = synchronous(calls.upload_vllm_response)
    runs = synchronous(calls.runs)
    run = synchronous(calls.run)
    request = synchronous(calls.request)
    requests_page = synchronous(calls.requests_page)
    expert_load = synchronous(calls.expert_load)
    get_route = synchronous(calls.get_route)
    get_routes = synchronous(calls.get_routes)
    get_trajectory = synchronous(calls.get_trajectory)
    get_route_npy = synchronous(calls.get_route_npy)
    get_openai_route = synchronous(calls.get_openai_route)
    get_openai_routes = synchronous(calls.get_openai_routes)
    megatron_batch = synchronous(calls.megatron_batch)
    verl_batch = synchronous(calls.verl_batch)
    compare = synchronous(calls.compare)
    compares = synchronous(calls.compares)
    compare_result = synchronous(calls.compare_result)
    compare_request = synchronous(calls.compare_request)
    agreement_series = synchronous(calls.agreement_series)
    run_health = synchronous(calls.run_health)
    batch_health = synchronous(calls.batch_health)
    check_batch = synchronous(calls.check_batch)
    health_thresholds = synchronous(calls.health_thresholds)
    set_health_thresholds = synchronous(calls.set_health_thresholds)
    reset_health_thresholds = synchronous(calls.reset_health_thresholds)
