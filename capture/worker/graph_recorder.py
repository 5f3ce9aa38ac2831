"""GraphStepRecorder: a step recorder whose per-layer write is graph safe (CUDA graphs, torch.compile).

Runs in the inference worker (torch). Engine neutral: `begin_step()` (eager prologue: sets the device step
counter), `write(layer_idx, rows)` inside the forward or a captured graph (fixed-shape device copies of the ids and
the counter; no host sync, no use of the real token count), `start_close(n_real)` after the forward (async copy to
pinned memory), `end_step_into(experts)` off the forward path (wait, flag, fill `[n_real, L, K]`). Its rows mean
what `StepRecorder`'s do (STALE for unwritten or out-of-range rows), except that it cannot see a layer written twice
or one that wrote more rows than the step has. On CPU the same code runs eagerly and the close is a plain copy.

Design: docs/design/capture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from replay_format import NO_TOKEN, Flag, RunShape

if TYPE_CHECKING:  # imported by end_step: the worker's path (end_step_into) and the device check need no Arrow
    from .recorder import RecordedStep

_TORCH_DTYPE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


class GraphStepRecorder:
    """Per-step routing recorder with graph-safe writes (see module docstring)."""

    def __init__(self, shape: RunShape, max_tokens: int, device: str | torch.device = "cpu") -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.shape = shape
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.np_dtype = shape.dtype
        self.dtype = _TORCH_DTYPE[self.np_dtype]
        self.num_experts = int(shape.num_experts)
        self.sentinel = int(np.iinfo(self.np_dtype).max)
        L, K = shape.num_moe_layers, shape.top_k
        self.step = 0  # the host's copy of the counter (what a clean stamp must equal)
        self._open = False
        self._closing = 0  # rows copied by start_close (-1: not started)
        # Allocated once, never reallocated: a captured graph holds their addresses.
        self.ids = torch.zeros((max_tokens, L, K), dtype=self.dtype, device=self.device)
        # stamps[row, layer]: the step that wrote it, -step if that write held an invalid id, 0 never.
        # Row-major like `ids`, so rows 0..n-1 are one contiguous block to copy out.
        self.stamps = torch.zeros((max_tokens, L), dtype=torch.int64, device=self.device)
        self.counter = torch.zeros((), dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda"
        # Where the close copies to; on CPU a separate copy too, so a later step's writes cannot change it.
        self._host_ids = torch.zeros((max_tokens, L, K), dtype=self.dtype, pin_memory=pinned)
        self._host_stamps = torch.zeros((max_tokens, L), dtype=torch.int64, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None
        self._positions = np.zeros(0, np.int32)

    # ---- the forward path --------------------------------------------------

    def begin_step(self) -> int:
        """Start a step (eager, before the forward or a graph replay); returns its stamp (1, 2, ...).

        `fill_` of the device counter: one kernel on the current stream, ordered before the
        forward's (and a replayed graph's) writes, no host sync."""
        self.step += 1
        self.counter.fill_(self.step)
        self._open = True
        self._closing = -1
        return self.step

    def write(self, layer_idx: int, rows: torch.Tensor) -> None:
        """Write one MoE layer's rows `[n_padded, K]` (this step's rows first, then padding) at rows 0..n_padded-1.

        Fixed-shape device work only (module docstring): safe to capture in a CUDA graph and to
        trace with `torch.compile(fullgraph=True)`. `layer_idx` is a Python int fixed per layer;
        `rows` must be on the recorder's device with integer ids."""
        n = min(rows.shape[0], self.max_tokens)  # static: the padded size a graph was captured at
        rows = rows[:n]
        ok = (rows >= 0) & (rows < self.num_experts)
        self.ids[:n, layer_idx] = torch.where(ok, rows, self.sentinel).to(self.dtype)
        self.stamps[:n, layer_idx] = torch.where(ok.all(dim=1), self.counter, -self.counter)

    # ---- the close (off the forward path) ----------------------------------

    def start_close(self, n: int) -> None:
        """Start copying rows 0..n-1 (this step's real rows) to host memory; asynchronous on a device.

        Call once the forward has been issued (a replay included); `end_step_into` waits for it."""
        if not self._open:
            return
        n = max(0, min(int(n), self.max_tokens))
        if self.device.type == "cuda":
            self._host_ids[:n].copy_(self.ids[:n], non_blocking=True)
            self._host_stamps[:n].copy_(self.stamps[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied = event
        else:
            self._host_ids[:n].copy_(self.ids[:n])
            self._host_stamps[:n].copy_(self.stamps[:n])
        self._closing = n

    def end_step_into(self, experts: np.ndarray) -> np.ndarray | None:
        """Close the step into `experts` (`[n, L, K]`, the run's dtype); None when every row is clean, else flags.

        Same contract as `StepRecorder.end_step_into`: the flags are uint16 `[n]`."""
        n = experts.shape[0]
        stale, _invalid = self._close(n)
        experts[...] = self._host_ids[:n].numpy()
        if not stale.any():
            return None
        return stale.astype(np.uint16) * np.uint16(Flag.STALE)

    def end_step(self, request_ids, positions, token_ids=None) -> RecordedStep:
        """Rows 0..len(positions)-1 of this step as a `RecordedStep` (the eager recorder's `end_step`)."""
        from .recorder import RecordedStep

        positions = np.asarray(positions, dtype=np.int32)
        n = positions.shape[0]
        stale, invalid = self._close(n)
        experts = self._host_ids[:n].numpy().copy()
        tokens = np.full(n, NO_TOKEN, np.int32) if token_ids is None else np.asarray(token_ids, dtype=np.int32)
        return RecordedStep(self.step, request_ids, positions, tokens, experts,
                            stale.astype(np.uint16) * np.uint16(Flag.STALE),
                            stale_rows=int(np.count_nonzero(stale)), invalid_rows=int(np.count_nonzero(invalid)))

    def _close(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(stale [n], invalid [n]) of this step's first n rows, once they are on the host."""
        if not self._open:
            raise RuntimeError("end of a step outside a step: call begin_step() first")
        if n > self.max_tokens:
            self._open = False
            raise ValueError(f"{n} rows exceed max_tokens {self.max_tokens}")
        if self._closing != n:  # not started, or for another count: copy now
            self.start_close(n)
        if self._copied is not None:
            self._copied.synchronize()  # waits for this copy only (and what the stream ran before it)
            self._copied = None
        self._open = False
        stamps = self._host_stamps[:n].numpy()
        oldest = stamps.min(axis=1) if stamps.shape[1] else np.full(n, self.step, np.int64)
        # Every stamp is <= step and -step is the least, so one min per row answers both questions.
        return oldest != self.step, oldest == -self.step
