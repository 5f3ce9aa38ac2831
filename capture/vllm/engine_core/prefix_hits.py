"""Runs in vLLM's engine core: which earlier request computed each prefix-cache block a request reuses.

A token served from the prefix cache never runs through the router in the request that reuses
it; its routing is what was recorded when its KV block was computed. Two hooks learn that:

- `BlockPool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
  kv_cache_group_id)` (vllm/v1/core/block_pool.py:226) gives a block its hash when the request
  that allocated it schedules the block's tokens. The `BlockLedger` notes "physical block ->
  (request, block index)". A block evicted and computed again is noted again, so the ledger names
  the computation whose KV a later hit really reuses (the engine's own order).
- `KVCacheManager.get_computed_blocks(request)` (vllm/v1/core/kv_cache_manager.py:264) returns a
  request's hit blocks; `hit_ranges` turns them into `(start, end, source)` position ranges. Block
  hashes chain from position 0, so a hit block has the same index, hence the same positions, in
  both requests (checked: a mismatch is no reference, and reads stay GAP rather than wrong).

`Scheduler.schedule` (scheduler.py) attaches the hits of the requests it scheduled (new or resumed
after preemption) to the `SchedulerOutput` as the `prefix_hits` of its notes
(`capture.vllm.scheduler_notes`): one `Reference` per range, capped at the tokens the request really
starts from.
Only KV cache group 0 is followed (full attention: the groups of one model hit the same prefix).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from capture.vllm.patching import is_patched, patch
from replay_format.request_notes import Reference

_LEDGER = "_routing_replay_ledger"  # on the BlockPool instance
_HITS = "_routing_replay_hits"  # on the KVCacheManager instance: request -> ranges not yet scheduled


class HitRange(NamedTuple):
    """Positions `[start, end)` of a request's hit blocks, computed by the request `source`."""

    start: int
    end: int
    source: str


class BlockLedger:
    """Physical block id -> (request that computed it, its block index in that request, block size)."""

    def __init__(self) -> None:
        self.owner: dict[int, tuple[str, int, int]] = {}

    def computed(self, request_id: str, blocks: Any, first: int, last: int, block_size: int) -> None:
        """`blocks[first:last]` were just cached for `request_id` (indices are its block numbers)."""
        for index in range(first, last):
            block = blocks[index]
            if not getattr(block, "is_null", False):
                self.owner[block.block_id] = (request_id, index, block_size)

    def hit_ranges(self, request_id: str, hit_blocks: Any, num_hit_tokens: int) -> list[HitRange]:
        """The request's hit blocks as position ranges per source request (self-hits and unknown blocks left out)."""
        ranges: list[HitRange] = []
        for index, block in enumerate(hit_blocks):
            owner = self.owner.get(getattr(block, "block_id", -1))
            if owner is None:
                continue
            source, source_index, size = owner
            start, end = index * size, min((index + 1) * size, num_hit_tokens)
            if source == request_id or source_index != index or start >= end:
                continue
            if ranges and ranges[-1].source == source and ranges[-1].end == start:
                ranges[-1] = HitRange(ranges[-1].start, end, source)
            else:
                ranges.append(HitRange(start, end, source))
        return ranges


def _ledger(pool: Any) -> BlockLedger:
    ledger = pool.__dict__.get(_LEDGER)
    if ledger is None:
        ledger = pool.__dict__[_LEDGER] = BlockLedger()
    return ledger


def patch_kv_cache() -> None:
    """Wrap `BlockPool.cache_full_blocks` and `KVCacheManager.get_computed_blocks` (idempotent)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if is_patched(BlockPool.cache_full_blocks):
        return
    orig_cache, orig_computed = BlockPool.cache_full_blocks, KVCacheManager.get_computed_blocks

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, *a, **kw):
        if kv_cache_group_id == 0:
            try:
                _ledger(self).computed(request.request_id, blocks, num_cached_blocks, num_full_blocks, block_size)
            except Exception:  # any error: never break the scheduler (the request's hits then read GAP)
                pass
        return orig_cache(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, *a, **kw)

    def get_computed_blocks(self, request, *a, **kw):
        result = orig_computed(self, request, *a, **kw)
        try:
            blocks, num_hit_tokens = result[0], int(result[1])
            hits = self.__dict__.setdefault(_HITS, {})
            hits.pop(request.request_id, None)
            if num_hit_tokens > 0 and blocks.blocks:
                ranges = _ledger(self.block_pool).hit_ranges(request.request_id, blocks.blocks[0], num_hit_tokens)
                if ranges:
                    hits[request.request_id] = ranges
        except Exception:  # any error: as above
            pass
        return result

    patch(BlockPool, "cache_full_blocks", cache_full_blocks)
    patch(KVCacheManager, "get_computed_blocks", get_computed_blocks)


def take_scheduled(scheduler: Any, output: Any) -> list[Reference]:
    """The hits of requests `output` schedules as references, capped at each one's starting point; forgets them."""
    hits = scheduler.kv_cache_manager.__dict__.get(_HITS)
    if not hits:
        return []
    found: list[Reference] = []
    for request_id, scheduled in output.num_scheduled_tokens.items():
        ranges = hits.pop(request_id, None)
        request = scheduler.requests.get(request_id)
        if not ranges or request is None:
            continue
        # After schedule() the request counts this step's tokens as computed; it started from the rest.
        started_at = int(request.num_computed_tokens) - int(scheduled)
        found += [Reference(request_id, start, min(end, started_at), source)
                  for start, end, source in ranges if start < started_at]
    return found


def forget(scheduler: Any, request_id: str) -> None:
    """Drop a freed request's hits that were never scheduled."""
    hits = scheduler.kv_cache_manager.__dict__.get(_HITS)
    if hits:
        hits.pop(request_id, None)
