"""Writers: prefix-cache references (a request's positions served by rows another request stored).

Thin: validates the body (`models.ReferenceBatch`), hands it to the store (`store/requests/references.py` resolves
each reference now or when its source's rows arrive) and answers counts.
"""

from __future__ import annotations

from fastapi import APIRouter

from replay_format.request_notes import Reference
from replay_service.api.deps import RunId, Settings, Store
from replay_service.api.models import ERRORS, ReferenceBatch, ReferencesAnswer
from replay_service.errors import InvalidInput

router = APIRouter(prefix="/v1", tags=["ingest"], responses=ERRORS)


@router.post("/runs/{run}/references", response_model=ReferencesAnswer,
             summary="Prefix-cache references: positions [start, end) of a request are the rows another request "
                     "stored there (stored once; resolved now or when those rows arrive)")
def add_references(run: RunId, body: ReferenceBatch, store: Store, settings: Settings) -> ReferencesAnswer:
    """Idempotent on (run, request, start, end, source); 404 for a run no batch created yet."""
    for i, ref in enumerate(body.references):
        if ref.end - ref.start > settings.max_read_rows:
            raise InvalidInput(
                f"references[{i}]: range {ref.start}..{ref.end} is {ref.end - ref.start} positions, more than one "
                f"read returns (REPLAY_MAX_READ_ROWS={settings.max_read_rows}); no prompt is that long")
    refs = [Reference(r.request_id, r.start, r.end, r.source_request_id) for r in body.references]
    done = store.add_references(run, refs)
    return ReferencesAnswer(received=len(refs), new=done.new, rows_resolved=done.rows_resolved)
