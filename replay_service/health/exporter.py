"""Per-run health on `/metrics`: a Prometheus collector that reads the index when it is scraped.

`RunHealthCollector` keeps nothing: each scrape asks the index (`recent_runs`) for every run's health over the last
REPLAY_HEALTH_WINDOW_S seconds, so any replica answers for the whole service. Per-run families (`SERIES_PER_RUN` at
most each) only for the REPLAY_METRICS_MAX_RUNS runs written most recently; every run is counted in
`replay_runs{verdict}`, and `replay_runs_not_exported` says how many were left out. A failed read never fails the
scrape: `replay_health_scrape_errors_total` goes up and the per-run families are left out.

Design: docs/design/service_data.md; the families: deploy/prometheus/README.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from replay_service.health.recent import RecentRun, recent_runs
from replay_service.health.verdict import Level
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore

log = logging.getLogger("replay_service")

# The flag kinds a run's recent rows are counted by (label `flag`), in this order; the alert rules name them.
EXPORTED_FLAGS = ("ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "CONFLICT", "GAP")
# Series one exported run can add: verdict, rows, one per flag, open requests, router mismatch.
SERIES_PER_RUN = 4 + len(EXPORTED_FLAGS)


class RecentRuns(Protocol):
    """The index read: every run's health over `[now - window_s, now]`, newest write first (`recent_runs`)."""

    def __call__(self, store: RouteStore, window_s: float, now: float,
                 judged: int | None = None) -> Sequence[RecentRun]: ...


class RunHealthCollector:
    """The run-health families, computed at every scrape from the store `store()` answers.

    Register it once on the app's registry: `registry.register(RunHealthCollector(lambda: app.state.store,
    settings))`. `read` and `clock` are the index read and the time it is judged at (tests give others).
    """

    def __init__(self, store: Callable[[], RouteStore], settings: ServiceSettings, read: RecentRuns = recent_runs,
                 clock: Callable[[], float] = time.time) -> None:
        """`store`: answers the open store at scrape time (the app opens it in its lifespan, after registration)."""
        self._store = store
        self._max_runs = max(0, int(settings.metrics_max_runs))
        self._window_s = float(settings.health_window_s)
        self._read = read
        self._clock = clock
        self._errors = 0
        self._lock = threading.Lock()  # scrapes run on the server's thread pool: two may count an error at once

    def describe(self) -> Iterable[Metric]:
        """The families without samples: the registry learns their names (a clash with another collector is an
        error at registration) without reading the index."""
        return [self._error_family(), *self._run_families([])]

    def collect(self) -> Iterable[Metric]:
        """Every family, read now; on a failed read only `replay_health_scrape_errors_total` (one more)."""
        try:
            # only the exported runs need their own thresholds and newest comparison read (`judged`): the others
            # are counted by verdict on their sums and the default limits, one grouped index read for all of them
            runs = self._read(self._store(), self._window_s, self._clock(), judged=self._max_runs)
            # newest write first (the read's order already; a stable sort keeps it, ties as they came)
            ordered = sorted(runs, key=lambda r: -r.last_write if r.last_write is not None else math.inf)
            families = self._run_families(ordered)  # built here, whole: a bad record fails this read, not the scrape
        except Exception:  # the index unreachable, a bug in the read: logged, counted, never a failed scrape
            log.exception("run health for /metrics could not be read")
            with self._lock:
                self._errors += 1
            return [self._error_family()]
        return [self._error_family(), *families]

    def _error_family(self) -> Metric:
        """`replay_health_scrape_errors_total`: failed reads so far (0 exported from the start, so `increase` works)."""
        errors = CounterMetricFamily("replay_health_scrape_errors",
                                     "Run-health reads of the index that failed during a /metrics scrape")
        with self._lock:
            errors.add_metric([], self._errors)
        return errors

    def _run_families(self, runs: Sequence[RecentRun]) -> list[Metric]:
        """The run families for `runs` (newest first), the first `max_runs` of them with per-run series."""
        exported = runs[: self._max_runs]
        verdict = GaugeMetricFamily("replay_run_verdict", "Run health verdict over the window: 0 ok, 1 warn, 2 fail "
                                    "(GET /v1/runs/{run}/health names what failed)", labels=["run"])
        rows = GaugeMetricFamily("replay_run_recent_rows", "Rows of the run's requests written in the health window",
                                 labels=["run"])
        flagged = GaugeMetricFamily("replay_run_recent_flagged_rows",
                                    "Of those rows, rows carrying a flag (GAP: rows expected, never received)",
                                    labels=["run", "flag"])
        open_requests = GaugeMetricFamily("replay_run_open_requests", "Requests of the run written in the window "
                                          "and not ended", labels=["run"])
        mismatch = GaugeMetricFamily("replay_run_router_mismatch", "Router-level mismatch of the run's newest "
                                     "comparison (absent without one)", labels=["run"])
        for run in exported:
            labels = [run.run_id]
            verdict.add_metric(labels, int(run.verdict))
            rows.add_metric(labels, run.rows)
            for flag in EXPORTED_FLAGS:
                flagged.add_metric([run.run_id, flag], run.flagged.get(flag, 0))
            open_requests.add_metric(labels, run.open_requests)
            if run.router_mismatch is not None:
                mismatch.add_metric(labels, run.router_mismatch)
        by_verdict = GaugeMetricFamily("replay_runs", "Runs by health verdict over the window (every run, exported "
                                       "or not)", labels=["verdict"])
        counts = dict.fromkeys(Level, 0)
        for run in runs:
            counts[Level(run.verdict)] += 1
        for level, count in counts.items():
            by_verdict.add_metric([level.label], count)
        left_out = GaugeMetricFamily("replay_runs_not_exported", "Runs without per-run series: beyond "
                                     "REPLAY_METRICS_MAX_RUNS, the most recently written kept")
        left_out.add_metric([], len(runs) - len(exported))
        return [verdict, rows, flagged, open_requests, mismatch, by_verdict, left_out]
