"""The FastAPI app factory: settings and store in, one ingest pipeline over the store, routers and web view mounted."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.staticfiles import StaticFiles

from replay_service import __version__
from replay_service.api import compares, health, ingest, ops, references, requests, runs, trainer, trajectories
from replay_service.api.auth import Tokens, authorize
from replay_service.api.errors import CloseUnreadBodies, install_error_handlers
from replay_service.api.models import AUTH
from replay_service.buffers import BufferPool
from replay_service.health.exporter import RunHealthCollector
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.metrics import ServiceMetrics, StoreCollector
from replay_service.settings import ServiceSettings
from replay_service.store import Processes, RouteStore


def _web_dir() -> Path:
    """The web view's static files: the package's own copy in an installed wheel (setup.py's build step puts the
    top-level web/ there, as this package's web/), else the checkout's web/ (a checkout or its editable install,
    which copies nothing; `resolve()` follows a strict editable install's links back to the checkout)."""
    package = Path(__file__).resolve().parent
    installed, checkout = package / "web", package.parent / "web"
    if not (installed / "index.html").is_file() and (checkout / "index.html").is_file():
        return checkout
    return installed  # missing from both: StaticFiles refuses it when the app is created


WEB_DIR = _web_dir()


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


def stored_bytes(app: FastAPI) -> int | None:
    """The bytes of the segments the open store's index holds (None before the store is open)."""
    store = getattr(app.state, "store", None)
    return None if store is None else sum(int(run["bytes"]) for run in store.index.runs())


def feed_round_at(app: FastAPI) -> float | None:
    """When this process's STALE feed last finished a round (None without a feed, or before its first round)."""
    feed = getattr(getattr(app.state, "ingest", None), "feed", None)
    return None if feed is None else feed.round_at


def open_store(settings: ServiceSettings, processes: Processes = Processes.ONE) -> RouteStore:
    """The store `settings` name: what the app and every command-line tool open (`processes`: this one alone, or
    one of `serve`'s workers; placement/processes.py). Batches go through an `IngestPipeline.over` it."""
    return RouteStore(settings, processes)


async def retention_loop(store: RouteStore, settings: ServiceSettings) -> None:
    """Retention passes every `retention_interval_s` while a limit is set or segments are in an object store (its
    orphans are collected by every pass); store/lifecycle/retention.py logs each run and orphan removed."""
    from starlette.concurrency import run_in_threadpool

    if not (settings.retention_max_bytes or settings.retention_max_age_s or settings.segments_url):
        return
    while True:
        try:
            await run_in_threadpool(store.retention_pass, settings.retention_max_bytes, settings.retention_max_age_s)
        except Exception:  # a failed pass is logged and tried again next time, never ends the loop
            logging.getLogger("replay_service").exception("retention pass failed")
        await asyncio.sleep(settings.retention_interval_s)


def create_app(settings: ServiceSettings | None = None, store: RouteStore | None = None,
               processes: Processes = Processes.ONE, tokens: Tokens | None = None) -> FastAPI:
    """The service: `settings` (default: from REPLAY_* variables), a store opened at start-up unless given
    (`processes`: as one of `serve`'s workers, ops/workers.py), `tokens` read from `settings.tokens_file` unless
    given (a worker's: the snapshot its parent shares, api/auth.py)."""
    settings = settings or ServiceSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = store or open_store(settings, processes)
        # the one ingest pipeline over the store: the ingest endpoints and the engines' answers store through it
        app.state.ingest = IngestPipeline.over(app.state.store, feed_counter=app.state.metrics.stale_feed_rows)
        app.state.ingest_slots = asyncio.Semaphore(settings.max_concurrent_ingests)
        app.state.body_buffers = BufferPool(keep=settings.max_concurrent_ingests)
        app.state.slice_builds = asyncio.Semaphore(settings.slice_builds())
        retention = asyncio.create_task(retention_loop(app.state.store, settings))
        try:
            yield
        finally:
            retention.cancel()
            app.state.ingest.close()
            if store is None:
                app.state.store.close()

    app = FastAPI(
        title="routing-replay",
        version=__version__,
        summary="Record, check and serve MoE routing for Rollout Routing Replay",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = ServiceMetrics()
    # per-run health, read from the index at scrape time: every replica answers for the whole service
    app.state.metrics.add_scraped(RunHealthCollector(lambda: app.state.store, settings))
    app.state.metrics.add_scraped(StoreCollector(settings.data_dir, lambda: stored_bytes(app),
                                                 lambda: feed_round_at(app)))
    install_error_handlers(app)
    app.state.tokens = tokens if tokens is not None else Tokens.load(settings.tokens_file)
    # Starlette tries routes in the order they were added (~2-4 us each): the hot reads (one route, a training step's
    # slices) first, then ingest; the route GET no longer waits behind the 12 routes of ingest, references and runs.
    for module in (requests, trainer, ingest, references, runs, trajectories, compares, health, ops):
        # every API route passes the token gate (its role: api/auth.py ROUTE_NEEDS); docs and web files do not
        app.include_router(module.router, dependencies=[Depends(authorize)], responses=AUTH)

    app.add_middleware(LatencyMiddleware, metrics=app.state.metrics)
    app.add_middleware(CloseUnreadBodies)  # outermost: whichever layer answered before the body had arrived

    app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    return app
