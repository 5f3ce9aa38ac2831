"""FastAPI dependencies: settings, store and metrics live on app.state; ids are validated here."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request
from starlette.requests import ClientDisconnect

from replay_format import ID_RULE, valid_id
from replay_service.buffers import BufferPool, ByteBudget
from replay_service.errors import BodyTimeout, ClientClosed, InvalidInput, TooLarge
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore

# The dependencies below do no blocking IO: `async def` keeps FastAPI from sending each to the thread
# pool (a hand-off and a wake-up per dependency per request, ~14% of a route GET under load).


async def get_settings(request: Request) -> ServiceSettings:
    """The app's settings."""
    return request.app.state.settings


async def get_store(request: Request) -> RouteStore:
    """The app's store."""
    return request.app.state.store


async def get_ingest(request: Request) -> IngestPipeline:
    """The app's ingest pipeline over its store."""
    return request.app.state.ingest


async def get_metrics(request: Request) -> ServiceMetrics:
    """The app's metrics."""
    return request.app.state.metrics


async def get_slice_builds(request: Request) -> asyncio.Semaphore:
    """The worker's trainer slices built at once (`REPLAY_SLICE_BUILDS_PER_WORKER`): a build holds one while it runs."""
    return request.app.state.slice_builds


def checked_id(kind: str, value: str) -> str:
    """`value` when it passes the id rule; InvalidInput (422) naming `kind` otherwise."""
    if not valid_id(value):
        raise InvalidInput(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    return value


async def run_id_param(run: Annotated[str, Path(description=f"run id: {ID_RULE}")]) -> str:
    """The run id of the path, checked against ID_RULE."""
    return checked_id("run id", run)


async def request_id_param(request: Annotated[str, Path(description=f"request id: {ID_RULE}")]) -> str:
    """The request id of the path, checked against ID_RULE."""
    return checked_id("request id", request)


Settings = Annotated[ServiceSettings, Depends(get_settings)]
Store = Annotated[RouteStore, Depends(get_store)]
Ingest = Annotated[IngestPipeline, Depends(get_ingest)]
Metrics = Annotated[ServiceMetrics, Depends(get_metrics)]
SliceBuilds = Annotated[asyncio.Semaphore, Depends(get_slice_builds)]
RunId = Annotated[str, Depends(run_id_param)]
RequestId = Annotated[str, Depends(request_id_param)]


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be and how fast it must arrive (settings)."""

    max_bytes: int
    timeout_s: float  # to start, and the lag allowed behind the minimum rate
    min_bytes_per_s: int

    @classmethod
    def of(cls, settings: ServiceSettings) -> BodyLimits:
        """The limits the settings give."""
        return cls(settings.max_body_bytes, settings.body_timeout_s, settings.body_min_bytes_per_s)


def get_body_budget(request: Request) -> ByteBudget:
    """The app's budget of body bytes held at once (made on first use, in the event loop)."""
    state = request.app.state
    if getattr(state, "body_budget", None) is None:
        state.body_budget = ByteBudget(state.settings.max_body_bytes_in_flight)
    return state.body_budget


class _TimedBody:
    """A request body's chunks, each awaited no longer than the minimum rate allows.

    By the time `received` bytes have arrived, at most `timeout_s + received / min_bytes_per_s`
    seconds may have passed since the clock started; a slower body is a BodyTimeout (408), so a
    stalled upload holds its connection and its bytes for seconds, not for ever.
    """

    def __init__(self, request: Request, limits: BodyLimits) -> None:
        self.stream = request.stream()
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.received = 0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Count from now, crediting what has arrived (a wait the service imposed is not the sender's)."""
        self.started = self.loop.time() - self.received / self.limits.min_bytes_per_s

    async def next(self) -> bytes | None:
        """The next chunk, None at the end of the body; BodyTimeout when it is late, ClientClosed when the client
        closed the connection first."""
        deadline = self.started + self.limits.timeout_s + self.received / self.limits.min_bytes_per_s
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(self.stream)
        except StopAsyncIteration:
            return None
        except ClientDisconnect:
            raise ClientClosed(f"the client closed the connection after {self.received} bytes of the body") from None
        except TimeoutError:
            raise BodyTimeout(
                f"the body arrived too slowly: {self.received} bytes in {self.loop.time() - self.started:.1f} s; "
                f"a body must start within {self.limits.timeout_s:g} s (REPLAY_BODY_TIMEOUT_S) and then arrive at "
                f"{self.limits.min_bytes_per_s} bytes/s (REPLAY_BODY_MIN_BYTES_PER_S)") from None
        self.received += len(chunk)
        return chunk


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) past `limit` bytes before reading it all, 408 when it arrives too slowly."""
    limits = dataclasses.replace(BodyLimits.of(request.app.state.settings), max_bytes=limit)
    declared = _declared_length(request, limit)
    return await _read_rest(_TimedBody(request, limits), b"", declared, limit)


async def _read_rest(body: _TimedBody, first: bytes, declared: int | None, limit: int) -> bytes:
    chunks = [first]
    size = len(first)
    while (chunk := await body.next()) is not None:
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes (REPLAY_MAX_BODY_BYTES)")
        chunks.append(chunk)
    if declared is not None and size != declared:
        raise InvalidInput(f"body of {size} bytes, but content-length said {declared}")
    return b"".join(chunks)


@asynccontextmanager
async def arriving_body(request: Request, limits: BodyLimits, budget: ByteBudget,
                        pool: BufferPool | None = None) -> AsyncIterator[memoryview | bytes]:
    """The whole request body, read once it starts arriving and while it holds its bytes of `budget`.

    Nothing is held while the body has not started (an idle or stalled upload costs no one
    else anything); then the body reserves its declared size (the limit without one) and is
    read under the minimum rate. With `pool` and a content-length it is read into a reused
    buffer, whose views are valid inside the block only (buffers.py says why bodies are not
    freshly allocated).
    """
    declared = _declared_length(request, limits.max_bytes)
    body = _TimedBody(request, limits)
    first = (await body.next() or b"") if declared != 0 else b""
    async with budget.reserved(limits.max_bytes if declared is None else declared):
        body.restart_clock()
        if pool is None or not declared:
            yield await _read_rest(body, first, declared, limits.max_bytes)
            return
        with pool.borrowed(declared) as view:
            size = 0
            chunk: bytes | None = first
            while chunk is not None:
                end = size + len(chunk)
                if end > declared:
                    raise InvalidInput(f"body longer than its content-length of {declared} bytes")
                view[size:end] = chunk
                size = end
                chunk = await body.next()
            if size != declared:
                raise InvalidInput(f"body of {size} bytes, but content-length said {declared}")
            yield view


def _declared_length(request: Request, limit: int) -> int | None:
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return None
    if int(declared) > limit:
        raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes (REPLAY_MAX_BODY_BYTES)")
    return int(declared)
