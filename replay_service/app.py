"""The FastAPI app factory: settings and store in, routers and web view mounted."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles

from replay_service.errors import install_error_handlers
from replay_service.metrics import ServiceMetrics
from replay_service.routers import compares, ingest, ops, requests, runs, trainer
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


def create_app(settings: ServiceSettings | None = None, store: RouteStore | None = None) -> FastAPI:
    settings = settings or ServiceSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = store or RouteStore(settings)
        app.state.ingest_slots = asyncio.Semaphore(settings.max_concurrent_ingests)
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
    for module in (ingest, runs, requests, compares, trainer, ops):
        app.include_router(module.router)

    @app.middleware("http")
    async def observe_latency(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        app.state.metrics.latency.labels(
            getattr(route, "path", "unmatched"), request.method, str(response.status_code)
        ).observe(time.perf_counter() - started)
        return response

    if WEB_DIR.is_dir():
        app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    return app
