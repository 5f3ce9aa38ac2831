"""Prometheus metrics, one registry per app (several apps can live in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram


@dataclass
class ServiceMetrics:
    """The service's counters and histograms (names below; `_total` is added to counters on export)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

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

    def count_damaged(self, newly_found: bool) -> None:
        """One request refused for a damaged segment; the segment itself too when this is its first refusal."""
        self.damaged_reads.inc()
        if newly_found:
            self.segments_damaged.inc()
