"""Run health: verdicts over a run or a training batch, the run's thresholds, its health and agreement series."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from replay_format import ID_RULE, valid_id
from replay_format.weight_versions import check_label
from replay_service.api.deps import RunId, Settings, Store
from replay_service.api.models import ERRORS
from replay_service.errors import InvalidInput
from replay_service.health.gather import batch_health, run_health, set_thresholds, thresholds_of
from replay_service.health.rules import Check, Thresholds
from replay_service.health.series import agreement_series, health_series

router = APIRouter(prefix="/v1", tags=["health"], responses=ERRORS)


class LimitModel(BaseModel):
    """A check's limits: fail above `fail`, else warn above `warn` (null: never; 0: any)."""

    model_config = ConfigDict(extra="forbid")
    warn: float | None = Field(None, ge=0)
    fail: float | None = Field(None, ge=0)


class CheckFigure(LimitModel):
    """One check over the scope: rows or requests counted (null for a ratio), its figure, level and limits."""

    model_config = ConfigDict(extra="forbid")
    count: int | None
    value: float | None = Field(description="rows of the kind / rows expected (see docs/health.md per check)")
    level: str = Field(description="ok | warn | fail")


class WhereModel(BaseModel):
    """A request a finding names, its rows of the kind and the first position of one."""

    request_id: str
    count: int | None
    first_position: int | None


class FindingModel(BaseModel):
    """A check that warned or failed, and where."""

    check: str = Field(description="ZERO, STALE, OUT_OF_RANGE, DUPLICATE, CONFLICT, GAP, FALLBACK, UNRESOLVED, OPEN, "
                       "MISSING, RECOMPUTED, STALENESS, ROUTER_MISMATCH, TOKEN_MISMATCH")
    level: str
    count: int | None
    value: float | None
    limit: float | None
    requests: list[WhereModel] = Field(description="up to REPLAY_HEALTH_WHERE requests, by id")
    compare_id: str | None = None


class WeightVersionFigures(BaseModel):
    """Served rows per weight version over the scope, and those not of the current version."""

    current: str | None
    rows: dict[str, int]
    unversioned: int
    stale_rows: int
    max_lag: int | None = Field(description="current minus the oldest version, when every label is an integer")


class WorstLayerModel(BaseModel):
    """A MoE layer of a comparison by its router mismatch."""

    layer: int
    model_layer: int
    router_mismatch: float


class AgreementPointModel(BaseModel):
    """One stored comparison's figures, with the training step and weight version it was posted with."""

    compare_id: str
    step: int | None
    weight_version: str | None
    created_at: float
    label: str | None
    tokens: int
    router_mismatch: float
    token_mismatch: float
    jaccard: float
    worst_layers: list[WorstLayerModel]


class HealthAnswer(BaseModel):
    """A run's or a training batch's routing health: the verdict, every check, what failed and where."""

    run_id: str
    scope: str = Field(description="run | batch")
    window_s: float | None
    verdict: str = Field(description="ok | warn | fail: the worst level of the checks")
    requests: int
    requests_open: int
    rows_expected: int
    rows: int
    checks: dict[str, CheckFigure]
    failed: list[FindingModel]
    warned: list[FindingModel]
    weight_versions: WeightVersionFigures
    agreement: AgreementPointModel | None
    metrics: dict[str, float] = Field(description="flat metrics with stable names, to log as they are")


class BatchHealthQuery(BaseModel):
    """The requests of one training batch, and the weight version the trainer trains."""

    model_config = ConfigDict(extra="forbid")
    requests: list[str] = Field(min_length=1, description="request ids (repeats counted once)")
    weight_version: str | None = Field(None, description="the current version; default: the batch's newest")


class ThresholdsAnswer(BaseModel):
    """Every check's limits for a run: the defaults, with the ones it overrides."""

    run_id: str
    thresholds: dict[str, LimitModel]
    overridden: list[str]


class IngestPointModel(BaseModel):
    """One ingest-time bucket of a run."""

    t: float = Field(description="the bucket's start, Unix seconds")
    rows: int
    flagged: dict[str, int]
    imbalance: float | None = Field(description="per MoE layer busiest / mean expert load, averaged over layers")
    imbalance_max: float | None = Field(description="the worst layer's")


class VersionPointModel(BaseModel):
    """One weight version of a run."""

    version: str
    rows: int
    imbalance: float | None
    imbalance_max: float | None


class HealthSeries(BaseModel):
    """A run's flag rates and expert-load imbalance over ingest time, and per weight version."""

    run_id: str
    bucket_s: float
    ingest: list[IngestPointModel]
    versions: list[VersionPointModel]


class AgreementSeries(BaseModel):
    """A run's comparisons posted with a training step, in step order."""

    run_id: str
    points: list[AgreementPointModel]


@router.get("/runs/{run}/health", summary="A run's routing health: verdict, every check, what failed and where",
            response_model=HealthAnswer)
def get_health(
    run: RunId,
    store: Store,
    window_s: float | None = Query(None, gt=0, le=10 * 365 * 86400,
                                   description="only the requests written in the last window_s seconds"),
) -> dict:
    return run_health(store, run, window_s).to_json()


@router.post("/runs/{run}/health", summary="A training batch's routing health (gate it before replaying it)",
             response_model=HealthAnswer)
async def post_health(run: RunId, body: BatchHealthQuery, store: Store, settings: Settings) -> dict:
    for rid in body.requests:
        if not valid_id(rid):
            raise InvalidInput(f"request id {rid!r} is not a valid id: {ID_RULE}")
    if body.weight_version is not None:
        try:
            check_label(body.weight_version, "weight_version")
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
    report = await run_in_threadpool(batch_health, store, run, body.requests, body.weight_version,
                                     settings.max_batch_requests)
    return report.to_json()


def _thresholds_answer(run: str, thresholds: Thresholds) -> dict[str, Any]:
    return {"run_id": run, "thresholds": thresholds.to_json(),
            "overridden": [str(c) for c in Check if c in thresholds.overridden]}


@router.get("/runs/{run}/health/thresholds", summary="A run's health limits (defaults and its overrides)",
            response_model=ThresholdsAnswer)
def get_thresholds(run: RunId, store: Store) -> dict:
    store.run_shape(run)
    return _thresholds_answer(run, thresholds_of(store, run))


@router.put("/runs/{run}/health/thresholds",
            summary="Override a run's health limits: {CHECK: {warn, fail}}, merged over the defaults",
            response_model=ThresholdsAnswer)
def put_thresholds(run: RunId, body: dict[str, LimitModel], store: Store) -> dict:
    overrides = {name: limit.model_dump(exclude_unset=True) for name, limit in body.items()}
    return _thresholds_answer(run, set_thresholds(store, run, overrides))


@router.delete("/runs/{run}/health/thresholds", summary="Drop a run's overrides: the default limits again",
               response_model=ThresholdsAnswer)
def delete_thresholds(run: RunId, store: Store) -> dict:
    return _thresholds_answer(run, set_thresholds(store, run, {}))


@router.get("/runs/{run}/health/series",
            summary="Flag rates and expert-load imbalance over ingest time, and per weight version",
            response_model=HealthSeries)
def get_series(run: RunId, store: Store) -> dict:
    return health_series(store, run)


@router.get("/runs/{run}/agreement", summary="The run's comparisons posted with a training step, in step order",
            response_model=AgreementSeries)
def get_agreement(run: RunId, store: Store) -> dict:
    return {"run_id": run, "points": [p.to_json() for p in agreement_series(store, run)]}
