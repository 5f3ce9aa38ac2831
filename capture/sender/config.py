"""The sender's settings (`SenderConfig`) and counters (`SenderStats`): no network, no torch.

The vLLM worker builds the settings and sends them to its sink process (`to_dict`, inside the
step-frame configuration); the sink rebuilds and checks them (`from_dict`) and runs the sender.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from replay_format import FormatError, RunShape, Source, check_id

# SenderConfig fields another process may set through `from_dict`, with their JSON types.
_TEXT_FIELDS = ("url", "run_id", "writer_id", "source", "spill_dir")
_INT_FIELDS = ("batch_rows", "max_queue_bytes", "max_spill_bytes")
_SECONDS_FIELDS = ("flush_interval_s", "request_timeout_s", "backoff_initial_s", "backoff_max_s", "summary_interval_s")


@dataclass
class SenderConfig:
    """Where rows go and how they are batched, queued, spilled and retried (checked at construction)."""

    url: str
    run_id: str
    shape: RunShape
    writer_id: str = field(default_factory=lambda: f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    source: Source = Source.VLLM_PLUGIN
    token: str | None = None
    spill_dir: Path = Path("replay-spill")
    batch_rows: int = 16384  # rows per ingest batch (several steps are coalesced)
    flush_interval_s: float = 0.5  # a partial batch goes out after this long
    max_queue_bytes: int = 256 * 2**20  # encoded batches held in memory
    max_spill_bytes: int = 16 * 2**30  # beyond this, batches are dropped (loudly)
    request_timeout_s: float = 30.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    summary_interval_s: float = 60.0  # at most one counters line this often (and one at close)

    def __post_init__(self) -> None:
        self.source = Source(self.source)
        self.spill_dir = Path(self.spill_dir)
        check_id("run_id", self.run_id)
        check_id("writer_id", self.writer_id)
        if not self.url:
            raise FormatError("sender: url is empty")
        low = [name for name in _INT_FIELDS + _SECONDS_FIELDS if not getattr(self, name) > 0]
        if low:
            raise FormatError(f"sender: {', '.join(low)} must be > 0")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON object for another process; the shape and the token travel apart."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _TEXT_FIELDS + _INT_FIELDS + _SECONDS_FIELDS}
        out["source"], out["spill_dir"] = self.source.value, str(self.spill_dir)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], shape: RunShape, token: str | None = None) -> SenderConfig:
        """The config `to_dict` wrote; FormatError naming an unknown key or a value of the wrong type."""
        unknown = sorted(set(data) - set(_TEXT_FIELDS + _INT_FIELDS + _SECONDS_FIELDS))
        if unknown:
            raise FormatError(f"sender settings: unknown keys {unknown}")
        for name, value in data.items():
            ok = (isinstance(value, str) if name in _TEXT_FIELDS
                  else type(value) is int if name in _INT_FIELDS
                  else type(value) in (int, float))
            if not ok:
                raise FormatError(f"sender settings: {name}={value!r} has the wrong type")
        return cls(shape=shape, token=token, **data)


@dataclass
class SenderStats:
    """What the sender did so far (logged as one summary line; `bench/capture.py` prints them)."""

    submitted_rows: int = 0
    sent_batches: int = 0
    sent_rows: int = 0
    sent_finishes: int = 0
    sent_references: int = 0  # references calls
    retried: int = 0
    spilled_batches: int = 0
    drained_batches: int = 0
    dropped_batches: int = 0
    dropped_rows: int = 0
    refused: int = 0  # the service answered 4xx: the batch is bad, retrying cannot help

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> str:
        """The counters as one log line."""
        return (f"sent {self.sent_batches} batches ({self.sent_rows} rows), {self.sent_finishes} finishes and "
                f"{self.sent_references} reference calls; "
                f"retried {self.retried}, spilled {self.spilled_batches}, drained {self.drained_batches}, "
                f"dropped {self.dropped_batches} batches ({self.dropped_rows} rows), refused {self.refused}")
