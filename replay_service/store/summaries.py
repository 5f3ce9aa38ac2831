"""Index rows as the plain records the API answers with (`api/models.py`: RunSummary, RequestSummary).

Fields and their meaning are the API's; the models there document them.
"""

from __future__ import annotations

from replay_format import Flag
from replay_service.store.index import COUNTED_FLAGS, Row, count_column
from replay_service.store.runs import shape_of


def expected_rows(request: Row) -> int:
    """A finished request of T tokens has T-1 rows; an open one, up to the last position seen."""
    if request["final_tokens"] is not None:
        return max(request["final_tokens"] - 1, 0)
    return request["pos_max"] + 1


def request_summary(request: Row) -> dict:
    """One `requests` row as a RequestSummary record."""
    expected = expected_rows(request)
    flagged = {str(f.name): request[count_column(f)] for f in COUNTED_FLAGS}
    flagged[str(Flag.GAP.name)] = max(expected - request["rows"], 0)
    return {
        "request_id": request["request_id"],
        "status": request["status"],
        "num_tokens": request["final_tokens"],
        "rows": request["rows"],
        "referenced_rows": request["referenced_rows"],
        "expected_rows": expected,
        "first_flagged_position": request["first_flagged"],
        "flagged": flagged,
        "clean": not any(v for k, v in flagged.items() if k != Flag.PADDING.name),
    }


def bytes_per_id(segment_bytes: int, stored_rows: int, row_width: int) -> float | None:
    """Segment bytes on disk per stored id (every column and the file framing counted); None before any row."""
    return segment_bytes / (stored_rows * row_width) if stored_rows > 0 else None


def run_summary(run: Row, totals: Row, references: int) -> dict:
    """A `runs` row, the sums over its requests (`Index.run_aggregate`) and its reference count as a RunSummary."""
    shape = shape_of(run)
    flagged = {str(f.name): totals[count_column(f)] for f in COUNTED_FLAGS}
    flagged[str(Flag.GAP.name)] = totals["gap"]
    return {
        "run_id": run["run_id"],
        "num_moe_layers": run["num_moe_layers"],
        "top_k": run["top_k"],
        "num_experts": run["num_experts"],
        "moe_layers": list(shape.moe_layers),
        "num_hidden_layers": shape.num_hidden_layers,
        "dtype": str(shape.dtype),
        "source": run["source"],
        "created_at": run["created_at"],
        "requests": totals["requests"],
        "requests_ended": totals["ended"],
        "rows": totals["rows"],
        "referenced_rows": totals["referenced_rows"],
        "references": references,
        "bytes": run["bytes"],
        "bytes_per_id": bytes_per_id(run["bytes"], totals["rows"] - totals["referenced_rows"], shape.row_width),
        "flagged": flagged,
    }
