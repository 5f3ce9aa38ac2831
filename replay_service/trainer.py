"""Trainer side: one rank's routes in the layout its router needs (numpy/pyarrow/httpx; torch lazily).

    from replay_service.client import ReplayClient
    client = ReplayClient(url)
    batch = client.megatron_batch([("run-1", "req-7"), ("run-1", "req-8")], packing="thd",
                                  cp_size=2, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank)
    RouterReplay.set_replay_data(batch.replay_data())     # one [tokens, top_k] int64 tensor per MoE layer
    loss_mask = batch.valid_tensor()                      # False: padding, last token, flagged rows
    verl = client.verl_batch([...], prompt_lengths=[...], prompt_width=P, response_width=R)
    routes, mask = verl.dense(), verl.mask()              # [batch, seq, L, K] and [batch, seq]

Every token without a clean recorded row (padding, the last token of a sequence,
a flagged or missing row) carries router-valid filler ids (distinct, never all
zero; see `layouts.filler_rows`) and `valid == 0`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import Flag, RunShape

from replay_format.rows import RowsMeta, build_rows, encode_stream


def _view(array: pa.Array, backing: bytearray, base: int, dtype: np.dtype) -> np.ndarray:
    buf = array.buffers()[1]
    start = buf.address + array.offset * dtype.itemsize - base
    if 0 <= start and start + len(array) * dtype.itemsize <= len(backing):
        return np.frombuffer(backing, dtype=dtype, count=len(array), offset=start)
    return array.to_numpy(zero_copy_only=False)


@dataclass
class TrainerBatch:
    """One rank's router tokens, in the router's order."""

    experts: np.ndarray  # (m, L_stage, K) uint8/uint16, a view of the received body
    valid: np.ndarray  # (m,) uint8: 1 = clean recorded row
    sequence: np.ndarray  # (m,) int32: index into the micro-batch, -1 for padding
    position: np.ndarray  # (m,) int32: position in its request, -1 for padding
    layers: list[int]  # MoE ordinals held
    moe_layers: list[int]  # their model-layer indices
    num_experts: int
    layout: dict

    @property
    def num_tokens(self) -> int:
        return len(self.valid)

    def replay_data(self, device=None):
        """The list `RouterReplay.set_replay_data` takes: one contiguous int64 `[tokens, top_k]` per MoE layer.

        With `device` (e.g. "cuda"), the uint8/uint16 ids travel to it first and widen there:
        8x fewer bytes over PCIe than moving int64, and no 8x host copy.
        """
        import torch

        m, num_layers, top_k = self.experts.shape
        ids = torch.from_numpy(self.experts)
        if device is not None:
            ids = ids.to(device)
        out = torch.empty((num_layers, m, top_k), dtype=torch.int64, device=ids.device)
        out.copy_(ids.permute(1, 0, 2))
        return list(out.unbind(0))

    def torch(self):
        """`(m, L_stage, K)` ids as a torch tensor sharing this batch's memory."""
        import torch

        return torch.from_numpy(self.experts)

    def valid_tensor(self):
        import torch

        return torch.from_numpy(self.valid.astype(np.bool_))

    # ---- verl -------------------------------------------------------------

    def dense(self):
        """verl: `[batch, prompt_width + response_width, L, K]` (a view, run dtype; `.long()` for int64)."""
        import torch

        b, s = self.layout["batch"], self.layout["seq_length"]
        return torch.from_numpy(self.experts).view(b, s, *self.experts.shape[1:])

    def mask(self):
        """verl: `[batch, seq]` bool, True where the token has a recorded row."""
        import torch

        return torch.from_numpy(self.valid.astype(np.bool_)).view(self.layout["batch"], self.layout["seq_length"])

    def attention_mask(self):
        """verl: `[batch, seq]` bool, True on every real token (including the last, which has no row)."""
        import torch

        return torch.from_numpy(self.sequence >= 0).view(self.layout["batch"], self.layout["seq_length"])

    # ---- agreement ----------------------------------------------------------

    def recorded_rows(self, recorded, request_ids: list):
        """Turn `RouterReplay.get_recorded_data()` (RECORD mode, one `[tokens, K]` per layer, this batch's
        token order) into (request ids, positions, experts (n, L, K)) for the real tokens, to post to compare."""
        import torch

        ids = torch.stack([t.detach().to("cpu", torch.int64) for t in recorded], dim=1).numpy()
        real = self.sequence >= 0
        names = [r["request"] if isinstance(r, dict) else r if isinstance(r, str) else r[1] for r in request_ids]
        reqs = [names[i] for i in self.sequence[real].tolist()]
        return reqs, self.position[real], ids[real]


def decode_layout(backing: bytearray) -> TrainerBatch:
    base = np.frombuffer(backing, np.uint8).ctypes.data if len(backing) else 0
    reader = pa.ipc.open_stream(pa.py_buffer(backing))
    md = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    batch = reader.read_next_batch()
    num_layers, top_k = int(md["num_layers"]), int(md["top_k"])
    values = batch.column("experts").flatten()
    dtype = np.dtype(values.type.to_pandas_dtype())
    m = batch.num_rows
    return TrainerBatch(
        experts=_view(values, backing, base, dtype).reshape(m, num_layers, top_k),
        valid=_view(batch.column("valid"), backing, base, np.dtype(np.uint8)),
        sequence=_view(batch.column("sequence"), backing, base, np.dtype(np.int32)),
        position=_view(batch.column("position"), backing, base, np.dtype(np.int32)),
        layers=json.loads(md["layers"]),
        moe_layers=json.loads(md["moe_layers"]),
        num_experts=int(md["num_experts"]),
        layout=json.loads(md["layout"]),
    )


def sequences_doc(sequences) -> list[dict]:
    """(run, request) tuples, or dicts with run, request and optional start / num_tokens."""
    out = []
    for s in sequences:
        if isinstance(s, dict):
            out.append(dict(s))
        else:
            run, request = s[0], s[1]
            out.append({"run": run, "request": request})
    return out


def compare_body(run_id: str, shape: RunShape, request_ids, positions, experts) -> bytes:
    """An Arrow IPC body for POST /v1/runs/{run}/compare: rows `(n, L, K)` with a request id and position each."""
    experts = np.asarray(experts)
    if experts.ndim != 3 or experts.shape[1:] != (shape.num_moe_layers, shape.top_k):
        raise ValueError(f"experts must be (n, {shape.num_moe_layers}, {shape.top_k}), got {experts.shape}")
    if experts.size and (experts.min() < 0 or experts.max() >= shape.num_experts):
        raise ValueError(f"ids must be in 0..{shape.num_experts - 1}")
    meta = RowsMeta(run_id, "trainer", 0, shape, source="trainer")
    batch = build_rows(meta, list(request_ids), np.asarray(positions), experts.astype(shape.dtype),
                        flags=np.zeros(len(experts), np.uint16))
    return encode_stream(batch)


__all__ = ["TrainerBatch", "decode_layout", "sequences_doc", "compare_body", "Flag"]
