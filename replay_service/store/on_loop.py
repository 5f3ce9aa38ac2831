"""Reads on the event loop: a hot read served where it arrives, without the hand-off to a thread and back.

A read of a local store whose segments are already opened (mapped and checked) touches only memory and the
index's local file: it takes less time than the hand-off to a worker thread and back (`bench/route_get.py`).
Such a read may run on the event loop, inside `on_event_loop()`. Whatever would make it wait there raises
`WouldWait` instead, before waiting, and the caller reads in a thread as before:

- a segment not opened yet (opening checks the whole file's checksum): `SegmentCache.get`;
- more rows than `MAX_ROWS` (a dense copy of a range with gaps grows with it): `RouteStore.read_rows`;
- the run registry's lock, held by a thread registering a run (a transaction): `RunRegistry.get`.

The caller asks first whether the store is local at all (`RouteStore.reads_on_loop`): a PostgreSQL index or
a bucket means a network round trip, which never runs on the loop; `REPLAY_HOT_READS=thread` keeps every read
in a thread. The SQLite index's queries run on reader connections there, which never wait for a writer
(index_backends/sqlite.py).

An opened segment's pages may still be on disk only (evicted from the page cache): touching them faults them in
on the loop. That is not new: the answer's parts are views of the mapped segment, and sending them has always
read those pages on the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

MAX_ROWS = 16384  # rows a read on the event loop may serve (6 MB of 48 x top-8 uint8 ids)

_ON_LOOP: ContextVar[bool] = ContextVar("replay_read_on_loop", default=False)


class WouldWait(Exception):
    """A read on the event loop reached something it would wait for; it is read in a thread instead."""


@contextmanager
def on_event_loop() -> Iterator[None]:
    """Within: a read that would wait raises `WouldWait` (see `refuse`)."""
    token = _ON_LOOP.set(True)
    try:
        yield
    finally:
        _ON_LOOP.reset(token)


def acquire(lock: threading.Lock, why: str) -> None:
    """Take `lock`: on the event loop only when it is free at once (else `WouldWait`, saying `why`)."""
    if not lock.acquire(blocking=not _ON_LOOP.get()):
        raise WouldWait(why)


def refuse(why: str) -> None:
    """Raise `WouldWait` (saying `why`) when the read runs on the event loop; nothing otherwise."""
    if _ON_LOOP.get():
        raise WouldWait(why)
