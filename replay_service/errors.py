"""JSON error answers: every 4xx names the problem in `detail`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from replay_service.decode import InputError
from replay_service.store import NotFound
from replay_service.store.compares import CompareNotFound


class StrictRefusal(Exception):
    """A strict read met flagged or missing rows (409)."""

    def __init__(self, message: str, bad_rows: list[dict]) -> None:
        super().__init__(message)
        self.message = message
        self.bad_rows = bad_rows


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InputError)
    async def _input_error(_: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(CompareNotFound)
    async def _compare_not_found(_: Request, exc: CompareNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(StrictRefusal)
    async def _strict(_: Request, exc: StrictRefusal) -> JSONResponse:
        return JSONResponse({"detail": exc.message, "bad_rows": exc.bad_rows}, status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )
        return JSONResponse({"detail": problems, "errors": jsonable(exc.errors())}, status_code=422)


def jsonable(errors: list) -> list:
    return [{k: (v if isinstance(v, (str, int, float, list, type(None))) else str(v)) for k, v in e.items()} for e in errors]
