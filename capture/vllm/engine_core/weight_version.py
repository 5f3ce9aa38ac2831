"""Runs in vLLM's engine core: which weight version each scheduled step runs with.

vLLM 0.32 keeps the label on the engine core: `EngineCore._weight_version` (`vllm/v1/engine/core.py:141`),
`"default"` until `EngineCore.set_weight_version` (`core.py:1082`) sets another. Every way a user sets it
ends there: `LLMEngine.set_weight_version`, `AsyncLLM.update_weight_version` and
`finish_weight_update(weight_version=...)`, the OpenAI server's `POST /update_weight_version`
(`entrypoints/rl/online/api_router.py`). vLLM stamps each step's outputs with it when it makes them
(`EngineCore._attach_weight_version`: "weight versions change only while generation is paused"), and
`CompletionOutput.weight_versions` spans are cut from those stamps.

The scheduler, where the plugin's per-step hook runs (`scheduler.py`), does not see its engine core, so
the plugin wraps `set_weight_version` to note the label on the engine core's scheduler too (`note`);
until the first call the label is vLLM's initial `DEFAULT`. From there:
- `scheduler.py` asks `announce(scheduler)` once per scheduled step: the version goes to the workers
  (`SchedulerNotes.weight_version`) on the first step and on the first step after a change, nothing
  otherwise (one dictionary read and one identity comparison per step);
- `routed_experts_tee.py` reads `current(scheduler)` when vLLM commits a step's rows.

The label is read when the step is scheduled; vLLM reads it when the step's output is made. The two
agree whenever the version is changed while generation is paused (vLLM's pause waits for the steps in
flight), as vLLM requires. A label outside the label rule (`replay_format.weight_versions.check_label`;
vLLM takes any string) is logged once and its rows go as version unknown (`WeightVersion(None)`).
"""

from __future__ import annotations

from typing import Any

from capture.vllm.log import log
from capture.vllm.patching import is_patched, patch
from capture.vllm.scheduler_notes import WeightVersion
from replay_format import FormatError
from replay_format.weight_versions import LABEL_RULE, check_label

DEFAULT = "default"  # vLLM's EngineCore._weight_version until set_weight_version (v1/engine/core.py:141)
_CURRENT = "_routing_replay_weight_version"  # on the Scheduler instance: its engine core's WeightVersion
_ANNOUNCED = "_routing_replay_weight_version_sent"  # on the Scheduler instance: the one the workers were told
_INITIAL = WeightVersion(DEFAULT)
_refused: set[str] = set()  # labels outside the rule, logged once each


def version_of(label: object) -> WeightVersion:
    """vLLM's label as the plugin sends it: itself, or unknown (logged once) when it is outside the label rule."""
    try:
        return WeightVersion(check_label(label))
    except FormatError:
        text = repr(label)[:200]
        if text not in _refused:
            _refused.add(text)
            log.error("routing-replay: vLLM's weight version %s is not a label the service stores (%s); rows computed "
                      "under it are sent with the version unknown", text, LABEL_RULE)
        return WeightVersion(None)


def note(scheduler: Any, label: object) -> None:
    """The engine core of `scheduler` runs the weights labelled `label` from its next step on."""
    scheduler.__dict__[_CURRENT] = version_of(label)


def current(scheduler: Any) -> WeightVersion:
    """The weight version the engine core of `scheduler` runs now."""
    return scheduler.__dict__.get(_CURRENT, _INITIAL)


def announce(scheduler: Any) -> WeightVersion | None:
    """The version to tell the workers with the step being scheduled: the current one on the first step and after a
    change, else None."""
    state = scheduler.__dict__
    version = state.get(_CURRENT, _INITIAL)
    if version is state.get(_ANNOUNCED):
        return None
    state[_ANNOUNCED] = version
    return version


def patch_set_weight_version() -> None:
    """Wrap `EngineCore.set_weight_version` to note the label on the engine core's scheduler (idempotent)."""
    from vllm.v1.engine.core import EngineCore

    if is_patched(EngineCore.set_weight_version):
        return
    orig = EngineCore.set_weight_version

    def set_weight_version(self, weight_version, *a, **kw):
        out = orig(self, weight_version, *a, **kw)
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            try:
                note(scheduler, getattr(self, "_weight_version", weight_version))
            except Exception:  # any error: never break vLLM's call (the workers keep the last version)
                log.exception("routing-replay: failed to note the weight version %r", weight_version)
        return out

    patch(EngineCore, "set_weight_version", set_weight_version)
