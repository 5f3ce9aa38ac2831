"""The run registry: each run's shape and commit lock, from the index (kept where only this process writes it).

Contract: a run is created by its first batch (`for_batch`); a later batch of other rows (MoE layers, top-k, experts)
is a Conflict, and a run whose layer count is only derived (`max(moe_layers) + 1`) learns a larger stated one
(compare-and-set on its row). On a shared index every lookup reads the run's row again; a `RunState` stays one per
run (same `created_at`), so its lock and `deleted` mark are shared. No index read is made under the registry's lock,
and an older read never undoes a newer one.
Design: docs/design/store.md ("The run registry").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from replay_format import RunShape
from replay_format.rows import RowsMeta
from replay_service.errors import Conflict, NotFound, RunDeleted
from replay_service.placement import on_loop
from replay_service.store.index import Index, Row

PRUNE_AT = 4096  # run ids with a read number kept, above which those no read under way needs are dropped


@dataclass
class RunState:
    """What ingest needs of a run, in memory."""

    run_id: str
    shape: RunShape
    created_at: float  # tells a run from a later one of the same id (deleted and started again elsewhere)
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the commit stage
    deleted: bool = False  # set (under `lock`) when the run was deleted: this state is stale


class RunRegistry:
    """Runs by id: read from the index on first use, created by `for_batch`."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._runs: dict[str, RunState] = {}
        self._lock = threading.Lock()
        self._reads = itertools.count()  # numbers each read of a run's row as it starts (`next` is atomic)
        self._applied: dict[str, int] = {}  # per run: the number of the read (or write) its kept state reflects
        self._prune_at = PRUNE_AT
        self._under_way: set[int] = set()  # numbers of `get`'s reads started and not yet applied
        self._under_way_lock = threading.Lock()  # guards `_under_way` only: never held across a read

    def get(self, run_id: str) -> RunState | None:
        """The run, or None when it does not exist."""
        state = self._kept(run_id)
        if state is not None:
            return state
        with self._under_way_lock:
            read = next(self._reads)
            self._under_way.add(read)
        try:
            row = self.index.run(run_id)  # with no lock held (module docstring)
            on_loop.acquire(self._lock, f"run {run_id!r} is being registered")
            try:
                return self._apply(run_id, row, read)
            finally:
                self._lock.release()
        finally:
            with self._under_way_lock:
                self._under_way.discard(read)

    def require(self, run_id: str) -> RunState:
        """The run; NotFound when it does not exist."""
        state = self.get(run_id)
        if state is None:
            raise NotFound(f"run {run_id!r} not found")
        return state

    def for_batch(self, meta: RowsMeta) -> RunState:
        """The batch's run, created with the batch's shape when new; Conflict when the shapes differ.

        A run whose layer count is only derived learns the batch's (module docstring).
        """
        state = self.get(meta.run_id)
        if (state is not None and same_rows(state.shape, meta.shape)
                and same_model(state.shape, meta.shape, meta.run_id) == state.shape.num_hidden_layers):
            return state  # the run as it is: nothing to create or learn, and no lock held while the index was read
        with self._lock:
            state = self._current(meta.run_id)
            if state is None and self.index.register_run(meta.run_id, meta.shape, meta.source.value, time.time()):
                state = self._current(meta.run_id)
            if state is None:  # another replica created it meanwhile (and maybe deleted it): its row decides
                state = self._current(meta.run_id)
                if state is None:
                    raise RunDeleted(f"run {meta.run_id!r} was deleted while this batch was being stored; nothing "
                                     "was stored (send it again to start a fresh run)")
            while True:
                have, got = state.shape, meta.shape
                if not same_rows(have, got):
                    raise Conflict(
                        f"run {meta.run_id!r} stores rows of {have.num_moe_layers} layers x top-{have.top_k} "
                        f"of {have.num_experts} experts (MoE layers {list(have.moe_layers)}); this batch has "
                        f"{got.num_moe_layers} x top-{got.top_k} of {got.num_experts} (MoE layers "
                        f"{list(got.moe_layers)})")
                hidden = same_model(have, got, meta.run_id)
                if hidden == have.num_hidden_layers:
                    return state
                if self.index.learn_num_hidden_layers(meta.run_id, hidden, have.num_hidden_layers):
                    state.shape = dataclasses.replace(have, num_hidden_layers=hidden)
                    self._applied[meta.run_id] = next(self._reads)  # newer than any read under way
                    return state
                # Another replica learnt a count (or deleted the run) meanwhile: decide again on its row.
                fresh = self._reload(meta.run_id)
                if fresh is None:
                    raise RunDeleted(f"run {meta.run_id!r} was deleted while this batch was being stored; nothing "
                                     "was stored (send it again to start a fresh run)")
                state = fresh

    def forget(self, run_id: str) -> None:
        """Drop a deleted run's state: the next batch of this id creates a fresh run."""
        with self._lock:
            self._runs.pop(run_id, None)
            self._applied[run_id] = next(self._reads)  # a read under way does not bring it back

    def _kept(self, run_id: str) -> RunState | None:
        """The kept state where it needs no read (only this process writes the index), else None."""
        state = self._runs.get(run_id)
        return state if state is not None and not self.index.shared else None

    def _current(self, run_id: str) -> RunState | None:
        """The kept state (only this process writes the index), else the run's row read again (`_lock` held)."""
        return self._kept(run_id) or self._reload(run_id)

    def _reload(self, run_id: str) -> RunState | None:
        """The run as its row is now (`_lock` held, by a batch that creates the run or learns its layer count)."""
        read = next(self._reads)
        return self._apply(run_id, self.index.run(run_id), read)

    def _apply(self, run_id: str, row: Row | None, read: int) -> RunState | None:
        """The run as `row` (read number `read`) says (`_lock` held): the kept state updated, a new one for a new
        run, None if gone; the kept state as it is when a later read was applied already (module docstring)."""
        kept = self._runs.get(run_id)
        if read < self._applied.get(run_id, -1):
            return kept
        self._applied[run_id] = read
        if len(self._applied) > self._prune_at:
            self._prune()
        if row is None:
            if kept is not None:  # deleted by another replica: a read under way here answers RunDeleted
                kept.deleted = True
                del self._runs[run_id]
            return None
        shape = shape_of(row)
        if kept is not None and kept.created_at == row["created_at"]:
            kept.shape = shape
            return kept
        if kept is not None:  # deleted and started again elsewhere: the old state is stale
            kept.deleted = True
        state = RunState(run_id, shape, row["created_at"])
        self._runs[run_id] = state
        return state

    def _prune(self) -> None:
        """Drop the read numbers no read under way needs (`_lock` held): a number matters only to a read that
        started before it and is not applied yet; every later read is numbered above it."""
        with self._under_way_lock:
            oldest = min(self._under_way, default=None)
        self._applied = {} if oldest is None else {r: n for r, n in self._applied.items() if n > oldest}
        self._prune_at = max(PRUNE_AT, 2 * len(self._applied))  # a read held up keeps more: prune again later


def shape_of(run: Row) -> RunShape:
    """The shape a `runs` row records (`num_hidden_layers` 0: written before runs knew it, derived)."""
    return RunShape(run["num_moe_layers"], run["top_k"], run["num_experts"], tuple(json.loads(run["moe_layers"])),
                    run["num_hidden_layers"])


def derived_hidden(shape: RunShape) -> int:
    """The layer count a shape says when its writer did not know it: the last MoE layer's index + 1."""
    return shape.moe_layers[-1] + 1


def same_rows(a: RunShape, b: RunShape) -> bool:
    """Rows of the same MoE layers, top-k and expert count (the model's layer count aside: `same_model`)."""
    return (a.num_moe_layers, a.top_k, a.num_experts, a.moe_layers) == (b.num_moe_layers, b.top_k, b.num_experts,
                                                                         b.moe_layers)


def same_model(run: RunShape, batch: RunShape, run_id: str) -> int:
    """The run's `num_hidden_layers` after a batch of `batch`'s shape (`same_rows` already); Conflict if they differ.

    The derived count agrees with any other; the larger stated count wins.
    """
    have, got, derived = run.num_hidden_layers, batch.num_hidden_layers, derived_hidden(run)
    if have == got or got == derived:
        return have
    if have == derived:
        return got
    raise Conflict(
        f"run {run_id!r} is of a model of {have} layers (num_hidden_layers); this batch says {got}: "
        "one run holds one model's routes")
