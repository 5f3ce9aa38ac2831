"""Engine-core side: tell workers how each finished request ended and how long it was.

Workers only see `SchedulerOutput.finished_req_ids` (finished *or* aborted, no length).
In the engine-core process the plugin wraps `Scheduler._free_request` to note
`(status, num_tokens)` of each freed request and `Scheduler.schedule` to attach the
notes to the next `SchedulerOutput` as `routing_replay_finished` (it is pickled to the
workers with its instance dict). A worker without the notes falls back to "finished"
and its own length count.
"""

from __future__ import annotations

ATTR = "routing_replay_finished"


def status_name(status) -> str:
    return "aborted" if "ABORTED" in str(getattr(status, "name", status)) else "finished"


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_routing_replay", False):
        return
    orig_free, orig_schedule = Scheduler._free_request, Scheduler.schedule

    def _free_request(self, request, *a, **kw):
        notes = self.__dict__.setdefault("_routing_replay_notes", {})
        try:
            notes[request.request_id] = (status_name(request.status), int(request.num_tokens))
        except Exception:  # noqa: BLE001 - never break the scheduler
            pass
        return orig_free(self, request, *a, **kw)

    def schedule(self, *a, **kw):
        out = orig_schedule(self, *a, **kw)
        notes = self.__dict__.get("_routing_replay_notes")
        if notes:
            try:
                setattr(out, ATTR, dict(notes))
                notes.clear()
            except Exception:  # noqa: BLE001
                pass
        return out

    schedule._routing_replay = True  # type: ignore[attr-defined]
    Scheduler._free_request = _free_request
    Scheduler.schedule = schedule
