"""`AsyncReplayClient`: the replay service's HTTP API from an event loop (rollout drivers, async trainers).

Contract: every method of `ReplayClient`, with the same names, arguments and typed answers, as a coroutine: the same
operations of calls.py (built and decoded there, once), sent through `AsyncTransport` on httpx's async client. At most
`max_in_flight` calls are sent at once (more wait their turn, without blocking the loop); 429 and 503 are retried as
`retries` says; an answer larger than free memory is refused before it is read. The next step's slice while this one
trains is a task: `upcoming = asyncio.create_task(client.megatron_batch(...))`, awaited when it is needed.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx

from replay_client import calls
from replay_client.calls import Exchange, asynchronous
from replay_client.client import TOKEN_ENV
from replay_client.records import RequestSummary
from replay_client.transport import DEFAULT_RETRIES, AsyncTransport, Retries
from replay_format import Flag

R = TypeVar("R")
MAX_IN_FLIGHT = 64  # calls sent at once by default: a rollout step's uploads overlap, the service is not flooded

__all__ = ["MAX_IN_FLIGHT", "AsyncReplayClient"]


class AsyncReplayClient:
    """`ReplayClient`'s methods as coroutines, for asyncio code; one client per event loop."""

    def __init__(self, base_url: str, timeout: float = 120.0, http: httpx.AsyncClient | None = None,
                 token: str | None = None, max_in_flight: int = MAX_IN_FLIGHT, retries: Retries = DEFAULT_RETRIES,
                 max_answer_bytes: int | None = None) -> None:
        """As `ReplayClient`'s; `max_in_flight`: calls sent at once at most (the rest wait their turn)."""
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._transport = AsyncTransport(base_url, timeout, http, token, max_in_flight, retries, max_answer_bytes)
        self.http = self._transport.http

    async def aclose(self) -> None:
        """Close the connections."""
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncReplayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _drive(self, exchange: Exchange[R]) -> R:
        """Run an operation of calls.py to its result, awaiting each of its calls."""
        answer = None
        try:
            while True:
                answer = await self._transport.send(exchange.send(answer))
        except StopIteration as done:
            return done.value

    async def requests(self, run_id: str, flag: str | Flag | None = None,
                       page_size: int = 500) -> AsyncIterator[RequestSummary]:
        """Every request summary of a run (optionally only those with `flag`), following the cursor."""
        cursor = None
        while True:
            page = await self._drive(calls.requests_page(run_id, flag, page_size, cursor))
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    # ---- the operations (calls.py), as ReplayClient's ------------------------------------------------------

    ingest = asynchronous(calls.ingest)
    finish = asynchronous(calls.finish)
    upload_route = asynchronous(calls.upload_route)
    upload_vllm_output = upload_route
    upload_sglang_output = asynchronous(calls.upload_sglang_output)
    upload_sglang_response = asynchronous(calls.upload_sglang_response)
    upload_vllm_response = asynchronous(calls.upload_vllm_response)
    runs = asynchronous(calls.runs)
    run = asynchronous(calls.run)
    request = asynchronous(calls.request)
    requests_page = asynchronous(calls.requests_page)
    expert_load = asynchronous(calls.expert_load)
    get_route = asynchronous(calls.get_route)
    get_routes = asynchronous(calls.get_routes)
    get_trajectory = asynchronous(calls.get_trajectory)
    get_route_npy = asynchronous(calls.get_route_npy)
    get_openai_route = asynchronous(calls.get_openai_route)
    get_openai_routes = asynchronous(calls.get_openai_routes)
    megatron_batch = asynchronous(calls.megatron_batch)
    verl_batch = asynchronous(calls.verl_batch)
    compare = asynchronous(calls.compare)
    compares = asynchronous(calls.compares)
    compare_result = asynchronous(calls.compare_result)
    compare_request = asynchronous(calls.compare_request)
    agreement_series = asynchronous(calls.agreement_series)
    run_health = asynchronous(calls.run_health)
    batch_health = asynchronous(calls.batch_health)
    check_batch = asynchronous(calls.check_batch)
    health_thresholds = asynchronous(calls.health_thresholds)
    set_health_thresholds = asynchronous(calls.set_health_thresholds)
    reset_health_thresholds = asynchronous(calls.reset_health_thresholds)
