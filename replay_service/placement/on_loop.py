"""Reads on the event loop: a hot read served where it arrives, without the hand-off to a thread and back.

Contract: inside `on_event_loop()`, whatever would make a read wait raises `WouldWait` before waiting (`refuse`,
`acquire`), and the caller reads in a thread instead: a segment not opened yet (`SegmentCache.get`), more than
`MAX_ROWS` rows (`RouteStore.read_rows`), the run registry's lock held (`RunRegistry.get`). Only a local store's reads
come here (`RouteStore.reads_on_loop`; `REPLAY_HOT_READS=thread` keeps every read in a thread).
Design: docs/design/store.md ("Reads on the event loop").
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
