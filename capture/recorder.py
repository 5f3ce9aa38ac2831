"""StepRecorder: one step's routing rows, with a per-(row, layer) write stamp.

    rec = StepRecorder(RunShape(num_layers=48, top_k=8, num_experts=128), max_tokens=8192)
    rec.begin_step()
    rec.record(layer_idx, rows)          # per MoE layer (0..L-1): restored [n, K] ids, any int dtype
    out = rec.end_step(request_ids, positions, token_ids)   # StepRows: experts [n, L, K] + flags

The buffer `[max_tokens, L, K]` (uint8/uint16, `replay_schema.expert_dtype`) and the stamps
(int64 step counter per (row, layer), stored layer-major) are allocated once; `record` writes rows `0..n-1` of
one layer and stamps them with the step. `end_step` flags `Flag.STALE` every row any layer
of which was not stamped this step, so a layer that wrote only a TP shard (seed 002), or
rows left from an earlier step, arrive flagged, never as silent data. If a layer recorded
more rows than the step has, the rows do not line up with the scheduler's and the whole
step is flagged STALE.

Ids outside `[0, num_experts)` (e.g. a `-1` padding id) are never cast: that element is
stored as the dtype's maximum (255 / 65535), the (row, layer) is stamped "invalid" rather
than written, and the row is flagged STALE (a writer flag the service keeps; its own range
check adds OUT_OF_RANGE whenever num_experts is below 256 / 65536). Nothing raises
mid-step: a capture bug must not take the inference engine down. On CPU a min/max check
picks a plain copy for clean rows; elsewhere the check runs on the device without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replay_schema import BatchMeta, Flag, RunShape, build_batch

_TORCH_DTYPE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


@dataclass
class StepRows:
    """One step's rows, ready for `replay_schema.build_batch` (`to_batch`)."""

    step: int
    request_ids: object  # per row: list/array of str or a pyarrow DictionaryArray
    positions: np.ndarray  # int32 [n]
    token_ids: np.ndarray | None  # int32 [n]
    experts: np.ndarray  # [n, L, K] uint8/uint16
    flags: np.ndarray  # uint16 [n]
    stale_rows: int  # rows flagged STALE
    invalid_rows: int  # rows with an id outside [0, num_experts) (also STALE)

    def __len__(self) -> int:
        return len(self.positions)

    def to_batch(self, meta: BatchMeta):
        return build_batch(meta, self.request_ids, self.positions, self.experts, self.token_ids, self.flags)


class StepRecorder:
    """Per-step routing recorder (see module docstring)."""

    def __init__(self, shape: RunShape, max_tokens: int, device: str | torch.device = "cpu") -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.shape = shape
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.np_dtype = shape.dtype
        self.dtype = _TORCH_DTYPE[self.np_dtype]
        self.sentinel = int(np.iinfo(self.np_dtype).max)
        self.moe_index = {layer: i for i, layer in enumerate(shape.moe_layers)}  # model layer -> MoE index
        L, K = shape.num_layers, shape.top_k
        self.buffer = torch.zeros((max_tokens, L, K), dtype=self.dtype, device=self.device)
        # stamps[layer, row]: the step that wrote it, -step if that step's ids were invalid, 0 never.
        # Every value is <= the current step and -step is the least, so one min per row answers both.
        self.stamps = torch.zeros((L, max_tokens), dtype=torch.int64, device=self.device)
        # On CPU, numpy views of the same memory: a few numpy calls per layer cost far less
        # than torch's per-op dispatch on the small per-step tensors of decode.
        self._np_views = (self.buffer.numpy(), self.stamps.numpy()) if self.device.type == "cpu" else None
        self.step = 0
        self._open = False
        self._layer_rows = [0] * L

    def begin_step(self) -> int:
        """Start a step; returns its stamp (1, 2, ...)."""
        self.step += 1
        self._open = True
        self._layer_rows = [0] * self.shape.num_layers
        return self.step

    def record(self, layer_idx: int, rows: torch.Tensor) -> None:
        """Write one MoE layer's restored rows `[n, K]` at rows 0..n-1 with this step's stamp."""
        if not self._open:
            raise RuntimeError("record() outside a step: call begin_step() first")
        L, K, E = self.shape.num_layers, self.shape.top_k, self.shape.num_experts
        if not 0 <= layer_idx < L:
            raise ValueError(f"layer_idx {layer_idx} outside 0..{L - 1}")
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
        if self._np_views is not None and rows.device.type == "cpu":
            ids = rows.numpy()
            if int(ids.min()) >= 0 and int(ids.max()) < E:
                buffer, stamps = self._np_views
                buffer[:n, layer_idx] = ids
                stamps[layer_idx, :n] = self.step
                return
        if rows.device != self.device:
            rows = rows.to(self.device, non_blocking=True)
        if rows.dtype not in (torch.int32, torch.int64):
            rows = rows.to(torch.int32)
        dst, stamp = self.buffer[:n, layer_idx], self.stamps[layer_idx, :n]
        if rows.device.type == "cpu":
            lo, hi = torch.aminmax(rows)
            if int(lo) >= 0 and int(hi) < E:
                dst.copy_(rows)
                stamp.fill_(self.step)
                return
        ok = (rows >= 0) & (rows < E)
        dst.copy_(torch.where(ok, rows, self.sentinel))
        stamp.copy_(torch.where(ok.all(dim=1), self.step, -self.step))

    def end_step(self, request_ids, positions, token_ids=None, *, copy: bool = True) -> StepRows:
        """Rows 0..len(positions)-1 of this step: experts, flags and the given identities.

        `copy=False` returns a view of the buffer (CPU only), valid until the next step.
        `request_ids` may be None when the caller tracks identities itself."""
        if not self._open:
            raise RuntimeError("end_step() outside a step: call begin_step() first")
        self._open = False
        positions = np.asarray(positions, dtype=np.int32)
        n = positions.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"{n} rows exceed max_tokens {self.max_tokens}")
        if (request_ids is not None and len(request_ids) != n) or (token_ids is not None and len(token_ids) != n):
            raise ValueError(f"{n} positions but {len(request_ids)} request ids / token ids of another length")
        if self.device.type == "cpu":  # numpy reduces these far faster than torch on CPU
            oldest = self.stamps[:, :n].numpy().min(axis=0) if n else np.zeros(0, np.int64)
            experts = self.buffer[:n].numpy()
            experts = experts.copy() if copy else experts
        else:
            oldest = self.stamps[:, :n].amin(dim=0).cpu().numpy() if n else np.zeros(0, np.int64)
            experts = self.buffer[:n].cpu().numpy()
        stale = oldest != self.step
        if max(self._layer_rows) > n:  # a layer wrote more rows than the step has: misaligned
            stale[:] = True
        flags = stale.astype(np.uint16) * np.uint16(Flag.STALE)
        return StepRows(
            step=self.step,
            request_ids=request_ids,
            positions=positions,
            token_ids=None if token_ids is None else np.asarray(token_ids, dtype=np.int32),
            experts=experts,
            flags=flags,
            stale_rows=int(np.count_nonzero(stale)),
            invalid_rows=int(np.count_nonzero(oldest == -self.step)),
        )
