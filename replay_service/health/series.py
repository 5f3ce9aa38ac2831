"""A run's health over time: flag rates and expert-load imbalance per ingest-time bucket and per weight version,
and its agreement with training as a series in training-step order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay_service.health.report import AgreementPoint, version_order
from replay_service.store import RouteStore
from replay_service.store.tables.health import TICK_FLAGS


def imbalance(load: np.ndarray) -> tuple[float | None, float | None]:
    """Per MoE layer, the busiest expert's tokens over the mean expert's (1.0: perfectly even; E / top_k at most
    when every token picks the same experts): (mean over layers, the worst layer). None without any token."""
    totals = load.sum(axis=1)
    used = totals > 0
    if not used.any():
        return None, None
    per_layer = load[used].max(axis=1) / (totals[used] / load.shape[1])
    return float(per_layer.mean()), float(per_layer.max())


@dataclass(frozen=True)
class IngestPoint:
    """One ingest-time bucket: rows served, rows per content flag, the clean rows' expert-load imbalance."""

    t: float
    rows: int
    flagged: dict[str, int]
    imbalance: float | None
    imbalance_max: float | None

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"t": self.t, "rows": self.rows, "flagged": self.flagged, "imbalance": self.imbalance,
                "imbalance_max": self.imbalance_max}


@dataclass(frozen=True)
class VersionPoint:
    """One weight version: its served rows and their clean rows' expert-load imbalance."""

    version: str
    rows: int
    imbalance: float | None
    imbalance_max: float | None

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"version": self.version, "rows": self.rows, "imbalance": self.imbalance,
                "imbalance_max": self.imbalance_max}


def health_series(store: RouteStore, run_id: str) -> dict[str, Any]:
    """The `/health/series` answer: ingest buckets by time, weight versions oldest first."""
    shape = store.run_shape(run_id)
    ingest = []
    for tick in store.health.ticks(run_id, shape):
        mean, worst = imbalance(tick.load)
        ingest.append(IngestPoint(tick.t, tick.rows, {str(f.name): tick.flagged[f] for f in TICK_FLAGS}, mean, worst))
    loads = store.health.version_loads(run_id, shape)
    rows = store.health.versions(run_id, None, None)
    versions = []
    for version in version_order(sorted(set(loads) | set(rows))):
        load = loads.get(version)
        mean, worst = imbalance(load) if load is not None else (None, None)
        versions.append(VersionPoint(version, rows.get(version, 0), mean, worst))
    return {"run_id": run_id, "bucket_s": store.settings.health_bucket_s,
            "ingest": [p.to_json() for p in ingest], "versions": [v.to_json() for v in versions]}


def agreement_series(store: RouteStore, run_id: str) -> list[AgreementPoint]:
    """The run's comparisons posted with a training step, by (step, time posted)."""
    store.run_shape(run_id)
    docs = [d for d in store.compares.list(run_id) if d.get("step") is not None]
    docs.sort(key=lambda d: (d["step"], d["created_at"]))
    return [AgreementPoint.of(d) for d in docs]
