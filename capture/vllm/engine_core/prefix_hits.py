"""Runs in vLLM's engine core: which earlier request computed each prefix-cache block a request reuses.

`patch_kv_cache` wraps vLLM's `BlockPool.cache_full_blocks` (the `BlockLedger` notes which request computed each
block, and by hash which computed each block hash, the `HASHES_KEPT` newest), `KVCacheManager.get_computed_blocks`
(a request's hits, as `(start, end, source)` ranges) and `allocate_slots` (positions a KV connector loads, owned by the
computation their hash names). `take_scheduled` gives the scheduler a step's `Reference`s; a hit whose positions do
not match, or a loaded block no request here computed, gets none (its rows read GAP, never wrong). Only KV cache
group 0 is followed.

Design: docs/design/vllm_engine_core.md.
"""

from __future__ import annotations

from collections import OrderedDict
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


class Owner(NamedTuple):
    """The computation of one KV block: the request, the block's index in it, the block size."""

    request_id: str
    block_number: int  # the block's index in the request: positions block_number * block_size onwards
    block_size: int


HASHES_KEPT = 1 << 18  # block hashes the ledger remembers (LRU): 8M tokens of blocks of 32, tens of MB


class BlockLedger:
    """Which request computed each KV block: by physical block id, and by block hash (module docstring)."""

    def __init__(self, hashes_kept: int = HASHES_KEPT) -> None:
        self.owner: dict[int, Owner] = {}  # physical block id -> its computation
        self.by_hash: OrderedDict[Any, Owner] = OrderedDict()  # block hash -> its latest computation here
        self.loaded: dict[str, tuple[int, int]] = {}  # request -> positions [start, end) a connector loads for it
        self.hashes_kept = hashes_kept

    def loading(self, request_id: str, start: int, end: int) -> None:
        """A connector loads the KV of `request_id`'s positions `[start, end)` (they are not computed by it)."""
        self.loaded[request_id] = (start, end)

    def computed(self, request_id: str, blocks: Any, first: int, last: int, block_size: int) -> None:
        """`blocks[first:last]` were just cached for `request_id` (indices are its block numbers): computed by it, or,
        where a connector loaded them, by the computation their hash names (none when the ledger does not know it)."""
        start, end = self.loaded.get(request_id, (0, 0))
        for index in range(first, last):
            block = blocks[index]
            if getattr(block, "is_null", False):
                continue
            key = getattr(block, "block_hash", None)
            if start <= index * block_size and (index + 1) * block_size <= end:
                source = self.by_hash.get(key) if key is not None else None
                if source is not None and source.block_number == index:
                    self.owner[block.block_id] = source
                else:  # no computation here: a later hit names the loader, whose rows come from where its KV did
                    self.owner[block.block_id] = Owner(request_id, index, block_size)
                continue
            mine = Owner(request_id, index, block_size)
            self.owner[block.block_id] = mine
            if key is not None:
                self.by_hash[key] = mine
                self.by_hash.move_to_end(key)
                if len(self.by_hash) > self.hashes_kept:
                    self.by_hash.popitem(last=False)

    def hit_ranges(self, request_id: str, hit_blocks: Any, num_hit_tokens: int, first: int = 0) -> list[HitRange]:
        """The request's blocks from position `first` to `num_hit_tokens` as position ranges per source request
        (self-hits and unknown blocks left out)."""
        ranges: list[HitRange] = []
        for index, block in enumerate(hit_blocks):
            owner = self.owner.get(getattr(block, "block_id", -1))
            if owner is None:
                continue
            source, source_index, size = owner
            start, end = max(index * size, first), min((index + 1) * size, num_hit_tokens)
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
    """Wrap `BlockPool.cache_full_blocks`, `KVCacheManager.get_computed_blocks` and `KVCacheManager.allocate_slots`
    (idempotent)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if is_patched(BlockPool.cache_full_blocks):
        return
    orig_cache, orig_computed = BlockPool.cache_full_blocks, KVCacheManager.get_computed_blocks
    orig_allocate = KVCacheManager.allocate_slots

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, *a, **kw):
        out = orig_cache(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                         kv_cache_group_id, *a, **kw)
        if kv_cache_group_id == 0:  # after vLLM's own: the blocks carry their hashes now
            try:
                _ledger(self).computed(request.request_id, blocks, num_cached_blocks, num_full_blocks, block_size)
            except Exception:  # any error: never break the scheduler (the request's hits then read GAP)
                pass
        return out

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

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, *a, **kw):
        try:
            external = int(kw.get("num_external_computed_tokens", a[2] if len(a) > 2 else 0) or 0)
            if external > 0:  # a connector loads these positions (before vLLM caches their blocks, below)
                start = int(request.num_computed_tokens) + int(num_new_computed_tokens)
                _ledger(self.block_pool).loading(request.request_id, start, start + external)
        except Exception:  # any error: as above
            pass
        return orig_allocate(self, request, num_new_tokens, num_new_computed_tokens, *a, **kw)

    patch(BlockPool, "cache_full_blocks", cache_full_blocks)
    patch(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    patch(KVCacheManager, "allocate_slots", allocate_slots)


def take_scheduled(scheduler: Any, output: Any) -> list[Reference]:
    """The hits and connector loads of requests `output` schedules as references, capped at each one's starting
    point; forgets them."""
    manager = scheduler.kv_cache_manager
    hits = manager.__dict__.get(_HITS)
    ledger = manager.block_pool.__dict__.get(_LEDGER)
    loaded = ledger.loaded if ledger is not None else None
    if not hits and not loaded:
        return []
    found: list[Reference] = []
    for request_id, scheduled in output.num_scheduled_tokens.items():
        ranges = hits.pop(request_id, None) if hits else None
        span = loaded.pop(request_id, None) if loaded else None
        request = scheduler.requests.get(request_id)
        if (not ranges and span is None) or request is None:
            continue
        # After schedule() the request counts this step's tokens as computed; it started from the rest.
        started_at = int(request.num_computed_tokens) - int(scheduled)
        if span is not None and ledger is not None:  # its loaded blocks are owned by the computations they name
            blocks = manager.get_blocks(request_id).blocks[0]
            ranges = (ranges or []) + ledger.hit_ranges(request_id, blocks, min(span[1], started_at), first=span[0])
        found += [Reference(request_id, start, min(end, started_at), source)
                  for start, end, source in ranges or [] if start < started_at]
    return found


def forget(scheduler: Any, request_id: str) -> None:
    """Drop a freed request's hits and loads that were never scheduled."""
    hits = scheduler.kv_cache_manager.__dict__.get(_HITS)
    if hits:
        hits.pop(request_id, None)
    ledger = scheduler.kv_cache_manager.block_pool.__dict__.get(_LEDGER)
    if ledger is not None:
        ledger.loaded.pop(request_id, None)
