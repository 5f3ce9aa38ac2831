"""FastAPI dependencies: settings, store and metrics live on app.state; ids are validated here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, Path, Request

from replay_format import ID_RULE, valid_id
from replay_service.buffers import BufferPool
from replay_service.errors import InvalidInput, TooLarge
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore


def get_settings(request: Request) -> ServiceSettings:
    return request.app.state.settings


def get_store(request: Request) -> RouteStore:
    return request.app.state.store


def get_metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


def _checked(kind: str, value: str) -> str:
    if not valid_id(value):
        raise InvalidInput(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    return value


def run_id_param(run: Annotated[str, Path(description=f"run id: {ID_RULE}")]) -> str:
    return _checked("run id", run)


def request_id_param(request: Annotated[str, Path(description=f"request id: {ID_RULE}")]) -> str:
    return _checked("request id", request)


Settings = Annotated[ServiceSettings, Depends(get_settings)]
Store = Annotated[RouteStore, Depends(get_store)]
Metrics = Annotated[ServiceMetrics, Depends(get_metrics)]
RunId = Annotated[str, Depends(run_id_param)]
RequestId = Annotated[str, Depends(request_id_param)]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) past `limit` bytes before reading it all."""
    declared = _declared_length(request, limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes (REPLAY_MAX_BODY_BYTES)")
        chunks.append(chunk)
    if declared is not None and size != declared:
        raise InvalidInput(f"body of {size} bytes, but content-length said {declared}")
    return b"".join(chunks)


@asynccontextmanager
async def pooled_body(request: Request, limit: int, pool: BufferPool) -> AsyncIterator[memoryview | bytes]:
    """The request body, read into a reused buffer when its length is declared.

    Views into it are valid inside the block only (buffers.py says why bodies
    are not freshly allocated). Without content-length it is `read_body`.
    """
    declared = _declared_length(request, limit)
    if declared is None:
        yield await read_body(request, limit)
        return
    with pool.borrowed(declared) as view:
        size = 0
        async for chunk in request.stream():
            end = size + len(chunk)
            if end > declared:
                raise InvalidInput(f"body longer than its content-length of {declared} bytes")
            view[size:end] = chunk
            size = end
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
