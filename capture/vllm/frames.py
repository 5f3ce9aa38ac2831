"""The pipe format between a worker (`handoff.py`) and its sink process (`sink.py`).

Every frame is `u64 length (little-endian)` + body. A body starts with one byte:

- `P`: a pickled `(kind, value)`: ("config", dict), ("finish", [...]), ("close", seconds),
  and ("step", StepFrame fields) for steps that carry spec-decode details;
- `S`: a plain step, packed by hand because pickling five numpy arrays cost the forward
  thread ~40 us per step inside the engine (bench/vllm_overhead.py). Layout, little-endian:
  `u32 n, u32 num_reqs, u8 has_token_ids`, then `i32 query_start_loc[num_reqs + 1]`,
  `i32 positions[n]`, `i64 token_ids[n]` (if present), the experts `[n, L, K]` in the run's
  dtype, `u16 flags[n]`, `u32 id_lengths[num_reqs]` and the UTF-8 request ids back to back.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass

import numpy as np

LENGTH = struct.Struct("<Q")
_STEP = struct.Struct("<IIB")


@dataclass
class StepFrame:
    """One captured step as the model ran it (the arrays are the receiver's to keep)."""

    req_ids: list[str]  # vLLM internal ids, batch order
    query_start_loc: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray | None
    experts: np.ndarray  # [n, L, K]
    flags: np.ndarray  # [n] uint16 (the recorder's STALE)
    spec: dict | None = None  # scheduled_spec_decode_tokens, when drafts were verified
    sampled: dict | None = None  # request id -> tokens sampled this step (spec decode)


def pack(kind: str, value) -> bytes:
    body = b"P" + pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(body)) + body


def pack_step(req_ids, query_start_loc, positions, token_ids, experts, flags) -> bytes:
    """A step without spec-decode details (`pack("step", ...)` carries those)."""
    names = [r.encode() for r in req_ids]
    parts = [
        b"S", _STEP.pack(len(positions), len(names), token_ids is not None),
        np.asarray(query_start_loc, np.int32).tobytes(), np.asarray(positions, np.int32).tobytes(),
    ]
    if token_ids is not None:
        parts.append(np.asarray(token_ids, np.int64).tobytes())
    parts += [experts.tobytes(), np.asarray(flags, np.uint16).tobytes(),
              np.array([len(b) for b in names], np.uint32).tobytes(), *names]
    body = b"".join(parts)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes, expert_dtype, row_shape: tuple[int, int]):
    """(kind, value) of a frame body; a packed step comes back as ("step", StepFrame)."""
    if body[:1] == b"P":
        kind, value = pickle.loads(body[1:])
        return (kind, StepFrame(*value)) if kind == "step" else (kind, value)
    if body[:1] != b"S":
        raise ValueError(f"unknown frame type {body[:1]!r}")
    n, num_reqs, has_tokens = _STEP.unpack_from(body, 1)
    at = 1 + _STEP.size

    def take(dtype, count, shape=None):
        nonlocal at
        array = np.frombuffer(body, dtype, count, at)
        at += array.nbytes
        return array if shape is None else array.reshape(shape)

    qsl = take(np.int32, num_reqs + 1)
    positions = take(np.int32, n)
    token_ids = take(np.int64, n) if has_tokens else None
    layers, top_k = row_shape
    experts = take(expert_dtype, n * layers * top_k, (n, layers, top_k))
    flags = take(np.uint16, n)
    lengths = take(np.uint32, num_reqs).tolist()
    req_ids = []
    for size in lengths:
        req_ids.append(body[at : at + size].decode())
        at += size
    return "step", StepFrame(req_ids, qsl, positions, token_ids, experts, flags)
