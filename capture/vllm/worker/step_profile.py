"""Runs in a vLLM worker, only when asked (bench/vllm_overhead.py --profile): time spent per part of the hooks.

`StepProfile.install(hooks, chains)` wraps this worker's `StepHooks` methods, its recorder's
and hand-off's per-step methods, and the module functions they call, each in a
`perf_counter_ns` counter (instance attributes and module globals: nothing changes for a
worker that never installs it). Parts nest (`on_sampled` holds `end_step`, `pack`, ...), so
the table is read as a tree, not summed. The router callback (`hooks.on_topk`) is timed in each
router's `ChainedCapture` (`WorkerCapture.chains`). Each wrapper adds well under a
microsecond per call; the bench reports the plain `hook_s` figures from runs without it.
"""

from __future__ import annotations

import functools
import time
from typing import Any

# (owner kind, attribute): which calls are timed. "hooks" is the StepHooks instance,
# "recorder" / "frame" / "handoff" its members, a module path a module global.
PARTS: tuple[tuple[str, str], ...] = (
    ("hooks", "on_execute"),
    ("hooks", "open_step"),
    ("hooks", "close_forward"),
    ("hooks", "on_sampled"),
    ("recorder", "begin_step"),
    ("recorder", "keep"),
    ("recorder", "end_step_into"),
    ("recorder", "end_step"),
    ("frame", "open"),
    ("frame", "close"),
    ("handoff", "step_packed"),
    ("handoff", "_send"),
    ("capture.vllm.worker.step_hooks", "spec_counts"),
)


class StepProfile:
    """Nanoseconds and calls per timed part (module docstring)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        # Every call's time, for the median: on a loaded machine a descheduled call inflates the mean.
        self.each: dict[str, list[int]] = {}
        self._undo: list[tuple[Any, str, Any, bool]] = []  # (owner, name, previous, was an instance attribute)

    def _timed(self, label: str, fn):
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns
        ns.setdefault(label, 0)
        calls.setdefault(label, 0)
        each = self.each.setdefault(label, []).append

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                spent = clock() - t0
                ns[label] += spent
                calls[label] += 1
                each(spent)

        return timed

    def install(self, hooks, chains=()) -> None:
        """Wrap the parts of `hooks` (a worker's StepHooks) and its routers' `chains` in counters; `uninstall` undoes
        it."""
        import importlib

        self.uninstall()
        for kind, name in PARTS:
            if kind == "hooks":
                owner = hooks
            elif kind in ("recorder", "handoff", "frame"):
                owner = getattr(hooks, kind, None)
            else:
                owner = importlib.import_module(kind)
            if owner is None or not hasattr(owner, name):  # e.g. a member this worker does not have
                continue
            label = f"{kind.rsplit('.', 1)[-1]}.{name}"
            own = name in vars(owner) if not isinstance(owner, type(importlib)) else True
            previous = getattr(owner, name)
            self._undo.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, self._timed(label, previous))
        for chain in chains:  # ChainedCapture has slots: always its own attribute
            self._undo.append((chain, "ours", chain.ours, True))
            chain.ours = self._timed("hooks.on_topk", chain.ours)
        self._install_references(hooks)

    def _install_references(self, hooks) -> None:
        """After each step close, time single reference calls at the same point of the step.

        What one bare call costs there (a Python call, one numpy reduction, one numpy copy, one
        torch.stack, one tensor.numpy()) is the unit the parts above are made of: the floor."""
        import numpy as np
        import torch

        tiny = np.zeros((2, 8, 2), np.int32)
        out = np.zeros((8, 2, 2), np.uint8)
        pair = [torch.zeros((8, 2), dtype=torch.int32) for _ in range(2)]
        refs = [self._timed("reference.python_call", lambda: None),
                self._timed("reference.np_maximum_reduce", lambda: np.maximum.reduce(tiny, axis=None)),
                self._timed("reference.np_copyto", lambda: np.copyto(out, tiny.transpose(1, 0, 2), casting="unsafe")),
                self._timed("reference.torch_stack", lambda: torch.stack(pair)),
                self._timed("reference.tensor_numpy", pair[0].numpy)]
        inner = hooks.on_sampled

        def on_sampled(output, read_counts):
            try:
                return inner(output, read_counts)
            finally:
                for ref in refs:
                    ref()

        on_sampled.__wrapped__ = inner  # type: ignore[attr-defined]
        hooks.on_sampled = on_sampled

    def uninstall(self) -> None:
        """Put back every wrapped attribute."""
        while self._undo:
            owner, name, previous, own = self._undo.pop()
            if own:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)

    def report(self, steps: int) -> dict[str, dict[str, float]]:
        """Per part: microseconds per step (mean), per call (mean and median), and calls per step."""
        import statistics

        steps = max(steps, 1)
        return {label: {"us_per_step": round(ns / 1e3 / steps, 2),
                        "us_per_call": round(ns / 1e3 / max(self.calls[label], 1), 2),
                        "median_us_per_call": round(statistics.median(self.each[label]) / 1e3, 2),
                        "calls_per_step": round(self.calls[label] / steps, 2)}
                for label, ns in self.ns.items() if self.calls[label]}
