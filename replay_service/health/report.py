"""A health report: each check's figure and level, findings that name requests and first positions, flat metrics.

`judge` is pure: it turns a scope's sums (`store.health.ScopeTotals`), its weight versions and the newest
comparison into figures against the thresholds. `gather.py` reads those and adds the findings' requests.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from replay_service.health.rules import BATCH_ONLY, Check, Thresholds
from replay_service.health.verdict import Level, Limit
from replay_service.store.tables.health import ScopeTotals


class Scope(enum.StrEnum):
    """What a report judges: a run (its whole life, or the requests it wrote in a recent window), or a batch."""

    RUN = "run"
    BATCH = "batch"


@dataclass(frozen=True)
class WorstLayer:
    """One MoE layer of a comparison, by its router mismatch."""

    layer: int  # MoE ordinal
    model_layer: int
    router_mismatch: float

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"layer": self.layer, "model_layer": self.model_layer, "router_mismatch": self.router_mismatch}


@dataclass(frozen=True)
class AgreementPoint:
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
    worst_layers: tuple[WorstLayer, ...]

    @classmethod
    def of(cls, doc: Mapping[str, Any], worst: int = 3) -> AgreementPoint:
        """The point of a stored comparison answer (compare/comparison.py), its `worst` worst layers."""
        per_layer = doc["per_layer"]
        layers = tuple(WorstLayer(i, per_layer[i]["model_layer"], per_layer[i]["router_mismatch"])
                       for i in doc["worst_layers"][:worst])
        return cls(doc["compare_id"], doc.get("step"), doc.get("weight_version"), doc["created_at"], doc.get("label"),
                   doc["tokens"], doc["router_mismatch"], doc["token_mismatch"], doc["jaccard"], layers)

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"compare_id": self.compare_id, "step": self.step, "weight_version": self.weight_version,
                "created_at": self.created_at, "label": self.label, "tokens": self.tokens,
                "router_mismatch": self.router_mismatch, "token_mismatch": self.token_mismatch,
                "jaccard": self.jaccard, "worst_layers": [w.to_json() for w in self.worst_layers]}


@dataclass(frozen=True)
class VersionFigures:
    """The scope's served rows per weight version, and how many are not of the current one."""

    current: str | None  # the batch's (given), else the newest (`version_order`)
    rows: Mapping[str, int]
    unversioned: int  # rows of no known version
    stale_rows: int  # versioned rows not of `current`
    max_lag: int | None  # current minus the oldest version, when every label is an integer

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"current": self.current, "rows": dict(self.rows), "unversioned": self.unversioned,
                "stale_rows": self.stale_rows, "max_lag": self.max_lag}


def version_order(labels: Sequence[str]) -> list[str]:
    """Labels oldest first: by number when every one is an integer (vLLM's and most trainers' step counters),
    else by text."""
    if all(_is_int(v) for v in labels):
        return sorted(labels, key=int)
    return sorted(labels)


def version_figures(rows: int, per_version: Mapping[str, int], current: str | None) -> VersionFigures:
    """Rows per version over a scope of `rows` served rows; `current` None: the newest."""
    ordered = version_order(list(per_version))
    if current is None and ordered:
        current = ordered[-1]
    stale = sum(n for v, n in per_version.items() if v != current)
    lag = None
    if ordered and current is not None and all(_is_int(v) for v in [*ordered, current]):
        lag = max(int(current) - int(ordered[0]), 0)
    return VersionFigures(current, {v: per_version[v] for v in ordered}, max(rows - sum(per_version.values()), 0),
                          stale, lag)


def _is_int(label: str) -> bool:
    try:
        int(label)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Figure:
    """One check over a scope: its count (rows or requests; None for a ratio), value, level and limit."""

    check: Check
    count: int | None
    value: float | None  # None: not known here (no comparison, no versioned row)
    level: Level
    limit: Limit

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"count": self.count, "value": self.value, "level": self.level.label, **self.limit.to_json()}


@dataclass(frozen=True)
class Where:
    """A request a finding names: how many rows of the kind it holds, and the first position of one."""

    request_id: str
    count: int | None  # None for a request check (OPEN, MISSING)
    first_position: int | None

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        return {"request_id": self.request_id, "count": self.count, "first_position": self.first_position}


@dataclass(frozen=True)
class Finding:
    """A check that warned or failed, and where."""

    figure: Figure
    requests: tuple[Where, ...] = ()
    compare_id: str | None = None  # the comparison a mismatch check judged

    def to_json(self) -> dict[str, Any]:
        """The API object."""
        f = self.figure
        out = {"check": str(f.check), "level": f.level.label, "count": f.count, "value": f.value,
               "limit": f.limit.bound(f.level), "requests": [w.to_json() for w in self.requests]}
        if self.compare_id is not None:
            out["compare_id"] = self.compare_id
        return out


@dataclass(frozen=True)
class HealthReport:
    """The answer of `GET` / `POST /v1/runs/{run}/health`."""

    run_id: str
    scope: Scope
    window_s: float | None
    totals: ScopeTotals
    missing: int  # batch requests the run does not hold
    figures: Mapping[Check, Figure]
    findings: tuple[Finding, ...]
    versions: VersionFigures
    agreement: AgreementPoint | None
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def verdict(self) -> Level:
        """The worst level of the checks."""
        return max((f.level for f in self.figures.values()), default=Level.OK)

    @property
    def requests(self) -> int:
        """Requests in scope (a batch's missing ones included)."""
        return self.totals.requests + self.missing

    def metrics(self) -> dict[str, float]:
        """Flat metrics with stable names, to log as they are (W&B, TensorBoard, MLflow); unknown figures left out."""
        t, fig = self.totals, self.figures
        out: dict[str, float] = {"r3/verdict": float(self.verdict), "r3/requests": float(self.requests),
                                 "r3/rows_expected": float(t.expected)}
        out["r3/flagged_frac"] = t.unclean / t.expected if t.expected else float(bool(t.unclean))
        named = {"r3/zero_frac": Check.ZERO, "r3/stale_frac": Check.STALE,
                 "r3/out_of_range_frac": Check.OUT_OF_RANGE, "r3/duplicate_frac": Check.DUPLICATE,
                 "r3/conflict_frac": Check.CONFLICT, "r3/gap_frac": Check.GAP, "r3/fallback_frac": Check.FALLBACK,
                 "r3/recomputed_frac": Check.RECOMPUTED, "r3/version_stale_frac": Check.STALENESS}
        for name, check in named.items():
            value = fig[check].value
            if value is not None:
                out[name] = float(value)
        out["r3/unresolved_refs"] = float(t.unresolved)
        out["r3/open_requests"] = float(t.open)
        if self.scope is Scope.BATCH:
            out["r3/missing_requests"] = float(self.missing)
        if self.versions.max_lag is not None:
            out["r3/version_max_lag"] = float(self.versions.max_lag)
        if self.agreement is not None:
            out["r3/router_mismatch"] = self.agreement.router_mismatch
            out["r3/token_mismatch"] = self.agreement.token_mismatch
            out["r3/jaccard"] = self.agreement.jaccard
        return out

    def to_json(self) -> dict[str, Any]:
        """The HealthReport object the API answers with."""
        t = self.totals
        return {
            "run_id": self.run_id, "scope": str(self.scope), "window_s": self.window_s,
            "verdict": self.verdict.label,
            "requests": self.requests, "requests_open": t.open, "rows_expected": t.expected, "rows": t.rows,
            "checks": {str(c): f.to_json() for c, f in self.figures.items()},
            "failed": [f.to_json() for f in self.findings if f.figure.level is Level.FAIL],
            "warned": [f.to_json() for f in self.findings if f.figure.level is Level.WARN],
            "weight_versions": self.versions.to_json(),
            "agreement": self.agreement.to_json() if self.agreement is not None else None,
            "metrics": self.metrics(),
        }


def judge(totals: ScopeTotals, scope: Scope, thresholds: Thresholds, versions: VersionFigures,
          agreement: AgreementPoint | None, missing: int = 0) -> dict[Check, Figure]:
    """Every check's figure and level over a scope (its sums, versions, newest comparison; a batch's missing
    requests); checks judged for a batch only are ok in a run's report."""
    expected = totals.expected

    def rate(count: int, of: int) -> float:
        return count / of if of else (1.0 if count else 0.0)

    counts: dict[Check, tuple[int | None, float | None]] = {}
    for check in (Check.ZERO, Check.STALE, Check.OUT_OF_RANGE, Check.DUPLICATE, Check.CONFLICT):
        flag = check.flag
        assert flag is not None
        n = totals.flagged[flag]
        counts[check] = (n, rate(n, expected))
    counts[Check.GAP] = (totals.gap, rate(totals.gap, expected))
    fallback = min(totals.unclean + totals.gap, expected) if expected else totals.unclean
    counts[Check.FALLBACK] = (fallback, rate(fallback, expected))
    counts[Check.UNRESOLVED] = (totals.unresolved, rate(totals.unresolved, totals.references))
    requests = totals.requests + missing
    counts[Check.OPEN] = (totals.open, rate(totals.open, requests))
    counts[Check.MISSING] = (missing, rate(missing, requests))
    counts[Check.RECOMPUTED] = (totals.recomputed, rate(totals.recomputed, expected))
    versioned = sum(versions.rows.values())
    counts[Check.STALENESS] = (versions.stale_rows, versions.stale_rows / versioned if versioned else None)
    counts[Check.ROUTER_MISMATCH] = (None, agreement.router_mismatch if agreement is not None else None)
    counts[Check.TOKEN_MISMATCH] = (None, agreement.token_mismatch if agreement is not None else None)
    out: dict[Check, Figure] = {}
    for check in Check:
        count, value = counts[check]
        limit = thresholds.limits[check]
        level = Level.OK if (check in BATCH_ONLY and scope is Scope.RUN) else limit.judge(value)
        out[check] = Figure(check, count, value, level, limit)
    return out

