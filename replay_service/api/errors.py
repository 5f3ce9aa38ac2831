"""Domain errors to HTTP answers, in one table: every error is JSON whose `detail` names the problem."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from replay_format import FormatError, UndecodableError
from replay_service.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    ServiceError,
    StrictRefusal,
    TooLarge,
    UnsupportedMediaType,
)

# Most specific first: the first class an error is an instance of decides its status.
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UndecodableError, 400),  # the body is not the container it claims to be
    (FormatError, 422),  # the container is fine, its content breaks the format's spec
    (NotFound, 404),
    (StrictRefusal, 409),
    (Conflict, 409),
    (TooLarge, 413),
    (UnsupportedMediaType, 415),
    (InvalidInput, 422),
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
    return body


def install_error_handlers(app: FastAPI) -> None:
    """Answer every domain error and every request-validation error as JSON."""

    async def domain_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=status_of(exc))

    for cls in (ServiceError, FormatError):
        app.add_exception_handler(cls, domain_error)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )
        return JSONResponse({"detail": problems, "errors": jsonable(exc.errors())}, status_code=422)


def jsonable(errors) -> list:
    """Validation errors with every value made JSON-safe."""
    return [{k: (v if isinstance(v, (str, int, float, list, type(None))) else str(v)) for k, v in e.items()}
            for e in errors]
