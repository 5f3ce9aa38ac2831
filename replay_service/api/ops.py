"""Operations: health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replay_service.api.deps import Metrics, Settings, Store

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness and store status")
def healthz(store: Store, settings: Settings) -> dict:
    runs = store.index.one("SELECT COUNT(*) AS n FROM runs")["n"]
    return {"status": "ok", "runs": runs, "data_dir": str(settings.data_dir)}


@router.get("/metrics", summary="Prometheus metrics")
def metrics(m: Metrics) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
