"""Weight versions: which weights computed each row (spec: rows.md, "Weight versions").

A *weight version* is the label an inference engine holds for the weights it is running (vLLM's
`EngineCore._weight_version`, SGLang's `weight_version`): a user string, bounded here by `LABEL_RULE`
(`check_label`). Two spellings, one meaning: per row, `WeightVersions` (the distinct labels and an int16 index per
row, `UNKNOWN` = -1; the `weight_version` column of a row batch and of a route answer, `COLUMN_TYPE`), and over
positions, `VersionSpan`s (`[start, end)` runs of one label, the shape of vLLM's `WeightVersionSpan`, here over row
positions; used by summaries, `.npy` headers and engine-output uploads). `RecomputeRule` says which of a position's
rows computed under different versions is served.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from replay_format.core import FormatError

UNKNOWN = -1  # index of a row whose version is not known
LABEL_MAX = 128
LABEL_RULE = f"1-{LABEL_MAX} characters of A-Z a-z 0-9 . _ : @ + = - / (no spaces or control characters)"
_LABEL = re.compile(rf"[A-Za-z0-9._:@+=/-]{{1,{LABEL_MAX}}}")
INDEX_TYPE = pa.int16()
COLUMN_TYPE = pa.dictionary(INDEX_TYPE, pa.utf8())  # the `weight_version` column's type
MAX_LABELS = 2**15 - 1  # distinct labels one batch can name (int16 indices)


def check_label(value: object, what: str = "weight version") -> str:
    """`value` if it is a valid weight-version label, else FormatError naming `what` and the rule."""
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise FormatError(f"{what} {value!r} is not a valid label: {LABEL_RULE}")
    return value


@dataclass(frozen=True)
class VersionSpan:
    """Positions `[start, end)` computed with the weights labelled `version`."""

    version: str
    start: int
    end: int

    def to_json(self) -> dict[str, object]:
        """`{"version", "start", "end"}`, as vLLM's `WeightVersionSpan` reads."""
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class WeightVersions:
    """A version per row: `labels[index[i]]` for row i, unknown where `index[i] == UNKNOWN`."""

    labels: tuple[str, ...]
    index: np.ndarray  # int16 (n,)

    @classmethod
    def unknown(cls, n: int) -> WeightVersions:
        """n rows of unknown version."""
        return cls((), np.full(n, UNKNOWN, np.int16))

    @classmethod
    def single(cls, label: str, n: int) -> WeightVersions:
        """n rows of one version."""
        return cls((check_label(label),), np.zeros(n, np.int16))

    @classmethod
    def of_labels(cls, per_row: Sequence[str | None]) -> WeightVersions:
        """From one label (or None: unknown) per row."""
        labels: dict[str, int] = {}
        index = np.empty(len(per_row), np.int16)
        for i, label in enumerate(per_row):
            index[i] = UNKNOWN if label is None else labels.setdefault(check_label(label), len(labels))
        if len(labels) > MAX_LABELS:
            raise FormatError(f"{len(labels)} distinct weight versions in one batch; at most {MAX_LABELS}")
        return cls(tuple(labels), index)

    @classmethod
    def concat(cls, parts: Iterable[WeightVersions]) -> WeightVersions:
        """Rows of `parts` one after another, labels merged."""
        parts = list(parts)
        labels: dict[str, int] = {}
        pieces = []
        for part in parts:
            remap = np.array([labels.setdefault(label, len(labels)) for label in part.labels] + [UNKNOWN], np.int16)
            pieces.append(remap[part.index])  # UNKNOWN (-1) picks the last entry, UNKNOWN
        if len(labels) > MAX_LABELS:
            raise FormatError(f"{len(labels)} distinct weight versions; at most {MAX_LABELS}")
        return cls(tuple(labels), np.concatenate(pieces) if pieces else np.empty(0, np.int16))

    @property
    def num_rows(self) -> int:
        """Rows described."""
        return len(self.index)

    @property
    def all_unknown(self) -> bool:
        """True when no row's version is known."""
        return not self.labels or bool(np.all(self.index == UNKNOWN))

    def take(self, rows: np.ndarray | slice) -> WeightVersions:
        """These rows (a bool mask, row numbers or a slice), same labels."""
        return WeightVersions(self.labels, self.index[rows])

    def label_of(self, row: int) -> str | None:
        """Row `row`'s label, None when unknown."""
        i = int(self.index[row])
        return None if i == UNKNOWN else self.labels[i]

    def per_row(self) -> list[str | None]:
        """One label (or None) per row."""
        table = [*self.labels, None]
        return [table[i] for i in self.index.tolist()]

    def codes_for(self, labels: Sequence[str]) -> np.ndarray:
        """Each row's index into `labels` (UNKNOWN where unknown); `labels` must hold every label of these rows."""
        where = {label: k for k, label in enumerate(labels)}
        remap = np.array([where[label] for label in self.labels] + [UNKNOWN], np.int16)
        return remap[self.index]

    def spans(self, positions: np.ndarray) -> list[VersionSpan]:
        """Runs of one known label over consecutive rows, as `[positions[first], positions[last] + 1)`.

        `positions` are the rows' positions, ascending (a dense route); unknown rows end a run and start none.
        """
        out: list[VersionSpan] = []
        n = self.num_rows
        if n == 0:
            return out
        idx = self.index
        cut = np.flatnonzero((idx[1:] != idx[:-1]) | (np.diff(positions) != 1)) + 1
        for lo, hi in zip([0, *cut.tolist()], [*cut.tolist(), n]):
            if idx[lo] != UNKNOWN:
                out.append(VersionSpan(self.labels[idx[lo]], int(positions[lo]), int(positions[hi - 1]) + 1))
        return out

    def to_arrow(self) -> pa.DictionaryArray:
        """The `weight_version` column: dictionary<int16, utf8>, null where unknown."""
        if not self.labels:  # every row unknown (most answers): no mask to build
            return pa.nulls(len(self.index), COLUMN_TYPE)
        indices = pa.array(self.index, INDEX_TYPE, mask=self.index == UNKNOWN)
        return pa.DictionaryArray.from_arrays(indices, pa.array(list(self.labels), pa.utf8()))

    @classmethod
    def from_arrow(cls, column: pa.Array, what: str = "column 'weight_version'") -> WeightVersions:
        """Read a `weight_version` column (dictionary of utf8, or plain utf8); FormatError naming the problem."""
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = column.dictionary_encode()
        if not (pa.types.is_dictionary(column.type) and (pa.types.is_string(column.type.value_type)
                                                          or pa.types.is_large_string(column.type.value_type))):
            raise FormatError(f"{what} has type {column.type}, expected dictionary<int16, utf8>")
        names = column.dictionary.to_pylist()
        if len(names) > MAX_LABELS:
            raise FormatError(f"{what} names {len(names)} versions; at most {MAX_LABELS}")
        if column.null_count == len(column):  # no row's version known (a writer that sends none): nothing to fold
            return cls.unknown(len(column))
        valid = column.indices.is_valid().to_numpy(zero_copy_only=False)
        indices = column.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        used = np.unique(indices[valid]) if valid.any() else np.empty(0, np.int64)
        for i in used.tolist():
            check_label(names[i], what + " label")
        # Fold the dictionary to the labels used, first use first, so equal batches compare equal.
        labels: dict[str, int] = {}
        remap = np.full(len(names) + 1, UNKNOWN, np.int16)
        for i in used.tolist():
            remap[i] = labels.setdefault(names[i], len(labels))
        index = np.where(valid, remap[np.where(valid, indices, len(names))], UNKNOWN).astype(np.int16)
        return cls(tuple(labels), index)


def spans_to_rows(spans: Sequence[VersionSpan], positions: np.ndarray, what: str = "weight_versions") -> WeightVersions:
    """The version of each position in `positions` under `spans`, which must cover every one of them once.

    FormatError naming the first overlap or the first position no span covers.
    """
    ordered = sorted(spans, key=lambda s: s.start)
    for span in ordered:
        check_label(span.version, f"{what} version")
        if span.start < 0 or span.end <= span.start:
            raise FormatError(f"{what}: span {span.to_json()} is empty or starts below 0")
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise FormatError(f"{what}: spans {a.to_json()} and {b.to_json()} overlap")
    labels: dict[str, int] = {}
    codes = np.array([labels.setdefault(s.version, len(labels)) for s in ordered], np.int16)
    starts = np.array([s.start for s in ordered], np.int64)
    ends = np.array([s.end for s in ordered], np.int64)
    pos = np.asarray(positions, np.int64)
    which = np.searchsorted(starts, pos, side="right") - 1
    covered = (which >= 0) & (pos < ends[np.maximum(which, 0)])
    if not covered.all():
        first = int(pos[np.flatnonzero(~covered)[0]])
        raise FormatError(f"{what}: position {first} is in no span (spans cover "
                          f"{[(s.start, s.end) for s in ordered]})")
    return WeightVersions(tuple(labels), codes[which] if len(pos) else np.empty(0, np.int16))


def span_json(span: Any) -> dict[str, Any]:
    """One span as JSON `{"version", "start", "end"}`, from a vLLM `WeightVersionSpan`, a `VersionSpan`, a dict or a
    `[version, start, end]` triple (unchecked: `span_from_json` reads it back, checking)."""
    if isinstance(span, dict):
        return {"version": span["version"], "start": int(span["start"]), "end": int(span["end"])}
    if isinstance(span, list | tuple):
        version, start, end = span
        return {"version": version, "start": int(start), "end": int(end)}
    return {"version": span.version, "start": int(span.start), "end": int(span.end)}


def span_from_json(value: object, what: str = "weight_versions") -> VersionSpan:
    """One `{"version", "start", "end"}` object (or a vLLM/SGLang `[version, start, end]` triple)."""
    if isinstance(value, dict):
        try:
            version, start, end = value["version"], value["start"], value["end"]
        except KeyError as e:
            raise FormatError(f"{what}: span {value!r} lacks {e.args[0]!r}") from None
    elif isinstance(value, list | tuple) and len(value) == 3:
        version, start, end = value
    else:
        raise FormatError(f"{what}: {value!r} is not a span {{'version', 'start', 'end'}}")
    if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool) or isinstance(end, bool):
        raise FormatError(f"{what}: span {value!r} has non-integer bounds")
    return VersionSpan(check_label(version, f"{what} version"), start, end)


class RecomputeRule(enum.StrEnum):
    """Which computation a read serves where a position was computed more than once under different weights."""

    FIRST = "first"  # the first the request came to hold: the rows its sampled tokens were produced with (default)
    LATEST = "latest"  # the last one stored: the newest weights' recompute
