"""The check (ingest stage 2): the service's verdict on every row of a batch (rows.md, "Flags").

`check` takes a decoded batch (`Rows`) alone: it drops writer padding, sorts rows by
(request, position), runs the compiled row checks (ZERO, DUPLICATE, OUT_OF_RANGE, content
hashes, expert load; `kernels.py`), keeps the writer's STALE bits and settles positions the
batch repeats. `check_stale` then compares rows with recently stored ones (the STALE content
check). The result, `CheckedRows`, is what the segment stage writes.

CONFLICT is decided here and only here, by `repeat_conflicts`: the same position twice is a
resend when the ids are identical (stored once, served once) and a CONFLICT when they differ;
the first stored row is the one served. The check stage applies it within a batch, the commit
stage to rows already stored; reads only pick the first stored row per position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from replay_format import Flag, RunShape
from replay_format.rows import Rows
from replay_service.checks.kernels import RecentRows, check_rows, route_entropy_bits


@dataclass
class CheckedRows:
    """A batch with the service's verdicts: what is written to a segment and committed to the index."""

    rows: Rows  # padding dropped, sorted by (request, position)
    flags: np.ndarray  # uint16 (n,): the segment's flags column (the verdicts, plus the writer's STALE)
    content_flags: np.ndarray  # uint16 (n,): ZERO | DUPLICATE | OUT_OF_RANGE only (0: the row is counted in `load`)
    hashes: np.ndarray  # uint64 (n,): content hash per row
    load: np.ndarray  # int64 (num_moe_layers, num_experts): expert counts of the rows with content_flags 0
    shadowed: np.ndarray  # bool (n,): repeats a position an earlier row of this batch holds (never served)
    padding_dropped: np.ndarray  # int64 per entry of rows.request_ids: PADDING rows dropped
    digest: str  # identifies the batch's content: a retry of (run, writer, seq) must match it

    @property
    def num_rows(self) -> int:
        """Rows kept (padding dropped)."""
        return self.rows.num_rows

    def served_load(self, shadowed: np.ndarray) -> np.ndarray:
        """`load` without the clean rows that `shadowed` marks (repeats: stored, never served or counted)."""
        uncount = shadowed & (self.content_flags == 0)
        if not uncount.any():
            return self.load
        shape = self.rows.meta.shape
        unload = np.zeros_like(self.load)
        check_rows(self.rows.experts[uncount], shape.num_moe_layers, shape.top_k, shape.num_experts,
                   np.zeros(int(uncount.sum()), np.bool_), unload)
        return self.load - unload

    def request_spans(self) -> list[tuple[int, int]]:
        """`[lo, hi)` row ranges holding one request each, in order."""
        if not self.num_rows:
            return []
        bounds = (np.flatnonzero(np.diff(self.rows.request_index)) + 1).tolist()
        return list(zip([0, *bounds], [*bounds, self.num_rows]))


def repeat_conflicts(experts: np.ndarray, served: np.ndarray) -> np.ndarray:
    """The rule for rows at a position a row is already served at: True where the ids differ (CONFLICT).

    `experts` and `served` are `(m, L*K)`: each repeated row and the row served at its position.
    Identical is a resend: stored, never served or counted again.
    """
    return np.any(experts != served, axis=1)


def check(rows: Rows, shape: RunShape) -> CheckedRows:
    """The verdicts on a batch by itself (nothing stored is consulted)."""
    padding = (rows.flags & Flag.PADDING) != 0
    padding_dropped = np.bincount(rows.request_index[padding], minlength=len(rows.request_ids))
    if padding.any():
        rows = rows.take(~padding)
    order_key = (rows.request_index.astype(np.int64) << 32) | rows.positions.astype(np.int64)
    if rows.num_rows > 1 and not np.all(order_key[1:] >= order_key[:-1]):
        order = np.argsort(order_key, kind="stable")  # stable: among repeats, the first sent stays first
        rows, order_key = rows.take(order), order_key[order]

    load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
    skip = np.zeros(rows.num_rows, np.bool_)
    content_flags, hashes = check_rows(rows.experts, shape.num_moe_layers, shape.top_k, shape.num_experts, skip, load)
    # Unchanged since the first release: digests in existing indexes must keep matching their retries.
    digest = f"{rows.num_rows}:{int(hashes.sum(dtype=np.uint64))}:{int(order_key.sum(dtype=np.int64))}"
    flags = content_flags | (rows.flags & Flag.STALE)
    shadowed = _settle_batch_repeats(order_key, rows.experts, flags)
    return CheckedRows(rows, flags, content_flags, hashes, load, shadowed, padding_dropped, digest)


def _settle_batch_repeats(order_key: np.ndarray, experts: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Shadow rows repeating a position within the batch; CONFLICT on the served (first) row where ids differ."""
    shadowed = np.zeros(len(order_key), np.bool_)
    if len(order_key) < 2:
        return shadowed
    repeat = np.concatenate(([False], order_key[1:] == order_key[:-1]))
    if not repeat.any():
        return shadowed
    # Each row's first row at its position (rows are sorted, so repeats follow their first).
    first = np.maximum.accumulate(np.where(repeat, 0, np.arange(len(order_key))))
    repeats = np.flatnonzero(repeat)
    shadowed[repeats] = True
    differs = repeat_conflicts(experts[repeats], experts[first[repeats]])
    flags[first[repeats[differs]]] |= np.uint16(Flag.CONFLICT)
    return shadowed


@functools.lru_cache(maxsize=256)
def content_check_applies(shape: RunShape, min_entropy_bits: float) -> bool:
    """Whether rows of this shape take enough distinct values that two equal rows are a copy, not chance."""
    return route_entropy_bits(shape.num_moe_layers, shape.top_k, shape.num_experts) >= min_entropy_bits


def check_stale(checked: CheckedRows, recent: RecentRows) -> None:
    """Flag STALE the rows that copy a recently stored row of another token, and remember the clean ones.

    Only rows that are clean so far and served are compared and remembered. Updates `checked.flags`.
    """
    rows = checked.rows
    keys = _request_keys(rows.meta.run_id, rows.request_ids)[rows.request_index]
    eligible = (checked.flags == 0) & ~checked.shadowed
    stale = recent.check_and_add(checked.hashes, keys, rows.positions, rows.token_ids, eligible)
    checked.flags[stale] |= np.uint16(Flag.STALE)


def _request_keys(run_id: str, request_ids: list[str]) -> np.ndarray:
    # Keys for the in-memory STALE table only; Python's salted hash is fine there.
    return np.array([hash((run_id, r)) & 0x7FFFFFFFFFFFFFFF for r in request_ids], np.int64)
