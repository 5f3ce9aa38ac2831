"""Runs in vLLM's engine core: which weight version each scheduled step runs with.

`patch_set_weight_version` wraps `EngineCore.set_weight_version` (where every way a user sets vLLM's label ends) to
`note` the label on the engine core's scheduler too; until then it is vLLM's initial `DEFAULT`. `announce(scheduler)`,
once per scheduled step, returns the version on the first step and the first step after a change (None otherwise);
`current(scheduler)` is the version now. It agrees with vLLM's own stamps when the version changes while generation is
paused, as vLLM requires. A label outside `replay_format.weight_versions.check_label` is logged once and its rows go
as version unknown.

Design: docs/design/vllm_engine_core.md.
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
