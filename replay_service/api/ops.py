"""Operations: health (with the release's version) and Prometheus metrics."""

from __future__ import annotations

import os

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from replay_service import __version__
from replay_service.api.deps import Metrics, Settings, Store
from replay_service.api.models import Health

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness and store status", response_model=Health,
            responses={503: {"description": "The index or the segment store does not answer"}})
def healthz(store: Store, settings: Settings) -> dict:
    """Counts the index's runs and asks the segment store once: a replica cut off from either answers 503, so a
    load balancer's health check takes it out (docs/scale_out.md)."""
    runs = store.run_count()
    store.segments.ping()
    return {"status": "ok", "runs": runs, "data_dir": str(settings.data_dir), "version": __version__,
            "pid": os.getpid()}


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(m: Metrics) -> Response:
    """Every metric of the service: under several workers, summed over them (metrics.py)."""
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)
