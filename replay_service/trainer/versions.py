"""Weight versions in a trainer slice: the slice's label table, and the `versions=single` check.

Every token replayed from a recorded row carries that row's weight version (trainer_slice.md, column
`weight_version`): an index into one label table per slice (`VersionLabels`). Under
`VersionPolicy.SINGLE` a sequence whose clean rows were computed by more than one version (a weight
update mid-generation, a recompute under new weights) is refused (409) naming each such sequence and
where its versions change. The check reads every sequence's whole rows, not this rank's part, so every
rank of a micro-batch (CP, TP, PP) refuses or serves alike. Rows of unknown version (written before
versions existed, or by a writer that knows none) are no version: they mix with nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_format.trainer_query import SequenceRef
from replay_format.trainer_slice import VERSION_TYPE
from replay_format.weight_versions import UNKNOWN, VersionSpan, WeightVersions
from replay_service.errors import Conflict
from replay_service.store.requests.rows import RouteRows


class VersionLabels:
    """The labels of one slice, first seen first, and each read's versions as indices into them."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}

    @property
    def labels(self) -> list[str]:
        """The labels, in index order (the slice's `weight_versions` metadata)."""
        return list(self._at)

    def codes(self, versions: WeightVersions) -> np.ndarray:
        """int16 per row: the index of its label here (added when new), UNKNOWN where unknown."""
        remap = np.array([self._at.setdefault(label, len(self._at)) for label in versions.labels] + [UNKNOWN],
                         VERSION_TYPE)
        return remap[versions.index]


@dataclass(frozen=True)
class MixedSequence:
    """A sequence of the micro-batch whose clean rows were computed by more than one weight version."""

    index: int  # in the query's sequences
    ref: SequenceRef
    spans: list[VersionSpan]  # runs of one version over its clean rows, by position

    def describe(self) -> str:
        """`sequence 1 (run/req: v1 at [0, 11), v2 at [11, 19))`."""
        where = ", ".join(f"{s.version} at [{s.start}, {s.end})" for s in self.spans)
        return f"sequence {self.index} ({self.ref.run}/{self.ref.request}: {where})"


def mixed_versions(index: int, ref: SequenceRef, route: RouteRows) -> MixedSequence | None:
    """The sequence as a `MixedSequence` when its clean rows hold two or more known versions, else None."""
    clean = route.flags == 0
    versions = route.versions().take(clean)
    known = versions.index[versions.index != UNKNOWN]
    if known.size == 0 or bool(np.all(known == known[0])):
        return None
    return MixedSequence(index, ref, versions.spans(route.positions[clean]))


def refuse_mixed(mixed: list[MixedSequence], report: int) -> None:
    """Conflict naming the first `report` mixed sequences (nothing when there are none)."""
    if not mixed:
        return
    named = "; ".join(m.describe() for m in mixed[:report])
    more = f" and {len(mixed) - report} more" if len(mixed) > report else ""
    raise Conflict(f"versions=single refused: {len(mixed)} sequences mix weight versions: {named}{more}; ask with "
                   "versions=any to train on them as recorded (the slice carries each token's version)")
