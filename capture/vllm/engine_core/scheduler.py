"""Runs in vLLM's engine-core process: tell workers how each finished request ended and how long it was.

`patch_scheduler` wraps `Scheduler._free_request` (note the request's `Ended`: status and length, `remote_decode` for
a prefill-only request of P/D disaggregation) and `Scheduler.schedule` (attach the notes, the step's prefix-cache hits
and the weight version to the next `SchedulerOutput` as its `SchedulerNotes`; with vLLM's own R3 on, hits go to the
tee). Notes not yet delivered are also kept in this engine core's `FinishJournal` until `update_from_output` of the
step that carried them; `shutdown` removes an empty journal. A worker without a request's note falls back to
"finished" and its own length count. An in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) runs the one
step more that a spawned one's busy loop runs to clear finished requests (`patch_inproc_client`), so the last
requests of a `generate` reach the workers' sinks without waiting for the next.

Design: docs/design/vllm_engine_core.md.
"""

from __future__ import annotations

from capture.vllm.config import PdRole, PluginConfig
from capture.vllm.engine_core import prefix_hits, weight_version
from capture.vllm.engine_core.request_end import finish_status
from capture.vllm.engine_core.routed_experts_tee import tee_of
from capture.vllm.finish_notes import FinishJournal
from capture.vllm.kv_connectors import is_prefill_only
from capture.vllm.patching import is_patched, patch
from capture.vllm.scheduler_notes import SchedulerNotes, attach, notes_of
from replay_format.request_notes import FinishStatus
from replay_format.step_frame import Ended

_JOURNAL = "_routing_replay_journal"  # on the Scheduler instance: its FinishJournal (None: no spill root)
_FREED = "_routing_replay_freed"  # on the Scheduler instance: request id -> Ended, freed since the last schedule()


def _journal(scheduler, spill_root) -> FinishJournal | None:
    """This scheduler's journal, made on first use (no file for an engine that never frees a request)."""
    journal = scheduler.__dict__.get(_JOURNAL)
    if journal is None and spill_root is not None:
        journal = scheduler.__dict__[_JOURNAL] = FinishJournal(spill_root)
    return journal


def patch_scheduler() -> None:
    """Wrap `Scheduler._free_request`, `schedule`, `update_from_output` and `shutdown`, and
    `EngineCore.set_weight_version` (`weight_version.py`) (idempotent)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if is_patched(Scheduler.schedule):
        return
    patch_inproc_client()
    prefix_hits.patch_kv_cache()
    weight_version.patch_set_weight_version()
    orig_free, orig_schedule = Scheduler._free_request, Scheduler.schedule
    orig_update, orig_shutdown = Scheduler.update_from_output, Scheduler.shutdown
    config = PluginConfig.from_env()
    spill_root = config.spill_dir if config is not None else None
    pd_role = config.pd_role if config is not None else PdRole.AUTO

    def _free_request(self, request, *a, **kw):
        freed = self.__dict__.setdefault(_FREED, {})
        try:
            status, num_tokens = finish_status(request.status), int(request.num_tokens)
            kv_config = getattr(getattr(self, "vllm_config", None), "kv_transfer_config", None)
            remote = status is FinishStatus.FINISHED and is_prefill_only(request, kv_config, pd_role)
            freed[request.request_id] = Ended(request.request_id, num_tokens, status, remote_decode=remote)
            journal = _journal(self, spill_root)
            if journal is not None and not remote:  # a prefill-only request gets no finish from this engine
                journal.add(request.request_id, status.value, num_tokens)
            prefix_hits.forget(self, request.request_id)
        except Exception:  # any error: never break the scheduler
            pass
        return orig_free(self, request, *a, **kw)

    def update_from_output(self, scheduler_output, *a, **kw):
        out = orig_update(self, scheduler_output, *a, **kw)
        # The workers have executed this step: the notes it carried reached them.
        carried = notes_of(scheduler_output)
        journal = self.__dict__.get(_JOURNAL)
        if carried is not None and carried.finished and journal is not None:
            journal.delivered(carried.finished)
        return out

    def shutdown(self, *a, **kw):
        journal = self.__dict__.get(_JOURNAL)
        if journal is not None:
            journal.close()
        return orig_shutdown(self, *a, **kw)

    def schedule(self, *a, **kw):
        out = orig_schedule(self, *a, **kw)
        try:
            hits = prefix_hits.take_scheduled(self, out)
        except Exception:  # any error: never break the scheduler (those hits then read GAP)
            hits = []
        freed = self.__dict__.get(_FREED)
        version = weight_version.announce(self)  # None unless the first step or a new version
        tee = tee_of(getattr(self, "aux_output_connector", None))
        if hits and tee is not None:  # vLLM's own R3: the hits go as references, not as the rows vLLM reads back
            try:
                tee.references(hits)
            except Exception:  # any error: as above (the tee then sends vLLM's rows for them)
                pass
        if hits or freed or version is not None:
            try:
                attach(out, SchedulerNotes(dict(freed or {}), hits, version))
                if freed:
                    freed.clear()
            except Exception:  # any error: as above
                pass
        return out

    patch(Scheduler, "_free_request", _free_request)
    patch(Scheduler, "schedule", schedule)
    patch(Scheduler, "update_from_output", update_from_output)
    patch(Scheduler, "shutdown", shutdown)


def patch_inproc_client() -> None:
    """Wrap `InprocClient.get_output`: after a step that left the scheduler with finished requests whose notes have
    not gone out and nothing unfinished, run the next (empty) step too.

    A spawned engine core's busy loop steps while `Scheduler.has_requests()`, which counts finished requests not yet
    cleared: that step carries their notes to the workers. `LLM.generate` in-process stops stepping as soon as its
    own requests are done, so without this the last ones would stay open in the service until the next call.
    """
    from vllm.v1.engine.core_client import InprocClient

    if is_patched(InprocClient.get_output):
        return
    orig_get_output = InprocClient.get_output

    def get_output(self, *a, **kw):
        out = orig_get_output(self, *a, **kw)
        core = self.engine_core
        scheduler = getattr(core, "scheduler", None)
        if scheduler is not None and scheduler.__dict__.get(_FREED) and not scheduler.has_unfinished_requests():
            _, executed = core.step_fn()  # no request left to run: an empty step, outputs empty
            core.post_step(model_executed=executed)
        return out

    patch(InprocClient, "get_output", get_output)
