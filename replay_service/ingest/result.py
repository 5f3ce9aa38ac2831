"""What one ingested batch became: its outcome and the counts the API answers with."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
    padding_slots_dropped: int = 0  # an engine route's trailing top-k slots of -1 (ingest/engine_outputs.py)

    @property
    def stored(self) -> bool:
        """True when this call stored the batch."""
        return self.outcome == IngestOutcome.STORED
