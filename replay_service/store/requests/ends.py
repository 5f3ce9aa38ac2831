"""Where a request ends after a route upload: one turn of a conversation extends it, nothing shortens it.

Contract (`upload_end`): an upload of rows `start .. T-2` with `finish` ends an open (or new) request at `T`; a
finished request of `T' >= T` tokens keeps its end; one of `T' < T` is extended to `T` when the upload starts at or
before row `T' - 1`, else refused (Conflict: positions would be missing); an aborted request is never finished by an
upload. Without `finish`, rows past a finished request's end are refused. `RouteStore.finish` keeps its own,
stricter rule (another length is a Conflict).
Design: docs/design/store.md ("Where a request ends").
"""

from __future__ import annotations

from replay_service.errors import Conflict
from replay_service.store.index import RequestStatus, Row


def upload_end(request: Row | None, request_id: str, start: int, num_tokens: int,
               finish: bool) -> int | None:
    """The request's new `T` after an upload of rows `start .. num_tokens-2`, None to leave it; Conflict to refuse."""
    ended = request is not None and request["final_tokens"] is not None
    if not ended:
        return num_tokens if finish else None
    assert request is not None
    have, status = int(request["final_tokens"]), request["status"]
    if status != RequestStatus.FINISHED and (finish or num_tokens > have):
        raise Conflict(f"request {request_id!r} was {status} with {have} tokens; an upload does not extend or "
                       "finish it")
    if num_tokens <= have:
        return None
    if not finish:
        raise Conflict(f"request {request_id!r} ended at {have} tokens (rows 0..{have - 2}); this upload reaches "
                       f"position {num_tokens - 2}, which would never be served: upload it with finish=true to "
                       "extend the request by this turn")
    if start > have - 1:
        raise Conflict(
            f"request {request_id!r} ended at {have} tokens (rows 0..{have - 2}); its next turn starts at row "
            f"{have - 1} (vLLM routed_experts_prompt_start / SGLang routed_experts_start_len = the previous "
            f"length - 1), but this upload starts at {start}, which would leave positions {have - 1}..{start - 1} "
            "missing")
    return num_tokens
