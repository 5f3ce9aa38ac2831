"""Prometheus metrics, one registry per app (several apps can live in one process).

Under `serve`'s workers (ops/workers.py) every worker counts in its own files under `PROMETHEUS_MULTIPROC_DIR`
(prometheus-client's multiprocess mode, chosen when the variable is set before the library is imported, as the
workers' parent does), and a scrape of any worker answers for the whole service: the counters and histograms summed
over every worker that ever ran since the service started (a worker killed and replaced keeps its counts), and the
collectors read at scrape time (run health, from the shared index) once.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own variable


@dataclass
class ServiceMetrics:
    """The service's counters and histograms (names below; `_total` is added to counters on export)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    scraped: list[Collector] = field(default_factory=list)  # read at scrape time, from what every worker shares

    def __post_init__(self) -> None:
        r = self.registry
        self.rows_ingested = Counter("replay_rows_ingested", "Rows stored by ingest and route uploads", registry=r)
        self.rows_flagged = Counter("replay_rows_flagged", "Stored rows carrying a flag, by flag", ["flag"], registry=r)
        self.padding_dropped = Counter("replay_padding_rows_dropped", "Writer padding rows dropped at ingest",
                                       registry=r)
        self.bytes_stored = Counter("replay_bytes_stored", "Bytes of segment files written", registry=r)
        self.batches = Counter("replay_ingest_batches", "Ingest batches by outcome", ["outcome"], registry=r)
        self.latency = Histogram(
            "replay_http_request_seconds",
            "HTTP request latency by route template, method and status",
            ["route", "method", "status"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.segments_damaged = Counter(
            "replay_segments_damaged", "Segments found failing their checksum (or unreadable), once per process",
            registry=r)
        self.damaged_reads = Counter(
            "replay_damaged_reads", "Requests refused because a segment they needed is damaged", registry=r)
        self.stale_feed_rows = Counter(
            "replay_stale_feed_rows",
            "Rows the STALE table's feed moved between replicas: published, learnt (from others) or dropped",
            ["direction"], registry=r)
        self.route_reads = Counter(
            "replay_route_reads",
            "Route GETs by where they were read (settings.ReadPlace): event_loop (placement/on_loop.py) or thread",
            ["place"], registry=r)

    def count_damaged(self, newly_found: bool) -> None:
        """One request refused for a damaged segment; the segment itself too when this is its first refusal."""
        self.damaged_reads.inc()
        if newly_found:
            self.segments_damaged.inc()

    def add_scraped(self, collector: Collector) -> None:
        """Register a collector that reads shared state at scrape time (once per scrape, whichever worker answers)."""
        self.registry.register(collector)
        self.scraped.append(collector)

    def exposition(self) -> bytes:
        """The text exposition format: this process's metrics, or under workers every worker's (module docstring)."""
        path = os.environ.get(MULTIPROCESS_DIR)
        if not path:
            return generate_latest(self.registry)
        everyone = CollectorRegistry()
        MultiProcessCollector(everyone, path)
        for collector in self.scraped:
            everyone.register(collector)
        return generate_latest(everyone)


class StoreCollector:
    """Read at every scrape: the disk of the data directory (`replay_data_disk_bytes{kind="used"|"free"}`), the bytes
    of the segments the index holds (`replay_stored_bytes`), and the seconds since the answering process's STALE feed
    last finished a round (`replay_stale_feed_lag_seconds`; only with a feed: replicas on a PostgreSQL index).

    `stored()` and `feed_round_at()` answer at scrape time (None: not known yet, the family left out)."""

    def __init__(self, data_dir: Path, stored: Callable[[], int | None], feed_round_at: Callable[[], float | None],
                 clock: Callable[[], float] = time.time) -> None:
        self._data_dir = Path(data_dir)
        self._stored = stored
        self._feed_round_at = feed_round_at
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        """The families' names, without reading anything."""
        return self._families()[:2]

    def collect(self) -> Iterable[Metric]:
        """Every family, read now."""
        disk, stored, lag = self._families()
        try:
            usage = shutil.disk_usage(self._data_dir)
            disk.add_metric(["used"], usage.used)
            disk.add_metric(["free"], usage.free)
        except OSError:
            pass  # not made yet: the family without samples
        out = [disk]
        total = self._stored()
        if total is not None:
            stored.add_metric([], total)
            out.append(stored)
        at = self._feed_round_at()
        if at is not None:
            lag.add_metric([], max(0.0, self._clock() - at))
            out.append(lag)
        return out

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("replay_data_disk_bytes", "Bytes used and free on the data directory's disk",
                                  labels=["kind"]),
                GaugeMetricFamily("replay_stored_bytes", "Bytes of the segment files the index holds"),
                GaugeMetricFamily("replay_stale_feed_lag_seconds",
                                  "Seconds since this process's STALE feed last finished a round (publish and learn)"))

