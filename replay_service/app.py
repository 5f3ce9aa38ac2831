"""The FastAPI app factory: settings and store in, routers and web view mounted."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from replay_service.api import compares, ingest, ops, references, requests, runs, trainer
from replay_service.api.errors import install_error_handlers
from replay_service.buffers import BufferPool
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


class LatencyMiddleware:
    """Request latency by route template, as plain ASGI.

    Starlette's `@app.middleware("http")` wraps every body chunk of a request in a task
    group; at 64 KiB a chunk that costs more than the rest of an ingest's Python work.
    """

    def __init__(self, app, metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            self.metrics.latency.labels(getattr(route, "path", "unmatched"), scope["method"], str(status)).observe(
                time.perf_counter() - started
            )


def create_app(settings: ServiceSettings | None = None, store: RouteStore | None = None) -> FastAPI:
    """The service: `settings` (default: from REPLAY_* variables), a store opened at start-up unless given."""
    settings = settings or ServiceSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = store or RouteStore(settings)
        app.state.ingest_slots = asyncio.Semaphore(settings.max_concurrent_ingests)
        app.state.body_buffers = BufferPool(keep=settings.max_concurrent_ingests)
        try:
            yield
        finally:
            if store is None:
                app.state.store.close()

    app = FastAPI(
        title="routing-replay",
        version="0.1.0",
        summary="Record, check and serve MoE routing for Rollout Routing Replay",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = ServiceMetrics()
    install_error_handlers(app)
    for module in (ingest, references, runs, requests, compares, trainer, ops):
        app.include_router(module.router)

    app.add_middleware(LatencyMiddleware, metrics=app.state.metrics)

    if WEB_DIR.is_dir():
        app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    return app
