"""Every run's verdict over the recent window, from sums alone (no route read): what /metrics exports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from replay_service.health.gather import newest_agreement, thresholds_of
from replay_service.health.report import Scope, judge, version_figures
from replay_service.health.rules import ROW_FLAG_CHECKS, Thresholds
from replay_service.health.verdict import Level
from replay_service.store import RouteStore


@dataclass(frozen=True)
class RecentRun:
    """A run's health over the requests it wrote in the window."""

    run_id: str
    verdict: Level
    rows: int
    flagged: Mapping[str, int]  # ZERO STALE OUT_OF_RANGE DUPLICATE CONFLICT GAP
    open_requests: int
    router_mismatch: float | None  # the newest comparison's, None without one
    last_write: float | None


def recent_runs(store: RouteStore, window_s: float, now: float, judged: int | None = None) -> list[RecentRun]:
    """Every run, newest last write first, judged over the requests written in `[now - window_s, now]`.

    `judged`: how many of the newest get their own thresholds and newest comparison read (one index read each);
    the others are judged on their sums with the default limits and no comparison (their verdicts are counted,
    never exported per run). None: all.
    """
    out = []
    for i, recent in enumerate(store.health.recent(now - window_s)):
        t = recent.totals
        full = judged is None or i < judged
        agreement = newest_agreement(store, recent.run_id) if full else None
        if not full and not t.requests:  # nothing written in the window, no comparison read: ok, nothing to judge
            out.append(RecentRun(recent.run_id, Level.OK, 0, dict.fromkeys(map(str, ROW_FLAG_CHECKS), 0), 0, None,
                                 recent.last_write))
            continue
        thresholds = thresholds_of(store, recent.run_id) if full else Thresholds()
        figures = judge(t, Scope.RUN, thresholds, version_figures(t.rows, {}, None), agreement)
        verdict = max(f.level for f in figures.values())
        flagged = {str(c): figures[c].count or 0 for c in ROW_FLAG_CHECKS}
        out.append(RecentRun(recent.run_id, verdict, t.rows, flagged, t.open,
                             agreement.router_mismatch if agreement is not None else None, recent.last_write))
    return out
