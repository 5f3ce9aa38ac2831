"""The run registry: each run's shape, expert load and ingest lock, loaded from the index once and kept.

A run is created by its first batch; every later batch must have the same shape, with one allowance
for the model's layer count (`num_hidden_layers`, `same_model`): `max(moe_layers) + 1` is what a shape
says when its writer did not know the count (rows.md 2.0 and older, or a writer that never asked the
model), and it is also the count of a model whose last layer has a router, so that value agrees
with any other. A run that has only that count learns a larger one from the first batch that
states it (its model-layer axis widens, dense layers at the end); two different larger counts are
a Conflict.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from replay_format import RunShape
from replay_format.rows import RowsMeta
from replay_service.errors import Conflict, NotFound
from replay_service.store.index import Index, Row


@dataclass
class RunState:
    """What ingest needs of a run, in memory."""

    run_id: str
    shape: RunShape
    load: np.ndarray  # (num_moe_layers, num_experts) int64: served clean rows' expert counts
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the commit stage
    deleted: bool = False  # set (under `lock`) when the run was deleted: this state is stale


class RunRegistry:
    """Runs by id: read from the index on first use, created by `for_batch`."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._runs: dict[str, RunState] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str) -> RunState | None:
        """The run, or None when it does not exist."""
        with self._lock:
            state = self._runs.get(run_id)
            if state is None:
                state = self._load(run_id)
            return state

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
        with self._lock:
            state = self._runs.get(meta.run_id) or self._load(meta.run_id)
            if state is None and self.index.register_run(meta.run_id, meta.shape, meta.source.value, time.time()):
                return self._remember(meta.run_id, meta.shape, None)
            if state is None:  # another replica created it meanwhile (a shared index): its row decides the shape
                state = self._load(meta.run_id)
                assert state is not None
            have, got = state.shape, meta.shape
            if not same_rows(have, got):
                raise Conflict(
                    f"run {meta.run_id!r} stores rows of {have.num_moe_layers} layers x top-{have.top_k} "
                    f"of {have.num_experts} experts (MoE layers {list(have.moe_layers)}); this batch has "
                    f"{got.num_moe_layers} x top-{got.top_k} of {got.num_experts} (MoE layers {list(got.moe_layers)})")
            hidden = same_model(have, got, meta.run_id)
            if hidden != have.num_hidden_layers:
                self.index.set_num_hidden_layers(meta.run_id, hidden)
                state.shape = dataclasses.replace(have, num_hidden_layers=hidden)
        return state

    def forget(self, run_id: str) -> None:
        """Drop a deleted run's state: the next batch of this id creates a fresh run."""
        with self._lock:
            self._runs.pop(run_id, None)

    def _load(self, run_id: str) -> RunState | None:
        row = self.index.run(run_id)
        if row is None:
            return None
        return self._remember(run_id, shape_of(row), row["load"])

    def _remember(self, run_id: str, shape: RunShape, load_bytes: bytes | None) -> RunState:
        load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
        if load_bytes is not None:
            load[:] = np.frombuffer(load_bytes, np.int64).reshape(load.shape)
        state = RunState(run_id, shape, load)
        self._runs[run_id] = state
        return state


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
