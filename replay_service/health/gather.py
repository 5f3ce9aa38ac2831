"""The health of a run, a recent window of it, or a training batch: figures read from the store, then judged.

    scope sums (store/tables/health.py)  ->  judge (report.py)  ->  findings: requests and first positions

The sums come from the index in one statement (no route is read for a clean scope). A finding names up to
`REPLAY_HEALTH_WHERE` requests of its kind, by id; a request's first position of the kind is its first flagged
position when that is the only kind it holds, else read from its rows' flags (`RouteStore.read_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from replay_format import Flag
from replay_service.errors import InvalidInput
from replay_service.health.report import (
    AgreementPoint,
    Finding,
    HealthReport,
    Scope,
    Where,
    judge,
    version_figures,
)
from replay_service.health.rules import BATCH_ONLY, ROW_FLAG_CHECKS, Check, Thresholds
from replay_service.health.verdict import Level
from replay_service.store import RouteStore
from replay_service.store.index import Row
from replay_service.store.requests.summaries import RequestRecord
from replay_service.store.runs import RunState


def thresholds_of(store: RouteStore, run_id: str) -> Thresholds:
    """A run's limits: the defaults with its overrides."""
    return Thresholds.with_overrides(store.health.overrides(run_id))


def set_thresholds(store: RouteStore, run_id: str, overrides: dict) -> Thresholds:
    """Replace a run's overrides (checked first: InvalidInput names a bad one); its limits after."""
    store.run_shape(run_id)  # NotFound for an unknown run
    thresholds = Thresholds.with_overrides(overrides)
    store.health.set_overrides(run_id, {str(c): thresholds.limits[c].to_json() for c in thresholds.overridden})
    return thresholds


def newest_agreement(store: RouteStore, run_id: str) -> AgreementPoint | None:
    """The run's newest comparison: of the highest training step when any was posted with one, else the last
    posted."""
    docs = store.compares.list(run_id)  # newest first
    stepped = [d for d in docs if d.get("step") is not None]
    if stepped:
        return AgreementPoint.of(max(stepped, key=lambda d: (d["step"], d["created_at"])))
    return AgreementPoint.of(docs[0]) if docs else None


def run_health(store: RouteStore, run_id: str, window_s: float | None = None) -> HealthReport:
    """A run's health over its whole life, or over the requests it wrote in the last `window_s` seconds."""
    run = store.run_to_read(run_id)  # NotFound first; taken before the requests whose rows a finding may read
    since = time.time() - window_s if window_s is not None else None
    return _report(store, run, Scope.RUN, None, since, window_s, None, 0)


def batch_health(store: RouteStore, run_id: str, request_ids: Sequence[str], weight_version: str | None,
                 max_requests: int) -> HealthReport:
    """A training batch's health: the requests it names (each once), judged against the version it trains."""
    run = store.run_to_read(run_id)  # as in run_health
    if not request_ids:
        raise InvalidInput("a health batch names at least one request")
    if len(request_ids) > max_requests:
        raise InvalidInput(f"{len(request_ids)} requests exceeds max_batch_requests={max_requests}")
    ids = list(dict.fromkeys(request_ids))
    missing = sorted(set(ids) - store.health.known(run_id, ids))
    report = _report(store, run, Scope.BATCH, ids, None, None, weight_version, len(missing))
    if not missing:
        return report
    findings = tuple(
        Finding(f.figure, tuple(Where(r, None, None) for r in missing[:store.settings.health_where]))
        if f.figure.check is Check.MISSING else f for f in report.findings)
    return HealthReport(report.run_id, report.scope, report.window_s, report.totals, report.missing, report.figures,
                        findings, report.versions, report.agreement, report.thresholds)


def _report(store: RouteStore, run: RunState, scope: Scope, ids: list[str] | None, since: float | None,
            window_s: float | None, weight_version: str | None, missing: int) -> HealthReport:
    run_id = run.run_id
    totals = store.health.totals(run_id, ids, since)
    versions = version_figures(totals.rows, store.health.versions(run_id, ids, since), weight_version)
    agreement = newest_agreement(store, run_id)
    thresholds = thresholds_of(store, run_id)
    figures = judge(totals, scope, thresholds, versions, agreement, missing)
    firsts = _FirstPositions(store, run)
    limit = store.settings.health_where
    findings = []
    for check, figure in figures.items():
        if figure.level is Level.OK:
            continue
        where: tuple[Where, ...] = ()
        if check in ROW_FLAG_CHECKS or check is Check.FALLBACK:
            flag = check.flag  # FALLBACK: None, any flagged or missing row
            rows = store.health.kind_requests(run_id, flag, ids, since, limit)
            where = tuple(firsts.where(row, flag) for row in rows)
        elif check is Check.OPEN:
            where = tuple(Where(r, None, None) for r in store.health.open_requests(run_id, ids, since, limit))
        compare_id = agreement.compare_id if agreement is not None and check in (
            Check.ROUTER_MISMATCH, Check.TOKEN_MISMATCH) else None
        if check not in BATCH_ONLY or scope is Scope.BATCH:
            findings.append(Finding(figure, where, compare_id))
    return HealthReport(run_id, scope, window_s, totals, missing, figures, tuple(findings), versions, agreement,
                        thresholds)


class _FirstPositions:
    """First positions of each kind in a request's rows, read once per request (its rows' flags)."""

    def __init__(self, store: RouteStore, run: RunState) -> None:
        self.store = store
        self.run = run  # taken before the requests' rows (`RouteStore.read_rows`)
        self._read: dict[str, dict[Flag | None, int]] = {}

    def where(self, row: Row, flag: Flag | None) -> Where:
        """The finding entry of a `requests` row for `flag` (None: any flagged or missing row)."""
        record = RequestRecord.of(row)
        held = {f for f, n in record.flagged.items() if n and f is not Flag.PADDING}
        unclean = max(row["unclean"], *(n for f, n in record.flagged.items() if f not in (Flag.PADDING, Flag.GAP)))
        count = (unclean + record.flagged[Flag.GAP]) if flag is None else record.flagged[flag]
        if held == {flag} and flag is not Flag.GAP or (flag is None and held and Flag.GAP not in held):
            return Where(record.request_id, count, record.first_flagged_position)
        return Where(record.request_id, count, self._first(record).get(flag))

    def _first(self, record: RequestRecord) -> dict[Flag | None, int]:
        known = self._read.get(record.request_id)
        if known is not None:
            return known
        firsts: dict[Flag | None, int] = {}
        step = self.store.settings.max_read_rows
        for start in range(0, record.expected_rows, step):
            route = self.store.read_rows(self.run, record, start, min(start + step, record.expected_rows))
            flags = route.flags
            for f in (*ROW_FLAG_FLAGS, None):
                if f in firsts:
                    continue
                hit = np.flatnonzero(flags != 0 if f is None else (flags & f) != 0)
                if hit.size:
                    firsts[f] = start + int(hit[0])
            if len(firsts) == len(ROW_FLAG_FLAGS) + 1:
                break
        self._read[record.request_id] = firsts
        return firsts


ROW_FLAG_FLAGS = tuple(f for f in (c.flag for c in ROW_FLAG_CHECKS) if f is not None)
