"""Reused page-aligned buffers for request bodies and segment staging, and the budget of body bytes in flight.

`BufferPool` keeps at most `keep` page-aligned buffers for reuse (first touching fresh memory costs page faults,
more than checking the rows; page alignment allows O_DIRECT writes): `take`, `give`, `borrowed`. A buffer taken while
none is free is new and is dropped on return when the pool is full, so memory stays bounded. `ByteBudget` bounds the
bytes of request bodies held at once: a body reserves its size, or waits.

Design: docs/design/service_workers.md.
"""

from __future__ import annotations

import asyncio
import mmap
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

PAGE = mmap.PAGESIZE
_GRANULE = 1 << 20  # sizes round up to whole MiB so near-equal requests share buffers


class BufferPool:
    """Page-aligned anonymous buffers, kept for reuse (at most `keep` of them)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        """A writable page-aligned buffer of at least `size` bytes (contents undefined)."""
        with self._lock:
            fitting = [b for b in self._free if len(b) >= size]
            if fitting:
                best = min(fitting, key=len)
                self._free.remove(best)
                return best
        return mmap.mmap(-1, max(-(-size // _GRANULE) * _GRANULE, _GRANULE))

    def give(self, buffer: mmap.mmap) -> None:
        """Return a buffer taken with `take`; kept for reuse while the pool has room."""
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)
            elif self._free and len(buffer) > min(map(len, self._free)):
                # Keep the larger one: later large bodies then need no fresh memory.
                self._free.remove(min(self._free, key=len))
                self._free.append(buffer)

    @contextmanager
    def borrowed(self, size: int) -> Iterator[memoryview]:
        """A writable view of exactly `size` bytes, returned to the pool on exit.

        The caller must not keep views into it past the block: the next borrower
        overwrites the bytes.
        """
        buffer = self.take(size)
        try:
            yield memoryview(buffer)[:size]
        finally:
            self.give(buffer)


class ByteBudget:
    """Bytes of request bodies held at once (asyncio, one event loop): a body reserves its size, or waits.

    Ingest bodies are bounded by this rather than by the processing slots, so a body that
    arrives slowly holds only its own size, never a slot another writer needs. Waiters are
    served in order (a large body is not starved by small ones); a reservation larger than the
    whole budget is cut to it. Release is synchronous, so a cancelled request always gives back.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @asynccontextmanager
    async def reserved(self, size: int) -> AsyncIterator[None]:
        """Hold `size` bytes of the budget for the block, waiting until they are free."""
        size = min(size, self.total)
        if self._waiting or self.free < size:
            granted = asyncio.get_running_loop().create_future()
            self._waiting.append((size, granted))
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._release(size)  # granted just as it was cancelled
                else:
                    self._waiting.remove((size, granted))
                    self._grant()
                raise
        else:
            self.free -= size
        try:
            yield
        finally:
            self._release(size)

    def _release(self, size: int) -> None:
        self.free += size
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            size, granted = self._waiting.popleft()
            self.free -= size
            granted.set_result(None)
