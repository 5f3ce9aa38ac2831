"""Where a request ends after a route upload: one turn of a conversation extends it, nothing shortens it.

An upload holds rows `start .. T-2` of a request and implies its length `T` (the last row's position + 2).
Engines return a later turn's rows from an offset (vLLM `SamplingParams.routed_experts_prompt_start`,
SGLang `routed_experts_start_len`, "response covers [start, seqlen - 1)"); miles' session server asks
each turn for the rows after the previous turn's `T - 1` (`miles/rollout/session/core.py`,
`_maybe_request_addition_r3`: `routed_experts_start_len = len(checkpoint_token_ids) - 1`). So turn 2
of a request that ended at `T1` tokens starts at row `T1 - 1`, and its upload moves the end to `T2`.

The rule (`upload_end`), for an upload that would finish the request (`finish=true`):
- an open request (or a new one) ends at `T`;
- a finished request of `T' >= T` tokens keeps its end (an earlier turn again, or a retry after a
  later turn landed); its rows still meet the resend / CONFLICT rule where they overlap;
- a finished request of `T' < T` tokens is extended to `T` when the upload starts at or before row
  `T' - 1`, and refused (Conflict) when it starts later: positions `T' - 1 .. start - 1` would be
  missing, which is what an off-by-one `start` looks like;
- an aborted request is not finished by an upload (Conflict, as a finish call says).
Without `finish`, rows past a finished request's end are refused: they would never be served.
The finish call (`RouteStore.finish`) keeps its own, stricter rule: another length is a Conflict.
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
