"""Trajectories: the requests (turns) of one conversation or rollout, composed into one route at read time.

`read_trajectory(store, run_id, turns, rule, ...)` answers one route over positions `0 .. rows of the last turn - 1`,
each position taken from one turn by the `RecomputeRule`: `first` (default: earlier turns are immutable) or `latest`
(the newest computation); within a turn the same rule picks among its own computations. A position no turn holds is
GAP; each row keeps its turn's flags and weight version, and `TrajectoryInfo` says which turn it came from. Turns must
continue one another (`check_growing`: each at least as long as the one before, tokens agreeing; Conflict naming the
turn and position otherwise). Each turn is read once and folded in: memory holds the composed route and one turn.

Design: docs/design/service_data.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replay_format import ID_RULE, NO_TOKEN, Flag, RunShape, valid_id
from replay_format.trajectory import NO_TURN, TrajectoryInfo
from replay_format.weight_versions import UNKNOWN, RecomputeRule, WeightVersions
from replay_service.errors import Conflict, InvalidInput
from replay_service.store import RouteStore
from replay_service.store.requests.rows import RouteRows
from replay_service.store.requests.summaries import RequestRecord


@dataclass
class Trajectory:
    """A composed route (named after the last turn, dense over `0 .. n-1`) and which turn each row came from."""

    route: RouteRows
    info: TrajectoryInfo
    turn: np.ndarray  # int32 per row: the index of its turn, `NO_TURN` for a GAP row


def check_turns(turns: Sequence[str], max_turns: int) -> None:
    """InvalidInput for no turn, too many, an id that breaks ID_RULE, or a turn named twice."""
    if not turns:
        raise InvalidInput("a trajectory needs at least one turn")
    if len(turns) > max_turns:
        raise InvalidInput(f"{len(turns)} turns exceeds max_batch_requests={max_turns}")
    seen: dict[str, int] = {}
    for k, rid in enumerate(turns):
        if not valid_id(rid):
            raise InvalidInput(f"turn {k}: request id {rid!r} is not a valid id: {ID_RULE}")
        if rid in seen:
            raise InvalidInput(f"turn {k} names request {rid!r} again (turn {seen[rid]}); each turn is one request")
        seen[rid] = k


def check_growing(records: Sequence[RequestRecord]) -> None:
    """Conflict when a turn holds fewer rows than the turn before it (a later turn continues the earlier one)."""
    for k in range(1, len(records)):
        before, now = records[k - 1], records[k]
        if now.expected_rows < before.expected_rows:
            raise Conflict(f"turn {k} ({now.request_id!r}) has {now.expected_rows} rows, fewer than turn {k - 1} "
                           f"({before.request_id!r}) with {before.expected_rows}: each turn's sequence continues "
                           "the one before it")


class _Composer:
    """The composed route so far: each turn folded in by `add`, in order."""

    def __init__(self, shape: RunShape, n: int, rule: RecomputeRule, turns: Sequence[str]) -> None:
        self.shape, self.n, self.rule, self.turns = shape, n, rule, list(turns)
        self.experts = np.zeros((n, shape.row_width), shape.dtype)
        self.flags = np.full(n, int(Flag.GAP), np.uint16)
        self.tokens = np.full(n, NO_TOKEN, np.int32)
        self.token_turn = np.full(n, NO_TURN, np.int32)  # the turn whose token is known at each position
        self.turn = np.full(n, NO_TURN, np.int32)
        self.codes = np.full(n, UNKNOWN, np.int16)
        self.labels: dict[str, int] = {}
        self.differs = np.zeros(n, bool)

    def add(self, k: int, route: RouteRows) -> None:
        """Fold turn `k`'s rows (positions `0 .. route.num_rows - 1`, dense) in; Conflict on a token that differs."""
        m = min(route.num_rows, self.n)
        self._check_tokens(k, route.token_ids[:m])
        held = (route.flags[:m] & Flag.GAP) == 0
        experts = route.experts[:m]
        before = self.turn[:m] != NO_TURN
        both = np.flatnonzero(held & before)
        if both.size:
            self.differs[both[np.any(experts[both] != self.experts[both], axis=1)]] = True
        take = np.flatnonzero(held & ~before if self.rule is RecomputeRule.FIRST else held)
        if not take.size:
            return
        self.experts[take] = experts[take]
        self.flags[take] = route.flags[take]
        self.turn[take] = k
        versions = route.versions()
        remap = np.array([self.labels.setdefault(label, len(self.labels)) for label in versions.labels] + [UNKNOWN],
                         np.int16)
        self.codes[take] = remap[versions.index[take]]

    def _check_tokens(self, k: int, tokens: np.ndarray) -> None:
        m = len(tokens)
        known = self.tokens[:m]
        bad = np.flatnonzero((tokens != NO_TOKEN) & (known != NO_TOKEN) & (tokens != known))
        if bad.size:
            p = int(bad[0])
            j = int(self.token_turn[p])
            raise Conflict(f"turn {k} ({self.turns[k]!r}) does not continue turn {j} ({self.turns[j]!r}): at position "
                           f"{p} it has token {int(tokens[p])} where turn {j} has {int(known[p])} ({bad.size} "
                           "positions differ); a later turn's sequence starts with the earlier turn's")
        new = (tokens != NO_TOKEN) & (known == NO_TOKEN)
        self.tokens[:m][new] = tokens[new]
        self.token_turn[:m][new] = k

    def result(self, request_id: str) -> Trajectory:
        """The composed route, named `request_id`, and its turn spans."""
        positions = np.arange(self.n, dtype=np.int32)
        versions = WeightVersions(tuple(self.labels), self.codes) if self.labels else None
        route = RouteRows(request_id, self.shape, positions, self.tokens, self.experts, self.flags, versions)
        info = TrajectoryInfo.of_index(self.turns, self.turn, positions, self.rule, int(self.differs.sum()))
        return Trajectory(route, info, self.turn)


def read_trajectory(store: RouteStore, run_id: str, turns: Sequence[str], rule: RecomputeRule,
                    max_turns: int) -> Trajectory:
    """The turns of run `run_id` as one route by `rule`; InvalidInput, NotFound or Conflict say why not."""
    check_turns(turns, max_turns)
    run = store.run_to_read(run_id)
    records = [store.request_to_read(run, rid) for rid in turns]  # NotFound before any row is read
    check_growing(records)
    rule = RecomputeRule(rule)
    composer = _Composer(run.shape, records[-1].expected_rows, rule, turns)
    for k, record in enumerate(records):
        composer.add(k, store.read_rows(run, record, 0, record.expected_rows, rule))
    return composer.result(records[-1].request_id)
