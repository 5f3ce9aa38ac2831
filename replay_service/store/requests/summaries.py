"""Index rows as the records the API answers with (`api/models.py`: RunSummary, RequestSummary).

Fields and their meaning are the API's; the models there document them. A run's and a request's summary
are typed records (`RunRecord`, `RequestRecord`) that domain code reads by attribute; their JSON objects
are made at the API edge (`to_json`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replay_format import Flag, RunShape
from replay_format.weight_versions import VersionSpan
from replay_service.store.index import COUNTED_FLAGS, RequestStatus, Row, count_column
from replay_service.store.lifecycle.retention import last_write
from replay_service.store.runs import shape_of

_COUNTED = tuple((f, count_column(f)) for f in COUNTED_FLAGS)  # each counted flag and its column


def expected_rows(request: Row) -> int:
    """A finished request of T tokens has T-1 rows; an open one, up to the last position seen."""
    if request["final_tokens"] is not None:
        return max(request["final_tokens"] - 1, 0)
    return request["pos_max"] + 1


@dataclass(frozen=True)
class RequestRecord:
    """One request's summary: its status, rows and rows per flag (api.models.RequestSummary documents each field)."""

    request_id: str
    status: RequestStatus
    num_tokens: int | None  # T, once ended
    rows: int  # rows served, referenced ones included
    referenced_rows: int
    expected_rows: int
    first_flagged_position: int | None
    flagged: Mapping[Flag, int]  # rows per counted flag, and GAP: rows expected but never received
    # the versions of the rows served by the default rule, as spans over positions (unknown ones in none); None: not
    # looked up (the record a read takes, `RouteStore.request_to_read`)
    weight_versions: tuple[VersionSpan, ...] | None = None
    recomputed: int = 0  # positions computed again under other weights (not CONFLICT), each counted once
    first_recomputed: int | None = None  # the first of them

    @classmethod
    def of(cls, request: Row, version_spans: Sequence[tuple[str, int, int]] | None = None) -> RequestRecord:
        """The record of one `requests` row and its `Index.version_spans` (adjacent ones of one version merged; None:
        not looked up)."""
        expected = expected_rows(request)
        flagged = {f: request[column] for f, column in _COUNTED}
        flagged[Flag.GAP] = max(expected - request["rows"], 0)
        return cls(request["request_id"], RequestStatus(request["status"]), request["final_tokens"], request["rows"],
                   request["referenced_rows"], expected, request["first_flagged"], flagged,
                   None if version_spans is None else merged_spans(version_spans), request["recomputed"],
                   request["first_recomputed"])

    @property
    def clean(self) -> bool:
        """No row flagged (PADDING aside) and none missing."""
        return not any(n for f, n in self.flagged.items() if f is not Flag.PADDING)

    def to_json(self) -> dict[str, Any]:
        """The RequestSummary object the API answers with (of a record whose version spans were looked up)."""
        if self.weight_versions is None:
            raise ValueError(f"request {self.request_id!r}: a record made for a read has no weight-version spans")
        return {
            "request_id": self.request_id,
            "status": self.status.value,
            "num_tokens": self.num_tokens,
            "rows": self.rows,
            "referenced_rows": self.referenced_rows,
            "expected_rows": self.expected_rows,
            "first_flagged_position": self.first_flagged_position,
            "flagged": {str(f.name): n for f, n in self.flagged.items()},
            "clean": self.clean,
            "weight_versions": [s.to_json() for s in self.weight_versions],
            "recomputed": self.recomputed,
            "first_recomputed": self.first_recomputed,
        }


def merged_spans(spans: Sequence[tuple[str, int, int]]) -> tuple[VersionSpan, ...]:
    """`(version, start, end)` spans by start as `VersionSpan`s, a span that continues the one before under the same
    version merged into it (each commit records its own)."""
    out: list[VersionSpan] = []
    for version, start, end in sorted(spans, key=lambda s: s[1]):
        if out and out[-1].version == version and out[-1].end == start:
            out[-1] = VersionSpan(version, out[-1].start, end)
        else:
            out.append(VersionSpan(version, start, end))
    return tuple(out)


@dataclass(frozen=True)
class RequestPage:
    """One page of a run's request summaries, by request id, and the cursor of the next (None on the last)."""

    items: list[RequestRecord]
    next_cursor: str | None

    def to_json(self) -> dict[str, Any]:
        """The RequestPage object the API answers with."""
        return {"items": [r.to_json() for r in self.items], "next_cursor": self.next_cursor}


def bytes_per_id(segment_bytes: int, stored_rows: int, row_width: int) -> float | None:
    """Segment bytes on disk per stored id (every column and the file framing counted); None before any row."""
    return segment_bytes / (stored_rows * row_width) if stored_rows > 0 else None


@dataclass(frozen=True)
class RunRecord:
    """One run's summary: its shape, counts and retention state (api.models.RunSummary documents each field)."""

    run_id: str
    shape: RunShape
    source: str | None
    created_at: float
    requests: int
    requests_ended: int
    rows: int  # rows served, referenced ones included
    referenced_rows: int
    references: int
    bytes: int  # of segment files
    flagged: Mapping[Flag, int]  # rows per counted flag, and GAP
    per_version: Mapping[str, int]  # rows served per known weight version (`Index.run_versions`)
    recomputed: int
    pinned: bool
    last_write: float  # its last stored batch, or its creation (retention's age)

    @classmethod
    def of(cls, run: Row, totals: Row, references: int, per_version: Mapping[str, int]) -> RunRecord:
        """The record of a `runs` row, the sums over its requests (`Index.run_aggregate`), its reference count and
        its rows per weight version (`Index.run_versions`)."""
        flagged = {f: totals[count_column(f)] for f in COUNTED_FLAGS}
        flagged[Flag.GAP] = totals["gap"]
        return cls(run["run_id"], shape_of(run), run["source"], run["created_at"], totals["requests"],
                   totals["ended"], totals["rows"], totals["referenced_rows"], references, run["bytes"], flagged,
                   dict(per_version), totals["recomputed"], bool(run["pinned"]), last_write(run))

    @property
    def bytes_per_id(self) -> float | None:
        """Segment bytes per stored id (rows stored by this run, not through references); None before any row."""
        return bytes_per_id(self.bytes, self.rows - self.referenced_rows, self.shape.row_width)

    def _version_rows(self) -> list[dict[str, Any]]:
        """Rows per weight version, by version, then those of no known version under `null` (where there are any:
        rows stored before versions existed, or by a writer that sends none)."""
        out: list[dict[str, Any]] = [{"version": v, "rows": n} for v, n in sorted(self.per_version.items())]
        unknown = self.rows - sum(self.per_version.values())
        if unknown > 0:
            out.append({"version": None, "rows": unknown})
        return out

    def to_json(self) -> dict[str, Any]:
        """The RunSummary object the API answers with."""
        shape = self.shape
        return {
            "run_id": self.run_id,
            "num_moe_layers": shape.num_moe_layers,
            "top_k": shape.top_k,
            "num_experts": shape.num_experts,
            "moe_layers": list(shape.moe_layers),
            "num_hidden_layers": shape.num_hidden_layers,
            "dtype": str(shape.dtype),
            "source": self.source,
            "created_at": self.created_at,
            "requests": self.requests,
            "requests_ended": self.requests_ended,
            "rows": self.rows,
            "referenced_rows": self.referenced_rows,
            "references": self.references,
            "bytes": self.bytes,
            "bytes_per_id": self.bytes_per_id,
            "flagged": {str(f.name): n for f, n in self.flagged.items()},
            "weight_versions": self._version_rows(),
            "recomputed": self.recomputed,
            "pinned": self.pinned,
            "last_write": self.last_write,
        }
