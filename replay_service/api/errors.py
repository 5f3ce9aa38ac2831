"""Domain errors to HTTP answers, in one table: every error is JSON whose `detail` names the problem."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from replay_format import FormatError, UndecodableError
from replay_service.errors import (
    BodyTimeout,
    ClientClosed,
    Conflict,
    DamagedSegment,
    Forbidden,
    IndexUnreachable,
    InvalidInput,
    NotFound,
    SegmentStoreUnreachable,
    ServiceError,
    StorageFull,
    StrictRefusal,
    TooLarge,
    Unauthenticated,
    UnsupportedMediaType,
)

log = logging.getLogger("replay_service")

# Most specific first: the first class an error is an instance of decides its status.
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UndecodableError, 400),  # the body is not the container it claims to be
    (FormatError, 422),  # the container is fine, its content breaks the format's spec
    (Unauthenticated, 401),  # answered with WWW-Authenticate: Bearer
    (Forbidden, 403),
    (NotFound, 404),
    (StrictRefusal, 409),
    (Conflict, 409),
    (TooLarge, 413),
    (UnsupportedMediaType, 415),
    (InvalidInput, 422),
    (BodyTimeout, 408),  # the connection is closed after it: the rest of the body is never read
    # The client hung up mid-request: nobody receives the answer; counted (replay_http_request_seconds) as nginx's
    # "client closed request", never as a 5xx, and logged in one line.
    (ClientClosed, 499),
    (StorageFull, 507),  # nothing stored; a sender spills the batch and retries it (any 5xx)
    # Stored rows failed their checksum: never served; 503 (not 500) because restoring the segment from a
    # backup makes the same request succeed, and a sender spills and retries its batch meanwhile.
    (DamagedSegment, 503),
    # The index database is unreachable (a PostgreSQL index, REPLAY_INDEX_URL): never an answer without it.
    (IndexUnreachable, 503),
    # The segment store (an S3 bucket, REPLAY_SEGMENTS_URL) failed a read or an upload: nothing half-done is
    # indexed or served; the same request succeeds once the store answers again (a sender spills and retries).
    (SegmentStoreUnreachable, 503),
)


def status_of(exc: Exception) -> int:
    """The HTTP status of a domain error."""
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(exc: Exception) -> dict:
    """The JSON answer of a domain error: `detail`, plus `bad_rows` for a strict refusal."""
    body: dict = {"detail": exc.message if isinstance(exc, ServiceError) else str(exc)}
    if isinstance(exc, StrictRefusal):
        body["bad_rows"] = exc.bad_rows
    if isinstance(exc, DamagedSegment):
        body["segment"] = exc.path
    if isinstance(exc, SegmentStoreUnreachable) and exc.store:
        body["segment_store"] = exc.store
    return body


def install_error_handlers(app: FastAPI) -> None:
    """Answer every domain error and every request-validation error as JSON; a client's hang-up mid-request, wherever
    it is met, as ClientClosed (499, one log line)."""

    async def domain_error(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, DamagedSegment):  # counted here: every damaged read reaches this one handler
            request.app.state.metrics.count_damaged(exc.newly_found)
        if isinstance(exc, ClientClosed):
            log.warning("%s %s from %s: %s; not answered (status 499)", request.method, request.url.path,
                        _address(request), exc.message)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
        return JSONResponse(error_body(exc), status_code=status_of(exc), headers=headers)

    for cls in (ServiceError, FormatError):
        app.add_exception_handler(cls, domain_error)

    # A hang-up met outside the service's body reads (api/deps.py raises ClientClosed itself): Starlette's, or
    # FastAPI's 400 "error parsing the body" for one met while FastAPI read a JSON body.
    async def client_disconnect(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and not isinstance(exc.__cause__, ClientDisconnect):
            return await http_exception_handler(request, exc)  # FastAPI's, for every other HTTPException
        return await domain_error(request, ClientClosed("the client closed the connection before its request had "
                                                        "arrived"))

    app.add_exception_handler(ClientDisconnect, client_disconnect)
    app.add_exception_handler(HTTPException, client_disconnect)

    app.add_middleware(UnexpectedErrors)  # innermost of the middleware added so far: latency still sees the 500

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )
        return JSONResponse({"detail": problems, "errors": jsonable(exc.errors())}, status_code=422)


def _address(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "an unknown address"


def jsonable(errors) -> list:
    """Validation errors with every value made JSON-safe (an echoed `[Infinity]` or NaN input included)."""
    return [{k: _json_safe(v) for k, v in e.items()} for e in errors]


def _json_safe(value):
    # strict JSON (what JSONResponse writes) has no Infinity or NaN: such an input is echoed as text
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)
    return value


class UnexpectedErrors:
    """Answer an unexpected exception as a JSON 500, keeping the connection open (plain ASGI).

    Starlette's own 500 handler re-raises after answering, and uvicorn then closes the keep-alive
    connection; this sits inside it and does not. A response already started cannot be replaced:
    that error is re-raised (the connection must close, its body is cut).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def noting_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            detail = f"internal error ({type(exc).__name__}); the service log has its traceback"
            await JSONResponse({"detail": detail}, status_code=500)(scope, receive, send)


class CloseUnreadBodies:
    """Close the connection after an answer sent before its request's body had arrived to the end (plain ASGI).

    A refusal made on the head alone (413 for a declared length past the limit, 401, 404) or midway (408, 413 past the
    limit) leaves the rest of the body on the wire; on a kept-alive connection uvicorn would go on reading and
    dropping all of it, as long as the client sends. `connection: close` on the answer makes uvicorn close the
    connection once the answer is out, so a refused upload costs only the bytes already in flight.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _has_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body_read = False

        async def noting_receive():
            nonlocal body_read
            message = await receive()
            body_read = body_read or message["type"] == "http.disconnect" or not message.get("more_body", False)
            return message

        async def closing_send(message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, noting_receive, closing_send)


def _has_body(headers) -> bool:
    """Whether a request's head announces a body: a content-length above 0, or a transfer encoding."""
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False

