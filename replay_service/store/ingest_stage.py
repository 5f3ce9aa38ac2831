"""The ingest pipeline as the store sees it: what `RouteStore.ingest` hands a batch to, and the answer it gets back.

The store does not build the pipeline (`replay_service.ingest` builds on the store's index, reads and files, so
it stands above it): whoever opens a store gives it one (`replay_service.app.open_store`, the one composition
function the app and the command-line tools share). This module is the contract between the two floors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from replay_format.rows import Rows


class IngestOutcome(enum.StrEnum):
    """What became of one ingested batch (also the `replay_ingest_batches_total` label)."""

    STORED = "stored"
    DUPLICATE = "duplicate"  # this (run, writer, seq) was stored before: nothing written
    REJECTED = "rejected"  # refused with a domain or format error: nothing written


@dataclass
class IngestResult:
    """The answer to one ingested batch."""

    outcome: IngestOutcome
    rows: int  # rows in the batch, padding dropped
    padding_dropped: int = 0
    flagged: dict[str, int] = field(default_factory=dict)  # flag name -> rows of this batch, where not 0
    bytes: int = 0  # segment size
    recomputed: int = 0  # positions this batch newly recomputed under other weights (checks/check.py), not flagged

    @property
    def stored(self) -> bool:
        """True when this call stored the batch."""
        return self.outcome == IngestOutcome.STORED


class BatchIngest(Protocol):
    """An ingest pipeline: one decoded batch through check -> segment -> commit (`ingest.pipeline.IngestPipeline`)."""

    def ingest(self, rows: Rows) -> IngestResult:
        """Store one decoded batch; idempotent on (run_id, writer_id, seq)."""
        ...

    def close(self) -> None:
        """Stop what the pipeline runs beside ingests (the STALE feed's thread)."""
        ...
