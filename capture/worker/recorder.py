"""StepRecorder: one step's routing rows, with a per-(row, layer) write stamp.

Runs in the inference worker (torch; the router's callback writes into it). `begin_step()`, then
`record(layer_idx, rows)` per MoE layer (restored `[n, K]` ids, any int dtype), then
`end_step(request_ids, positions, token_ids)` -> `RecordedStep` (experts `[n, L, K]` + flags). Buffers are allocated
once. A row any layer of which was not written this step, a step with more rows recorded than it has, and an id
outside `[0, num_experts)` (stored as the dtype's maximum, never cast) are flagged `Flag.STALE`, never silent data.
Nothing raises mid-step: a capture bug must not take the inference engine down.

Design: docs/design/capture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replay_format import NO_TOKEN, Flag, RunShape
from replay_format.rows import RowsMeta, build_rows

_TORCH_DTYPE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}
_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}  # same width, read as unsigned
_MAX = np.maximum.reduce


@dataclass
class RecordedStep:
    """One step's rows as the recorder closed it, ready for `replay_format.rows.build_rows` (`to_batch`)."""

    step: int
    request_ids: object  # per row: list/array of str or a pyarrow DictionaryArray; None when the caller keeps them
    positions: np.ndarray  # int32 [n]
    token_ids: np.ndarray  # int32 [n], NO_TOKEN where unknown
    experts: np.ndarray  # [n, L, K] uint8/uint16
    flags: np.ndarray  # uint16 [n]
    stale_rows: int  # rows flagged STALE
    invalid_rows: int  # rows with an id outside [0, num_experts) (also STALE)

    def __len__(self) -> int:
        return len(self.positions)

    def to_batch(self, meta: RowsMeta):
        """The rows as one row batch (rows.md) carrying `meta`."""
        return build_rows(meta, self.request_ids, self.positions, self.experts, self.token_ids, self.flags)


class StepRecorder:
    """Per-step routing recorder (see module docstring)."""

    def __init__(self, shape: RunShape, max_tokens: int, device: str | torch.device = "cpu",
                 staged: bool | None = None) -> None:
        """`staged`: the CPU stage (default on CPU); False keeps torch buffers (the device path)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.shape = shape
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.np_dtype = shape.dtype
        self.dtype = _TORCH_DTYPE[self.np_dtype]
        self.sentinel = int(np.iinfo(self.np_dtype).max)
        L, K = shape.num_moe_layers, shape.top_k
        self.step = 0
        self._open = False
        self._layer_rows = [0] * L
        self._kept: list[tuple[int, torch.Tensor]] = []
        self._misaligned = False
        self._every_layer = list(range(L))
        self._layer_order = tuple(self._every_layer)
        self._positions = np.zeros(max_tokens, np.int32)  # end_step_into's stand-in positions (only n counts)
        if staged is None:
            staged = self.device.type == "cpu"
        if staged and self.device.type != "cpu":
            raise ValueError("the staged recorder is CPU only")
        if staged:
            # CPU: each layer's ids go as they are into a layer-major int64 stage and the
            # layer's row count is its write stamp (rows 0..n-1 are always what it wrote);
            # the range check, narrowing and STALE flags run once per step in end_step.
            # Per layer that is one numpy copy: inside the engine every numpy or torch call
            # costs microseconds, and decode steps are short (docs/vllm_notes.md).
            self._stage: np.ndarray | None = np.zeros((L, max_tokens, K), np.int64)
            return
        self._stage = None
        self.buffer = torch.zeros((max_tokens, L, K), dtype=self.dtype, device=self.device)
        # stamps[layer, row]: the step that wrote it, -step if that step's ids were invalid, 0 never.
        # Every value is <= the current step and -step is the least, so one min per row answers both.
        self.stamps = torch.zeros((L, max_tokens), dtype=torch.int64, device=self.device)

    def begin_step(self) -> int:
        """Start a step; returns its stamp (1, 2, ...)."""
        self.step += 1
        self._open = True
        self._layer_rows = [0] * self.shape.num_moe_layers
        self._kept = []
        self._misaligned = False
        return self.step

    def keep(self, layer_idx: int, rows: torch.Tensor) -> None:
        """Record a layer's CPU rows by reference: end_step copies every kept layer in one call.

        For an engine hook, where each per-layer call costs: one list append. The caller
        promises nothing writes to `rows` before end_step (vLLM's router returns a new
        tensor per layer). Rows past the step's count are the engine's padding, dropped.
        Checked at end_step as `record` checks (a layer kept twice makes the step STALE).
        """
        self._kept.append((layer_idx, rows))

    def record(self, layer_idx: int, rows: torch.Tensor | np.ndarray) -> None:
        """Write one MoE layer's restored rows `[n, K]` at rows 0..n-1 for this step."""
        if not self._open:
            raise RuntimeError("record() outside a step: call begin_step() first")
        L, K = self.shape.num_moe_layers, self.shape.top_k
        if not 0 <= layer_idx < L:
            raise ValueError(f"layer_idx {layer_idx} outside 0..{L - 1}")
        if self._stage is not None and (isinstance(rows, np.ndarray) or rows.device.type == "cpu"):
            ids = rows if isinstance(rows, np.ndarray) else rows.numpy()
            if ids.ndim != 2 or ids.shape[1] != K:
                raise ValueError(f"rows must be [n, {K}], got {tuple(ids.shape)}")
            if ids.dtype.kind not in "iu":
                raise ValueError(f"rows must hold integer ids, got {rows.dtype}")
            n = ids.shape[0]
            if n > self.max_tokens:
                raise ValueError(f"{n} rows exceed max_tokens {self.max_tokens}")
            self._stage[layer_idx, :n] = ids
            if n > self._layer_rows[layer_idx]:
                self._layer_rows[layer_idx] = n
            return
        if isinstance(rows, np.ndarray):
            rows = torch.from_numpy(rows)
        if rows.dim() != 2 or rows.shape[1] != K:
            raise ValueError(f"rows must be [n, {K}], got {tuple(rows.shape)}")
        if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise ValueError(f"rows must hold integer ids, got {rows.dtype}")
        n = rows.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"{n} rows exceed max_tokens {self.max_tokens}")
        self._layer_rows[layer_idx] = max(self._layer_rows[layer_idx], n)
        if n == 0:
            return
        if rows.device != self.device:
            rows = rows.to(self.device, non_blocking=True)
        if rows.dtype not in (torch.int32, torch.int64):
            rows = rows.to(torch.int32)
        ok = (rows >= 0) & (rows < self.shape.num_experts)
        self.buffer[:n, layer_idx].copy_(torch.where(ok, rows, self.sentinel))
        self.stamps[layer_idx, :n].copy_(torch.where(ok.all(dim=1), self.step, -self.step))

    def end_step(self, request_ids, positions, token_ids=None, *, copy: bool = True) -> RecordedStep:
        """Rows 0..len(positions)-1 of this step: experts, flags and the given identities.

        The experts array is the caller's (on CPU always a new array; on a device
        `copy=False` may return a view of the buffer, valid until the next step).
        `request_ids` may be None when the caller tracks identities itself; `token_ids`
        None means every token is unknown (NO_TOKEN)."""
        if not self._open:
            raise RuntimeError("end_step() outside a step: call begin_step() first")
        positions = np.asarray(positions, dtype=np.int32)
        n = positions.shape[0]
        if n > self.max_tokens:
            self._open = False
            raise ValueError(f"{n} positions exceed max_tokens {self.max_tokens}")
        if (request_ids is not None and len(request_ids) != n) or (token_ids is not None and len(token_ids) != n):
            self._open = False
            raise ValueError(f"{n} positions but {len(request_ids)} request ids / token ids of another length")
        try:
            whole = self._take_kept(n) if self._kept else None
        finally:
            self._open = False
        tokens = np.full(n, NO_TOKEN, np.int32) if token_ids is None else np.asarray(token_ids, dtype=np.int32)
        if self._stage is not None:
            clean = self._clean_step_cpu(n, whole)
            if clean is not None:  # the usual step: no flag to compute
                return RecordedStep(self.step, request_ids, positions, tokens, clean, np.zeros(n, np.uint16),
                                    stale_rows=0, invalid_rows=0)
            experts, stale, invalid = self._end_step_cpu(n)
        else:
            oldest = self.stamps[:, :n].amin(dim=0).cpu().numpy() if n else np.zeros(0, np.int64)
            experts = self.buffer[:n].cpu().numpy()
            experts = experts.copy() if copy and self.device.type == "cpu" else experts
            invalid = oldest == -self.step
            stale = oldest != self.step
        if self._misaligned or max(self._layer_rows) > n:  # rows do not line up with the step's
            stale[:] = True
        flags = stale.astype(np.uint16) * np.uint16(Flag.STALE)
        return RecordedStep(
            step=self.step,
            request_ids=request_ids,
            positions=positions,
            token_ids=tokens,
            experts=experts,
            flags=flags,
            stale_rows=int(np.count_nonzero(stale)),
            invalid_rows=int(np.count_nonzero(invalid)),
        )

    def end_step_into(self, experts: np.ndarray) -> np.ndarray | None:
        """Close the step writing its experts into `experts` (`[n, L, K]`, the run's dtype; e.g. a frame's slot).

        Returns None when every row is clean (all flags zero), else the flags (uint16 [n]) as
        `end_step` computes them. The usual CPU step (every layer kept once, in order, in range)
        is one stack, one range check and one narrowing copy; anything else goes through
        `end_step` with its checks and the result is copied into `experts`.
        """
        n = experts.shape[0]
        kept = self._kept
        if (self._open and self._stage is not None and len(kept) == len(self._every_layer) and not self._misaligned
                and n <= self.max_tokens):
            layers, rows = zip(*kept)
            if layers == self._layer_order:
                try:
                    stacked = torch.stack(rows).numpy()
                except RuntimeError:  # shapes differ: the general path says how
                    stacked = None
                if (stacked is not None and stacked.shape[1] >= n and stacked.shape[2] == self.shape.top_k
                        and stacked.dtype.kind in "iu"):
                    block = stacked[:, :n]
                    if not n or self._in_range(block):
                        self._kept = []
                        self._open = False
                        np.copyto(experts, block.transpose(1, 0, 2), casting="unsafe")
                        return None
        if n > len(self._positions):
            self._positions = np.zeros(n, np.int32)
        step = self.end_step(None, self._positions[:n])
        experts[...] = step.experts
        return step.flags if step.stale_rows else None

    def _take_kept(self, n: int) -> np.ndarray | None:
        """Copy the kept layers' rows; returns them as `[L, n, K]` when they are the whole step."""
        kept, self._kept = self._kept, []
        layers = [layer for layer, _ in kept]
        repeated = len(set(layers)) != len(layers)
        if repeated or len({tuple(rows.shape) for _, rows in kept}) != 1 or self._stage is None:
            self._misaligned |= repeated
            for layer, rows in kept:  # the general path, with its checks
                self.record(layer, rows[:n])
            return None
        stacked = torch.stack([rows for _, rows in kept]).numpy()[:, :n]
        if stacked.ndim != 3 or stacked.shape[2] != self.shape.top_k or stacked.dtype.kind not in "iu":
            raise ValueError(f"kept rows must be [n, {self.shape.top_k}] integer ids, got {tuple(stacked.shape[1:])} "
                             f"{stacked.dtype}")
        rows = stacked.shape[1]
        if layers == self._every_layer and rows == n:
            self._layer_rows = [n] * len(layers)
            return stacked
        self._stage[layers, :rows] = stacked
        for layer in layers:
            self._layer_rows[layer] = max(self._layer_rows[layer], rows)
        return None

    def _clean_step_cpu(self, n: int, whole: np.ndarray | None) -> np.ndarray | None:
        """The step's experts when every layer wrote exactly its n rows, all in range; else None."""
        if not n or self._misaligned or self._layer_rows.count(n) != len(self._layer_rows):
            return None
        stage = self._stage
        assert stage is not None  # the CPU path
        block = stage[:, :n] if whole is None else whole
        if not self._in_range(block):
            if whole is not None:
                stage[:, :n] = whole  # the flagging path reads the stage
            return None
        return np.ascontiguousarray(block.transpose(1, 0, 2), self.np_dtype)

    def _in_range(self, block: np.ndarray) -> bool:
        """Every id in [0, num_experts): one max over the ids read as unsigned (a negative one is huge).

        `np.maximum.reduce` and a prebuilt dtype: `ndarray.max` and a dtype from a string each add
        microseconds per call, and this runs once per step inside the engine."""
        unsigned = _UNSIGNED.get(block.dtype)
        return bool(_MAX(block.view(unsigned) if unsigned is not None else block, axis=None) < self.shape.num_experts)

    def _end_step_cpu(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(experts [n, L, K], stale [n], invalid [n]) from the stage."""
        assert self._stage is not None  # the CPU path
        block = self._stage[:, :n]
        written = min(self._layer_rows)  # rows every layer wrote this step
        stale = np.arange(n) >= written
        if not n or self._in_range(block):
            return np.ascontiguousarray(block.transpose(1, 0, 2), self.np_dtype), stale, np.zeros(n, np.bool_)
        # An id outside [0, E): stored as the sentinel, never cast; its row is STALE.
        # Only what a layer wrote this step counts (rows past it are stale already).
        this_step = np.arange(n)[None, :] < np.array(self._layer_rows)[:, None]  # [L, n]
        out_of_range = (block < 0) | (block >= self.shape.num_experts)
        experts = np.where(out_of_range, self.sentinel, block).transpose(1, 0, 2)
        invalid = np.asarray((out_of_range & this_step[:, :, None]).any(axis=(0, 2)))
        return np.ascontiguousarray(experts, self.np_dtype), stale | invalid, invalid
