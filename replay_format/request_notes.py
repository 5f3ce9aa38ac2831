"""Request notes: what a writer tells the service about requests besides their rows (spec: request_notes.md).

Two JSON bodies, each written here once: a request's end (`Finish`: `Finish.path`, `Finish.body`) and
prefix-cache references (`Reference`: `references_path`, `references_body`). The capture sender builds
them (`capture.sender.RouteSender`; what it spills keeps the same bodies, spill.md); the service reads
them with its API models (`replay_service/api/ingest.py` `FinishBody`, `replay_service/api/models.py`
`ReferenceBatch`), which hold the API's validation and error messages under the same field names.

`Reference` is also the record of the vLLM plugin's step frames (`R` frames, step_frame.md), there in
the engine's own request ids; `FinishStatus` the status of its finish frames.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass

from replay_format.core import FormatVersion

VERSION = FormatVersion(1, 0)  # the bodies carry no version key: their API path (/v1) versions them


class FinishStatus(enum.StrEnum):
    """How a request ended (the finish body's `status`)."""

    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class Finish:
    """A request's end: its final token count T (prompt + generated; its route has T - 1 rows) and status."""

    request_id: str
    num_tokens: int
    status: FinishStatus = FinishStatus.FINISHED

    def path(self, run_id: str) -> str:
        """Where the finish call is posted."""
        return f"/v1/runs/{run_id}/requests/{self.request_id}/finish"

    def body(self) -> bytes:
        """The finish call's JSON body (request_notes.md, "Finish")."""
        return json.dumps({"num_tokens": self.num_tokens, "status": self.status.value}).encode()


@dataclass(frozen=True)
class Reference:
    """Positions `[start, end)` of `request_id` hold the rows `source_request_id` has at the same positions.

    A prefix-cache hit: the engine served those positions from KV blocks `source_request_id` computed
    (block hashes chain from position 0, so the positions are the same in both requests).
    """

    request_id: str
    start: int
    end: int
    source_request_id: str


def references_path(run_id: str) -> str:
    """Where a references call is posted."""
    return f"/v1/runs/{run_id}/references"


def references_body(references: Sequence[Reference]) -> bytes:
    """A references call's JSON body (request_notes.md, "References")."""
    return json.dumps({"references": [
        {"request_id": r.request_id, "start": r.start, "end": r.end, "source_request_id": r.source_request_id}
        for r in references
    ]}).encode()
