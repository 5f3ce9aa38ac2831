"""What the engine core tells the workers with one step: a typed record on vLLM's `SchedulerOutput`.

Runs in two processes: the engine core writes it (`attach`, from `engine_core/scheduler.py`) and each
worker reads it (`notes_of`, from `worker/step_hooks.py`); neither side imports the other. The record
rides on the `SchedulerOutput` instance under one attribute, `ATTRIBUTE`, and reaches the workers with
it (vLLM pickles the instance with its dict). It is attached only to a step that has something to say.

- `finished`: how each request the scheduler freed since the last step ended, with its length. Workers
  see only `SchedulerOutput.finished_req_ids` (finished *or* aborted, no length); a freed request
  without a note is sent as finished, with the length its sink counted.
- `prefix_hits`: the prefix-cache hits of the requests this step schedules (new, or resumed after
  preemption), as references in the engine's request ids (`engine_core/prefix_hits.py`).
- `weight_version`: the engine core's weight version (`engine_core/weight_version.py`), on the first
  step and on the first step after it changed; None on every other step. A worker keeps the last one
  it was told and stamps every step it sends with it.

Later notes of the engine core for its workers belong here too, as fields of the same record.
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
