"""What the engine core tells the workers with one step: a typed record on vLLM's `SchedulerOutput`.

Runs in two processes: the engine core writes it (`attach`, from `engine_core/scheduler.py`) and each worker reads
it (`notes_of`, from `worker/step_hooks.py`); neither side imports the other. `SchedulerNotes` rides on the
`SchedulerOutput` instance under `ATTRIBUTE` (vLLM pickles the instance with its dict), attached only to a step that
has something to say: `finished` (how each freed request ended, with its length), `prefix_hits` (references of the
requests this step schedules) and `weight_version` (on the first step and after a change; else None).

Design: docs/design/vllm_plugin.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replay_format.request_notes import Reference
from replay_format.step_frame import Ended

ATTRIBUTE = "routing_replay_notes"  # on the SchedulerOutput instance: its SchedulerNotes


@dataclass(frozen=True)
class WeightVersion:
    """The weights the engine core runs from this step on: `label`, or None when the engine's label is outside the
    label rule (`replay_format.weight_versions.check_label`; the engine core logged it): rows then go as unknown."""

    label: str | None


@dataclass(frozen=True)
class SchedulerNotes:
    """One step's notes from the engine core for its workers (module docstring)."""

    finished: Mapping[str, Ended] = field(default_factory=dict)  # engine request id -> how it ended
    prefix_hits: list[Reference] = field(default_factory=list)  # engine ids, capped at where each request starts
    weight_version: WeightVersion | None = None  # from this step on; None: as the last note said


def attach(scheduler_output: Any, notes: SchedulerNotes) -> None:
    """Engine core: let `notes` travel to the workers with `scheduler_output`."""
    setattr(scheduler_output, ATTRIBUTE, notes)


def notes_of(scheduler_output: Any) -> SchedulerNotes | None:
    """Worker (and the engine core once the step ran): the notes a step carries; None when it carries none."""
    return getattr(scheduler_output, ATTRIBUTE, None)
