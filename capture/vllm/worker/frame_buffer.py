"""Runs in the vLLM worker: each step's frame built in place in one reused buffer (the forward thread's step close).

`StepFrameBuffer` writes the bytes `replay_format.step_frame.pack` would (the `S` frame) straight into their places:
`open` (at the forward) writes query_start_loc, positions and token ids and hands the recorder the frame's
`[n, L, K]` experts slot; `close` (at `sample_tokens`) writes flags, spec-decode counts, request names, the weight
version and the header, and returns the whole frame, length prefix included, as a view valid until the next `open`.
`FORMAT_VERSION` is the step-frame version these bytes follow, refused at import when `replay_format.step_frame` moves
on without this module; byte-equality with `pack` is tested (tests/test_capture_step_cost.py).

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from replay_format import NO_TOKEN, RunShape
from replay_format.core import FormatVersion
from replay_format.step_frame import VERSION, FrameKind, version_trailer
from replay_format.weight_versions import LABEL_MAX

FORMAT_VERSION = FormatVersion(1, 4)  # the step frame layout written here (step_frame.md; 1.4 changed only F frames)
if VERSION != FORMAT_VERSION:  # a new layout must be written here too (and tested against pack)
    raise ImportError(f"capture.vllm.worker.frame_buffer writes step frames {FORMAT_VERSION}, the format is {VERSION}")

_HEAD = struct.Struct("<Q1sIIB")  # length prefix, kind, then step_frame's `_STEP` (rows, requests, bits)
_HAS_SPEC = 1
_HAS_VERSION = 2
_VERSION_ROOM = 1 + LABEL_MAX  # the weight version's bytes at most
_KIND = FrameKind.STEP.value


def host_ints(tensor: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
    """The first n values of a tensor (any device) or array as a host array, without a copy where possible."""
    if isinstance(tensor, np.ndarray):
        return tensor[:n]
    if tensor.is_cpu:
        return tensor.numpy()[:n]
    return tensor[:n].cpu().numpy()


class StepFrameBuffer:
    """One reused buffer holding the step frame being built (module docstring)."""

    def __init__(self, shape: RunShape, capacity: int = 1 << 16) -> None:
        self.shape = shape
        self.dtype = np.dtype(shape.dtype)
        self.row_bytes = shape.row_width * self.dtype.itemsize
        self._names_of: list[str] | None = None  # the request ids `_names` encodes
        self._names = b""  # their u32 lengths, then the UTF-8 bytes
        self._zeros = memoryview(bytes(1024))  # the flags of a clean step, copied from here
        self.weight_version: str | None = None  # the label every frame carries from now on (None: unknown)
        self._version = b""  # its field (step_frame.md: u8 length, label); empty: no field
        self._alloc(capacity)
        self.n = self.num_reqs = 0
        self._experts_at = self._flags_at = 0
        self.experts: np.ndarray = self._u8[:0].view(self.dtype).reshape(0, shape.num_moe_layers, shape.top_k)

    def _alloc(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        # Every int32 field starts at an even offset 2 mod 4 (header 18 bytes, 4-byte fields before
        # the experts): one int32 view from byte 2 serves them all with a slice, no new view per step.
        self._i32 = np.frombuffer(self.buf, np.int32, (size - 2) // 4, 2)
        self._u8 = np.frombuffer(self.buf, np.uint8)

    def open(self, req_ids: list[str], query_start_loc: np.ndarray, positions, token_ids) -> int:
        """Start a step's frame: write its query_start_loc, positions, token ids (None: NO_TOKEN); returns n.

        `query_start_loc` is `[len(req_ids) + 1]` ints; `positions` and `token_ids` hold at least n
        values (tensors on any device or arrays, any int dtype; cast to int32 as `pack` does).
        `self.experts` is then this step's `[n, L, K]` slot, for the recorder to fill.
        """
        r = len(req_ids)
        n = int(query_start_loc[r])
        if req_ids != self._names_of:
            names = [rid.encode() for rid in req_ids]
            self._names = np.array([len(b) for b in names], np.uint32).tobytes() + b"".join(names)
            self._names_of = list(req_ids)
        need = _HEAD.size + 4 * (r + 1) + 10 * n + n * self.row_bytes + 8 * r + len(self._names) + _VERSION_ROOM
        if need > len(self.buf):
            self._alloc(max(need, 2 * len(self.buf)))
        i32 = self._i32
        q = (_HEAD.size - 2) // 4  # int32 index of query_start_loc
        p = q + r + 1
        t = p + n
        np.copyto(i32[q:p], query_start_loc[: r + 1], casting="unsafe")
        np.copyto(i32[p:t], host_ints(positions, n), casting="unsafe")
        if token_ids is None:
            i32[t : t + n] = NO_TOKEN
        else:
            np.copyto(i32[t : t + n], host_ints(token_ids, n), casting="unsafe")
        at = 2 + 4 * (t + n)
        self._experts_at, self._flags_at = at, at + n * self.row_bytes
        self.experts = np.ndarray((n, self.shape.num_moe_layers, self.shape.top_k), self.dtype, self.buf, at)
        self.n, self.num_reqs = n, r
        return n

    def set_weight_version(self, label: str | None) -> None:
        """From the next frame on, steps carry the weight version `label` (None: unknown); FormatError for a label
        outside the rule (`replay_format.weight_versions.check_label`), the last one then stays."""
        self._version = b"" if label is None else version_trailer(label)
        self.weight_version = label

    @property
    def positions(self) -> np.ndarray:
        """This step's positions (int32 [n], a view of the frame)."""
        p = (_HEAD.size - 2) // 4 + self.num_reqs + 1
        return self._i32[p : p + self.n]

    @property
    def token_ids(self) -> np.ndarray:
        """This step's token ids (int32 [n], a view of the frame)."""
        t = (_HEAD.size - 2) // 4 + self.num_reqs + 1 + self.n
        return self._i32[t : t + self.n]

    def close(self, flags: np.ndarray | None, drafts: np.ndarray | None = None,
              sampled: np.ndarray | None = None) -> memoryview:
        """Finish the frame (flags None: every row clean); the whole frame, length prefix included."""
        if (drafts is None) != (sampled is None):
            raise ValueError("a step carries both spec-decode arrays (drafts, sampled) or neither")
        n, r, at = self.n, self.num_reqs, self._flags_at
        view = self.view
        end = at + 2 * n
        if flags is None:
            if len(self._zeros) < 2 * n:
                self._zeros = memoryview(bytes(4 * n))
            view[at:end] = self._zeros[: 2 * n]
        else:
            view[at:end] = np.asarray(flags, np.uint16).tobytes()
        if drafts is not None:
            view[end : end + 4 * r] = np.asarray(drafts, np.uint32).tobytes()
            view[end + 4 * r : end + 8 * r] = np.asarray(sampled, np.int32).tobytes()
            end += 8 * r
        names = self._names
        view[end : end + len(names)] = names
        end += len(names)
        bits = _HAS_SPEC if drafts is not None else 0
        version = self._version
        if version:
            view[end : end + len(version)] = version
            end += len(version)
            bits |= _HAS_VERSION
        _HEAD.pack_into(self.buf, 0, end - 8, _KIND, n, r, bits)
        return view[:end]
