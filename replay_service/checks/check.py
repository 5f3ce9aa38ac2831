"""The check (ingest stage 2): the service's verdict on every row of a batch (rows.md, "Flags").

`check(rows, shape)` takes a decoded batch alone: it drops writer padding, sorts rows by (request, position), runs
the compiled row checks (ZERO, DUPLICATE, OUT_OF_RANGE, content hashes, expert load; `kernels.py`), keeps the
writer's STALE bits and settles positions the batch repeats; `check_stale` then compares rows with recently stored
ones. The result, `CheckedRows`, is what the segment stage writes. CONFLICT and recompute are decided here and only
here, by `judge_repeats` (rows.md, "Weight versions"): identical ids are a resend; differing ids are a CONFLICT under
equal or unknown weight versions and a *recompute* (both kept, nothing flagged) under two known, different ones.

Design: docs/design/service_data.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from replay_format import Flag, RunShape
from replay_format.rows import Rows
from replay_format.weight_versions import UNKNOWN
from replay_service.checks.kernels import check_rows, route_entropy_bits
from replay_service.checks.recent import RecentRows, request_keys


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
    # bool (n,): repeats an earlier row of this batch under another known weight version, with other ids (kept,
    # never served by the default rule, nothing flagged); None: no row is
    recomputed: np.ndarray | None = None

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

    def load_where(self, keep: np.ndarray) -> np.ndarray:
        """The expert load `(num_moe_layers, num_experts)` of the clean rows `keep` marks (e.g. one weight version)."""
        pick = keep & (self.content_flags == 0)
        shape = self.rows.meta.shape
        load = np.zeros_like(self.load)
        if pick.any():
            check_rows(self.rows.experts[pick], shape.num_moe_layers, shape.top_k, shape.num_experts,
                       np.zeros(int(pick.sum()), np.bool_), load)
        return load

    def request_spans(self) -> list[tuple[int, int]]:
        """`[lo, hi)` row ranges holding one request each, in order."""
        if not self.num_rows:
            return []
        bounds = (np.flatnonzero(np.diff(self.rows.request_index)) + 1).tolist()
        return list(zip([0, *bounds], [*bounds, self.num_rows]))


@dataclass(frozen=True)
class RepeatVerdicts:
    """The rule's verdict on each of a group of rows (`judge_repeats`)."""

    repeat: np.ndarray  # bool (m,): an earlier row holds this row's position (never served by the default rule)
    conflict: np.ndarray  # bool (m,): its ids differ from an earlier row's of the same or an unknown version
    recompute: np.ndarray  # bool (m,): its ids differ only from earlier rows of other known versions


def judge_repeats(keys: np.ndarray, experts: np.ndarray, versions: np.ndarray) -> RepeatVerdicts:
    """The one rule for rows at a position an earlier row holds (module docstring), every earlier row compared.

    `keys` (int64, a position or a (request, position) key), `experts` `(m, L*K)` and `versions` (each row's label
    index in one label list, `UNKNOWN` = -1) are sorted by key, rows of one key in the order they were held.
    """
    m = len(keys)
    repeat = np.zeros(m, np.bool_)
    conflict = np.zeros(m, np.bool_)
    differs = np.zeros(m, np.bool_)
    versions = np.asarray(versions)
    distance = 1
    while distance < m:  # row i against row i - d, for every d inside its key's group (groups are short)
        later = np.flatnonzero(keys[distance:] == keys[:-distance]) + distance
        if not len(later):
            break
        earlier = later - distance
        repeat[later] = True
        other = np.any(experts[later] != experts[earlier], axis=1)
        a, b = versions[later], versions[earlier]
        same_or_unknown = (a == b) | (a == UNKNOWN) | (b == UNKNOWN)
        conflict[later] |= other & same_or_unknown
        differs[later] |= other
        distance += 1
    return RepeatVerdicts(repeat, conflict, differs & ~conflict)


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
    shadowed, recomputed = _settle_batch_repeats(order_key, rows, flags)
    return CheckedRows(rows, flags, content_flags, hashes, load, shadowed, padding_dropped, digest, recomputed)


def _settle_batch_repeats(order_key: np.ndarray, rows: Rows, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Shadow rows repeating a position within the batch; CONFLICT on the served (first) row where the rule says so.

    Returns the shadowed rows and the recomputed ones (None: none).
    """
    shadowed = np.zeros(len(order_key), np.bool_)
    if len(order_key) < 2:
        return shadowed, None
    if not np.any(order_key[1:] == order_key[:-1]):
        return shadowed, None
    verdicts = judge_repeats(order_key, rows.experts, rows.versions().index)
    shadowed[:] = verdicts.repeat
    # Each row's first row at its position (rows are sorted, so repeats follow their first).
    first = np.maximum.accumulate(np.where(verdicts.repeat, 0, np.arange(len(order_key))))
    flags[first[verdicts.conflict]] |= np.uint16(Flag.CONFLICT)
    return shadowed, verdicts.recompute if verdicts.recompute.any() else None


@functools.lru_cache(maxsize=256)
def content_check_applies(shape: RunShape, min_entropy_bits: float) -> bool:
    """Whether rows of this shape take enough distinct values that two equal rows are a copy, not chance."""
    return route_entropy_bits(shape.num_moe_layers, shape.top_k, shape.num_experts) >= min_entropy_bits


@dataclass(frozen=True)
class Remembered:
    """The rows a STALE check remembered (compared and found no copy), as its table keys them."""

    hashes: np.ndarray
    requests: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray


def check_stale(checked: CheckedRows, recent: RecentRows) -> Remembered:
    """Flag STALE the rows that copy a recently stored row of another token, and remember the clean ones.

    Only rows that are clean so far and served are compared and remembered. Updates `checked.flags`; answers the
    rows remembered (what other hosts learn through the feed, ingest/stale_feed.py).
    """
    rows = checked.rows
    keys = request_keys(rows.meta.run_id, rows.request_ids)[rows.request_index]
    eligible = (checked.flags == 0) & ~checked.shadowed
    stale = recent.check_and_add(checked.hashes, keys, rows.positions, rows.token_ids, eligible)
    checked.flags[stale] |= np.uint16(Flag.STALE)
    kept = eligible & ~stale
    return Remembered(checked.hashes[kept], keys[kept], np.asarray(rows.positions, np.int32)[kept],
                      np.asarray(rows.token_ids, np.int32)[kept])
