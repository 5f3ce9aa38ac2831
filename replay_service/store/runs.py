"""The run registry: each run's shape, expert load and ingest lock, loaded from the index once and kept.

A run is created by its first batch; every later batch must have the same shape.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from replay_format import RunShape
from replay_format.rows import RowsMeta
from replay_service.errors import Conflict, NotFound
from replay_service.store.index import Index


@dataclass
class RunState:
    """What ingest needs of a run, in memory."""

    run_id: str
    shape: RunShape
    load: np.ndarray  # (num_moe_layers, num_experts) int64: served clean rows' expert counts
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the commit stage


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
        """The batch's run, created with the batch's shape when new; Conflict when the shapes differ."""
        with self._lock:
            state = self._runs.get(meta.run_id) or self._load(meta.run_id)
            if state is None:
                self.index.register_run(meta.run_id, meta.shape, meta.source.value, time.time())
                state = self._remember(meta.run_id, meta.shape, None)
        if state.shape != meta.shape:
            have, got = state.shape, meta.shape
            raise Conflict(
                f"run {meta.run_id!r} stores rows of {have.num_moe_layers} layers x top-{have.top_k} "
                f"of {have.num_experts} experts (MoE layers {list(have.moe_layers)}); this batch has "
                f"{got.num_moe_layers} x top-{got.top_k} of {got.num_experts} (MoE layers {list(got.moe_layers)})")
        return state

    def _load(self, run_id: str) -> RunState | None:
        row = self.index.run(run_id)
        if row is None:
            return None
        shape = RunShape(row["num_moe_layers"], row["top_k"], row["num_experts"], tuple(json.loads(row["moe_layers"])))
        return self._remember(run_id, shape, row["load"])

    def _remember(self, run_id: str, shape: RunShape, load_bytes: bytes | None) -> RunState:
        load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
        if load_bytes is not None:
            load[:] = np.frombuffer(load_bytes, np.int64).reshape(load.shape)
        state = RunState(run_id, shape, load)
        self._runs[run_id] = state
        return state
