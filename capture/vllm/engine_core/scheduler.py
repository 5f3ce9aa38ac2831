"""Runs in vLLM's engine-core process: tell workers how each finished request ended and how long it was.

Workers only see `SchedulerOutput.finished_req_ids` (finished *or* aborted, no length).
In the engine-core process the plugin wraps `Scheduler._free_request` to note
`(status, num_tokens)` of each freed request and `Scheduler.schedule` to attach the
notes to the next `SchedulerOutput` as `routing_replay_finished` (it is pickled to the
workers with its instance dict; the status travels as its plain string value, a
`FinishStatus` value). A worker without the notes falls back to "finished" and its own
length count.
"""

from __future__ import annotations

from capture.vllm.patching import is_patched, patch
from replay_format.step_frame import FinishStatus

ATTR = "routing_replay_finished"


def finish_status(status) -> FinishStatus:
    """vLLM's `RequestStatus` (any FINISHED_ABORTED... is an abort) as a FinishStatus."""
    return FinishStatus.ABORTED if "ABORTED" in str(getattr(status, "name", status)) else FinishStatus.FINISHED


def patch_scheduler() -> None:
    """Wrap `Scheduler._free_request` and `Scheduler.schedule` (idempotent)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if is_patched(Scheduler.schedule):
        return
    orig_free, orig_schedule = Scheduler._free_request, Scheduler.schedule

    def _free_request(self, request, *a, **kw):
        notes = self.__dict__.setdefault("_routing_replay_notes", {})
        try:
            notes[request.request_id] = (finish_status(request.status).value, int(request.num_tokens))
        except Exception:  # any error: never break the scheduler
            pass
        return orig_free(self, request, *a, **kw)

    def schedule(self, *a, **kw):
        out = orig_schedule(self, *a, **kw)
        notes = self.__dict__.get("_routing_replay_notes")
        if notes:
            try:
                setattr(out, ATTR, dict(notes))
                notes.clear()
            except Exception:  # any error: as above
                pass
        return out

    patch(Scheduler, "_free_request", _free_request)
    patch(Scheduler, "schedule", schedule)
