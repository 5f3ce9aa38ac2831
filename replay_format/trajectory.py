"""Trajectory answers: several requests (turns) read back as one route (spec: trajectory.md).

A multi-turn conversation or a partial rollout resubmitted as a new request is stored as one request per turn;
`POST /v1/runs/{run}/routes/trajectory` composes them at read time into one route over positions
`0 .. rows of the last turn - 1`, each position taken from one turn by a `RecomputeRule` (the route answer's
`recompute` key). The answer is a route answer (route.md) with one record batch, named after the last turn;
`TrajectoryInfo` says which turn each row came from, as spans over positions. It travels in the stream's schema
metadata (`TrajectoryMeta`, keys `trajectory_*`, which a plain route reader ignores) and, for every format (Arrow,
`.npy`, JSON), in the `X-Trajectory-*` headers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format.core import Backing, FormatError, FormatVersion, check_id, decode_metadata
from replay_format.route import RouteMeta
from replay_format.weight_versions import RecomputeRule

VERSION = FormatVersion(1, 0)
VERSION_KEY = "trajectory_version"  # the metadata keys a trajectory adds to a route answer
TURNS_KEY = "trajectory_turns"  # JSON list: the turns' request ids, in the order asked
SPANS_KEY = "trajectory_spans"  # JSON list of TurnSpan objects
RULE_KEY = "recompute"  # the route answer's own key (route.md 1.2): first | latest
DIFFERING_KEY = "trajectory_differing"  # positions where a later turn's ids differ from the row held before
HEADER_SPANS = 128  # spans the X-Trajectory-Spans header carries at most (Arrow and JSON bodies carry every one)
NO_TURN = -1  # turn index of a position no turn holds a row at (a GAP row)
WHAT = "trajectory answer"


@dataclass(frozen=True)
class TurnSpan:
    """Positions `[start, end)` of the trajectory served from turn `turn` (request `request_id`)."""

    turn: int
    request_id: str
    start: int
    end: int

    def to_json(self) -> dict[str, object]:
        """`{"turn", "request_id", "start", "end"}`."""
        return {"turn": self.turn, "request_id": self.request_id, "start": self.start, "end": self.end}


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrajectoryInfo:
    """Which turn each row of a trajectory answer came from, the rule that chose it, and how often turns differ."""

    turns: tuple[str, ...]  # request ids of the turns, in the order asked
    spans: tuple[TurnSpan, ...]  # ascending, disjoint; a position in none is a GAP row (no turn holds it)
    rule: RecomputeRule
    differing: int = 0  # positions where a later turn recorded other ids than the row held there before it

    @classmethod
    def of_index(cls, turns: Sequence[str], turn: np.ndarray, positions: np.ndarray, rule: RecomputeRule,
                 differing: int = 0) -> TrajectoryInfo:
        """From a turn index per row (`NO_TURN` where none), over ascending consecutive `positions`."""
        spans: list[TurnSpan] = []
        n = len(turn)
        if n:
            cut = (np.flatnonzero(turn[1:] != turn[:-1]) + 1).tolist()
            for lo, hi in zip([0, *cut], [*cut, n]):
                k = int(turn[lo])
                if k != NO_TURN:
                    spans.append(TurnSpan(k, turns[k], int(positions[lo]), int(positions[hi - 1]) + 1))
        return cls(tuple(turns), tuple(spans), RecomputeRule(rule), differing)

    def turn_index(self, positions: np.ndarray) -> np.ndarray:
        """int32 per row at `positions`: the index (into `turns`) of the turn it came from, `NO_TURN` where none."""
        pos = np.asarray(positions, np.int64)
        if not self.spans:
            return np.full(len(pos), NO_TURN, np.int32)
        starts = np.array([s.start for s in self.spans], np.int64)
        ends = np.array([s.end for s in self.spans], np.int64)
        turns = np.array([s.turn for s in self.spans], np.int32)
        at = np.maximum(np.searchsorted(starts, pos, side="right") - 1, 0)
        inside = (pos >= starts[at]) & (pos < ends[at])
        return np.where(inside, turns[at], NO_TURN).astype(np.int32)

    def spans_json(self) -> str:
        """The spans as one JSON text (the `X-Trajectory-Spans` header and the metadata key)."""
        return json.dumps([s.to_json() for s in self.spans], separators=(",", ":"))

    def headers(self) -> dict[str, str]:
        """The `X-Trajectory-*` headers of an answer (every format): the spans only up to `HEADER_SPANS` of them.

        (A header line is bounded on the reading side, 64 KiB in Python's `http.client`; Arrow and JSON bodies
        carry every span.)
        """
        out = {"X-Trajectory-Span-Count": str(len(self.spans)), "X-Trajectory-Differing": str(self.differing)}
        if len(self.spans) <= HEADER_SPANS:
            out["X-Trajectory-Spans"] = self.spans_json()
        return out

    def to_metadata(self) -> dict[str, str]:
        """The keys a trajectory adds to the route answer's schema metadata (the rule is the answer's `recompute`)."""
        return {VERSION_KEY: str(VERSION), TURNS_KEY: json.dumps(list(self.turns)), SPANS_KEY: self.spans_json(),
                DIFFERING_KEY: str(self.differing)}

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> TrajectoryInfo | None:
        """The trajectory keys of a route answer's metadata; None when it has none (a plain route answer).

        FormatError naming a bad key, an unknown major version, or spans that name turns it does not list.
        """
        if VERSION_KEY not in md:
            return None
        FormatVersion.parse(md[VERSION_KEY], WHAT).check(WHAT, VERSION)
        for key in (TURNS_KEY, SPANS_KEY, DIFFERING_KEY):
            if key not in md:
                raise FormatError(f"{WHAT}: schema metadata lacks {key}")
        try:
            turns, spans = json.loads(md[TURNS_KEY]), json.loads(md[SPANS_KEY])
        except ValueError:
            raise FormatError(f"{WHAT}: schema metadata {TURNS_KEY} or {SPANS_KEY} is not JSON") from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise FormatError(f"{WHAT}: {TURNS_KEY} is not a list of request ids")
        turns = [check_id("turn request id", t) for t in turns]
        if not isinstance(spans, list):
            raise FormatError(f"{WHAT}: {SPANS_KEY} is not a list")
        parsed = [_span(s, turns) for s in spans]
        for a, b in zip(parsed, parsed[1:]):
            if b.start < a.end:
                raise FormatError(f"{WHAT}: spans {a.to_json()} and {b.to_json()} overlap or are out of order")
        try:
            rule = RecomputeRule(md.get(RULE_KEY, RecomputeRule.FIRST.value))
        except ValueError:
            raise FormatError(f"{WHAT}: {RULE_KEY}={md[RULE_KEY]!r} is not one of "
                              f"{', '.join(r.value for r in RecomputeRule)}") from None
        differing = md[DIFFERING_KEY]
        if not differing.isdigit():
            raise FormatError(f"{WHAT}: {DIFFERING_KEY}={differing!r} is not a count")
        return cls(tuple(turns), tuple(parsed), rule, int(differing))


def _span(doc: object, turns: list[str]) -> TurnSpan:
    """One span object of the metadata, checked against the turns listed."""
    if not isinstance(doc, dict) or not all(_int(doc.get(k)) for k in ("turn", "start", "end")):
        raise FormatError(f"{WHAT}: span {doc!r} is not {{'turn', 'request_id', 'start', 'end'}} with integers")
    turn, start, end = doc["turn"], doc["start"], doc["end"]
    if not 0 <= turn < len(turns) or doc.get("request_id") != turns[turn] or not 0 <= start < end:
        raise FormatError(f"{WHAT}: span {doc!r} names no listed turn, another request, or an empty range")
    return TurnSpan(turn, turns[turn], start, end)


@dataclass(frozen=True)
class TrajectoryMeta(RouteMeta):
    """A route answer's metadata with the trajectory's keys added (`TrajectoryInfo.to_metadata`); its `recompute`
    is the trajectory's rule."""

    trajectory: TrajectoryInfo | None = None

    def to_metadata(self) -> dict[str, str]:
        """The route answer's keys, then the trajectory's."""
        md = super().to_metadata()
        if self.trajectory is not None:
            md.update(self.trajectory.to_metadata())
        return md


def read_trajectory_info(backing: Backing) -> TrajectoryInfo | None:
    """The trajectory keys of a received route answer (its schema only is read); None for a plain route answer."""
    try:
        schema = pa.ipc.open_stream(pa.py_buffer(backing)).schema
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{WHAT} is not a valid Arrow IPC stream: {exc}") from None
    return TrajectoryInfo.from_metadata(decode_metadata(schema.metadata, WHAT))


__all__ = ["NO_TURN", "VERSION", "TrajectoryInfo", "TrajectoryMeta", "TurnSpan", "read_trajectory_info"]
