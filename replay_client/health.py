"""Run health on the client: the service's verdict on a run or a training batch, typed, and the training-loop gate.

Contract: `HealthReport.from_json` reads the answer of `GET` / `POST /v1/runs/{run}/health` (checks, limits and metric
names: docs/health.md) and keeps what it does not know (a newer service's checks, metrics, fields) in `checks`,
`metrics` and `raw` rather than refusing it. `Verdict` orders the levels ok < warn < fail. `RoutingUnhealthy` is what
`ReplayClient.check_batch` raises when a batch's verdict reaches the gate's level (`gate_level`: "fail" or "warn");
its message names each finding. `batch_request_ids` takes ids or the sequences given to `megatron_batch`.
Design: docs/design/trainer_client.md ("Run health and the training-loop gate").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The checks the service judges, in the order it reports them (docs/health.md); also the keys of a run's
# thresholds. A service may judge more: those still arrive in `HealthReport.checks`.
CHECKS = ("ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "CONFLICT", "GAP", "FALLBACK", "UNRESOLVED", "OPEN",
          "MISSING", "RECOMPUTED", "STALENESS", "ROUTER_MISMATCH", "TOKEN_MISMATCH")

# What a check's count counts, for messages.
_UNITS = {"UNRESOLVED": "references", "OPEN": "requests", "MISSING": "requests", "RECOMPUTED": "positions"}
_AGREEMENT_CHECKS = frozenset({"ROUTER_MISMATCH", "TOKEN_MISMATCH"})  # a figure of a comparison, not a count
_SHOWN_REQUESTS = 3  # requests named per finding in a `RoutingUnhealthy` message


class Verdict(enum.StrEnum):
    """A check's level, and a report's verdict (the worst level over its checks): ok < warn < fail."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        """0 for ok, 1 for warn, 2 for fail (the `r3/verdict` metric)."""
        return _RANK[self]

    def at_least(self, other: Verdict | str) -> bool:
        """True when this level is `other` or worse."""
        return self.rank >= Verdict(other).rank


_RANK = {Verdict.OK: 0, Verdict.WARN: 1, Verdict.FAIL: 2}


@dataclass(frozen=True)
class RequestAt:
    """A request a finding names: where its first counted row is (None for OPEN, MISSING) and how many it has."""

    request_id: str
    first_position: int | None
    count: int | None  # rows of the kind it holds; None for a request check (OPEN, MISSING)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RequestAt:
        """One entry of a finding's `requests`."""
        return cls(str(doc["request_id"]), _int_or_none(doc.get("first_position")), _int_or_none(doc.get("count")))


@dataclass(frozen=True)
class Check:
    """One check's figures: `count` of its kind (None for a comparison's figure), `value` (the count's fraction of
    the scope, or the comparison's figure; None: not known here), the `level` it reached and the limits it was
    judged against (None: no limit)."""

    name: str
    count: int | None
    value: float | None
    level: Verdict
    warn: float | None
    fail: float | None

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> Check:
        """One entry of a report's `checks`."""
        return cls(name, _int_or_none(doc.get("count")), _float_or_none(doc.get("value")), Verdict(doc["level"]),
                   _float_or_none(doc.get("warn")), _float_or_none(doc.get("fail")))


@dataclass(frozen=True)
class Finding:
    """A check that reached warn or fail: what, how much, against which limit, and where (at most 20 requests by
    id; a ROUTER_MISMATCH finding names its comparison instead)."""

    check: str
    level: Verdict
    count: int | None
    value: float | None
    limit: float | None
    requests: tuple[RequestAt, ...] = ()
    compare_id: str | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Finding:
        """One entry of a report's `failed` or `warned`."""
        return cls(str(doc["check"]), Verdict(doc["level"]), _int_or_none(doc.get("count")),
                   _float_or_none(doc.get("value")), _float_or_none(doc.get("limit")),
                   tuple(RequestAt.from_json(r) for r in doc.get("requests") or ()), doc.get("compare_id"))

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests named, in the service's order."""
        return [r.request_id for r in self.requests]

    def describe(self, agreement: Agreement | None = None) -> str:
        """One line: `ZERO 3 rows (0.30%, limit 0) in 'req-7' from position 17, ...`; an agreement finding given its
        comparison's `agreement` also names the worst layers (`... in comparison 'c1': model layer 2 at 71.0%, ...`)."""
        limit = "no limit" if self.limit is None else f"limit {self.limit:g}"
        if self.check in _AGREEMENT_CHECKS:
            value = "?" if self.value is None else f"{self.value:.4g}"
            where = f" in comparison {self.compare_id!r}" if self.compare_id else ""
            layers = agreement.describe_layers() if agreement is not None and \
                agreement.compare_id == self.compare_id else ""
            return f"{self.check} {value} ({limit}){where}" + (f": {layers}" if layers else "")
        unit = _UNITS.get(self.check, "rows")
        value = "" if self.value is None else f"{self.value:.2%}, "
        text = f"{self.check} {'?' if self.count is None else self.count} {unit} ({value}{limit})"
        if self.requests:
            named = [f"{r.request_id!r}" + ("" if r.first_position is None else f" from position {r.first_position}")
                     for r in self.requests[:_SHOWN_REQUESTS]]
            more = len(self.requests) - _SHOWN_REQUESTS
            text += " in " + ", ".join(named) + (f" and {more} more" if more > 0 else "")
        return text


@dataclass(frozen=True)
class VersionsSummary:
    """Rows per weight version in the scope; `stale_rows` are versioned rows not of `current`; `max_lag` only
    when every label is an integer."""

    current: str | None
    rows: dict[str, int]
    unversioned: int
    stale_rows: int
    max_lag: int | None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any] | None) -> VersionsSummary:
        """A report's `weight_versions` (an empty summary when absent)."""
        doc = doc or {}
        lag = doc.get("max_lag")
        return cls(doc.get("current"), {str(k): int(v) for k, v in (doc.get("rows") or {}).items()},
                   int(doc.get("unversioned") or 0), int(doc.get("stale_rows") or 0),
                   None if lag is None else int(lag))


@dataclass(frozen=True)
class Agreement:
    """The comparison a report judges (POST .../compare: the one of the highest training step, else the newest),
    with the step and weight version it was posted with (None when not given); `worst_layers` are MoE
    ordinals, worst first (`worst_layer_mismatch` their router mismatch, where the service says it)."""

    compare_id: str
    step: int | None
    weight_version: str | None
    created_at: float
    router_mismatch: float
    token_mismatch: float
    jaccard: float
    worst_layers: tuple[int, ...]
    worst_layer_mismatch: tuple[float, ...] = ()
    label: str | None = None
    tokens: int | None = None
    worst_model_layers: tuple[int, ...] = ()  # the model layer of each worst layer, where the service says it

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Agreement:
        """A report's `agreement` (worst layers as MoE ordinals, or as `{"layer", "model_layer",
        "router_mismatch"}` objects)."""
        worst = list(doc.get("worst_layers") or ())
        objects = [w for w in worst if isinstance(w, Mapping)]
        ordinals = tuple(int(w["layer"]) if isinstance(w, Mapping) else int(w) for w in worst)
        mismatch = tuple(float(w["router_mismatch"]) for w in objects) if len(objects) == len(worst) else ()
        model_layers = tuple(int(w["model_layer"]) for w in objects if "model_layer" in w)
        return cls(str(doc["compare_id"]), _int_or_none(doc.get("step")), doc.get("weight_version"),
                   float(doc["created_at"]), float(doc["router_mismatch"]), float(doc["token_mismatch"]),
                   float(doc["jaccard"]), ordinals, mismatch, doc.get("label"), _int_or_none(doc.get("tokens")),
                   model_layers if len(model_layers) == len(worst) else ())

    def describe_layers(self) -> str:
        """The worst layers with their router mismatch (`model layer 2 at 71.0%, model layer 1 at 45.5%`), by model
        layer where known, else by MoE ordinal; "" without per-layer figures."""
        if not self.worst_layer_mismatch:
            return ""
        names = [f"model layer {m}" for m in self.worst_model_layers] or [f"MoE layer {o}" for o in self.worst_layers]
        return ", ".join(f"{name} at {share:.1%}" for name, share in zip(names, self.worst_layer_mismatch) if share)


@dataclass(frozen=True)
class HealthReport:
    """The service's health verdict on a run (`scope == "run"`, optionally over a recent window) or on the
    requests of a training batch (`scope == "batch"`).

    `checks` holds every check judged, by name; `failed` / `warned` the findings at each level, in check order;
    `metrics` the flat dict trainers log as is; `raw` the answer as received.
    """

    run_id: str
    scope: str
    verdict: Verdict
    checks: dict[str, Check]
    failed: tuple[Finding, ...]
    warned: tuple[Finding, ...]
    weight_versions: VersionsSummary
    agreement: Agreement | None
    metrics: dict[str, float]
    window_s: float | None = None
    requests: int = 0
    requests_open: int = 0
    rows_expected: int = 0
    rows: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> HealthReport:
        """A report from the JSON answer of `GET` / `POST /v1/runs/{run}/health`."""
        agreement = doc.get("agreement")
        return cls(
            run_id=str(doc["run_id"]),
            scope=str(doc.get("scope", "run")),
            verdict=Verdict(doc["verdict"]),
            checks={name: Check.from_json(name, c) for name, c in (doc.get("checks") or {}).items()},
            failed=tuple(Finding.from_json(f) for f in doc.get("failed") or ()),
            warned=tuple(Finding.from_json(f) for f in doc.get("warned") or ()),
            weight_versions=VersionsSummary.from_json(doc.get("weight_versions")),
            agreement=None if agreement is None else Agreement.from_json(agreement),
            metrics={str(k): float(v) for k, v in (doc.get("metrics") or {}).items() if v is not None},
            window_s=_float_or_none(doc.get("window_s")),
            requests=int(doc.get("requests") or 0),
            requests_open=int(doc.get("requests_open") or 0),
            rows_expected=int(doc.get("rows_expected") or 0),
            rows=int(doc.get("rows") or 0),
            raw=dict(doc),
        )

    @property
    def ok(self) -> bool:
        """True when no check reached warn or fail."""
        return self.verdict is Verdict.OK

    def findings(self, at_least: Verdict | str = Verdict.WARN) -> list[Finding]:
        """The findings at `at_least` or worse: failed ones first, then warned ones (each in check order)."""
        level = Verdict(at_least)
        return [f for f in (*self.failed, *self.warned) if f.level.at_least(level)]

    def finding(self, check: str) -> Finding | None:
        """The failed or warned finding of `check`, if it reached either level."""
        return next((f for f in (*self.failed, *self.warned) if f.check == check), None)

    def describe(self, at_least: Verdict | str = Verdict.WARN) -> str:
        """One line naming the scope, the verdict and each finding at `at_least` or worse."""
        scope = "batch" if self.scope == "batch" else ("run" if self.window_s is None else
                                                       f"last {self.window_s:g} s")
        words = {Verdict.FAIL: "fails", Verdict.WARN: "warns on", Verdict.OK: "passes"}[self.verdict]
        found = self.findings(at_least)
        head = f"run {self.run_id!r} {scope} {words} routing health"
        return head + (": " + "; ".join(f.describe(self.agreement) for f in found) if found else "")


class RoutingUnhealthy(Exception):
    """A training batch's routing is not fit to replay: the verdict reached the gate's level (`check_batch`).

    `report` is the whole `HealthReport`; the message names each finding at that level or worse: the check, its
    count, value and limit, and the first requests with their first positions.
    """

    def __init__(self, report: HealthReport, fail_on: Verdict | str = Verdict.FAIL) -> None:
        self.report = report
        self.fail_on = Verdict(fail_on)
        super().__init__(report.describe(self.fail_on))

    @property
    def findings(self) -> list[Finding]:
        """The findings that made the gate raise (at `fail_on` or worse)."""
        return self.report.findings(self.fail_on)

    @property
    def checks(self) -> list[str]:
        """The names of those findings' checks."""
        return [f.check for f in self.findings]


def gate_level(fail_on: Verdict | str) -> Verdict:
    """The level `check_batch` raises at: "fail" or "warn" (ValueError for anything else, "ok" included: a gate
    that raises on every batch is a mistake, not a setting)."""
    try:
        level = Verdict(fail_on)
    except ValueError:
        raise ValueError(f"fail_on must be 'fail' or 'warn', got {fail_on!r}") from None
    if level is Verdict.OK:
        raise ValueError("fail_on must be 'fail' or 'warn', got 'ok'")
    return level


def batch_request_ids(run_id: str, request_ids: Sequence[Any]) -> list[str]:
    """A batch's request ids from ids, or from the sequences given to `megatron_batch` / `verl_batch`
    ((run, request) pairs or dicts with `run` and `request`); ValueError for a sequence of another run."""
    out: list[str] = []
    for item in request_ids:
        if isinstance(item, str):
            out.append(item)
            continue
        run, request = (item["run"], item["request"]) if isinstance(item, Mapping) else (item[0], item[1])
        if run != run_id:
            raise ValueError(f"the batch names request {request!r} of run {run!r}, not of run {run_id!r}; "
                             "check each run's requests separately")
        out.append(str(request))
    return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


__all__ = ["CHECKS", "Agreement", "Check", "Finding", "HealthReport", "RequestAt", "RoutingUnhealthy", "Verdict",
           "VersionsSummary", "batch_request_ids", "gate_level"]
