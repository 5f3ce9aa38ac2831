"""Assemble one request's route from segment slices.

The common case (one span covering the range, nothing to fix up) stays a
zero-copy view of the memory-mapped segment. Otherwise rows are merged by
position: a resent identical row is dropped, differing rows at one position
are CONFLICT (the first stored is served), and a position nobody sent is a GAP
row (ids zero, flagged, never clean data).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import Flag, RunShape
from replay_format.rows import rows_schema


@dataclass
class RouteRows:
    request_id: str
    shape: RunShape
    positions: np.ndarray  # int32 (n,)
    token_ids: pa.Array  # int32, null where unknown
    experts: np.ndarray  # (n, L*K) run dtype, possibly a read-only view of a segment
    flags: np.ndarray  # uint16 (n,)

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    def experts_3d(self) -> np.ndarray:
        return self.experts.reshape(self.num_rows, self.shape.num_moe_layers, self.shape.top_k)

    def bad_rows(self) -> np.ndarray:
        return np.flatnonzero(self.flags)

    def to_batch(self, metadata: dict[str, str] | None = None) -> pa.RecordBatch:
        n = self.num_rows
        arrays = [
            pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([self.request_id], pa.utf8())),
            pa.array(self.positions),
            self.token_ids,
            pa.FixedSizeListArray.from_arrays(pa.array(self.experts.reshape(-1)), self.shape.row_width),
            pa.array(self.flags),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=rows_schema(self.shape, metadata))


def _piece_arrays(piece: pa.RecordBatch, width: int):
    positions = piece.column("position").to_numpy()
    experts = piece.column("experts").flatten().to_numpy(zero_copy_only=True).reshape(len(positions), width)
    return positions, piece.column("token_id"), experts, piece.column("flags").to_numpy()


def assemble_route(
    request_id: str, shape: RunShape, pieces: list[pa.RecordBatch], start: int, end: int, extra_flags: dict[int, int]
) -> RouteRows:
    width = shape.row_width
    if len(pieces) == 1:
        positions, tokens, experts, flags = _piece_arrays(pieces[0], width)
        lo, hi = np.searchsorted(positions, [start, end])
        positions, experts, flags, tokens = positions[lo:hi], experts[lo:hi], flags[lo:hi], tokens.slice(lo, hi - lo)
        dense = len(positions) == end - start and (len(positions) == 0 or positions[-1] - positions[0] == end - start - 1)
        if dense and not extra_flags:
            return RouteRows(request_id, shape, positions, tokens, experts, flags)
    elif pieces:
        parts = [_piece_arrays(p, width) for p in pieces]
        positions = np.concatenate([p[0] for p in parts])
        tokens = pa.concat_arrays([p[1] for p in parts])
        experts = np.concatenate([p[2] for p in parts])
        flags = np.concatenate([p[3] for p in parts])
        keep = (positions >= start) & (positions < end)
        order = np.flatnonzero(keep)[np.argsort(positions[keep], kind="stable")]
        positions, experts, flags = positions[order], experts[order], flags[order]
        tokens = tokens.take(pa.array(order))
    else:
        positions = np.zeros(0, np.int32)
        experts = np.zeros((0, width), shape.dtype)
        flags = np.zeros(0, np.uint16)
        tokens = pa.array([], pa.int32())

    # Merge repeated positions: the first stored row is served.
    if len(positions) > 1:
        first = np.concatenate(([True], positions[1:] != positions[:-1]))
        if not first.all():
            group = np.cumsum(first) - 1
            heads = np.flatnonzero(first)
            for i in np.flatnonzero(~first):
                if not np.array_equal(experts[i], experts[heads[group[i]]]):
                    flags[heads[group[i]]] |= Flag.CONFLICT
            positions, experts, flags = positions[first], experts[first], flags[first]
            tokens = tokens.filter(pa.array(first))

    out_positions = np.arange(start, end, dtype=np.int32)
    out_experts = np.zeros((end - start, width), shape.dtype)
    out_flags = np.full(end - start, int(Flag.GAP), np.uint16)
    out_tokens = np.zeros(end - start, np.int32)
    token_mask = np.ones(end - start, np.bool_)
    slots = positions - start
    out_experts[slots] = experts
    out_flags[slots] = flags
    valid_tokens = tokens.is_valid().to_numpy(zero_copy_only=False)
    out_tokens[slots] = tokens.fill_null(0).to_numpy(zero_copy_only=False)
    token_mask[slots] = ~valid_tokens
    for position, bits in extra_flags.items():
        if start <= position < end:
            out_flags[position - start] |= bits
    return RouteRows(
        request_id, shape, out_positions, pa.array(out_tokens, mask=token_mask), out_experts, out_flags
    )
