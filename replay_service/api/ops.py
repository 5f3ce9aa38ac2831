"""Operations: health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replay_service.api.deps import Metrics, Settings, Store
from replay_service.api.models import Health

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness and store status", response_model=Health)
def healthz(store: Store, settings: Settings) -> dict:
    return {"status": "ok", "runs": store.run_count(), "data_dir": str(settings.data_dir)}


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(m: Metrics) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
