"""uvicorn's HTTP/1.1 protocols with two bounds they lack: idle new connections and the number of connections.

uvicorn starts its keep-alive timer only after a response, so a connection that never sends a
request stays open for ever, and `limit_concurrency` counts it: a few hundred idle sockets make
every later request a 503. Here the same timer (`timeout_keep_alive`) also runs from the moment
a connection is made (any byte received stops it, as uvicorn does between requests), and a
connection past `limit_concurrency` is closed at once instead of being held.

The service runs `BoundedHttpToolsProtocol` (`PROTOCOL`): httptools parses in C and writes each
body part to the transport as it is (a memoryview of the route's ids goes out uncopied), where
h11 joins every body event into new bytes (a copy of every answer, ~20% of a route GET).
(httptools comes with `uvicorn[standard]`, a dependency.) `BoundedH11Protocol` stays, tested alike.

`BoundedHttpToolsProtocol` also receives request bodies with fewer copies. uvicorn appends each part httptools
hands it to a `bytearray` and gives the app `bytes(...)` of it: two copies of every body byte on the event loop
(a 3 MB ingest body: ~1 ms of its ~5 ms there, `bench/ingest.py`). Here a part that arrives while nothing is
waiting to be read is kept as the `bytes` it came as, and `bytes()` of `bytes` is the object itself: no copy. Parts
that arrive before the app reads are joined, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("replay_service")


class _Bounded:
    """The two bounds, for either uvicorn protocol (mixed in before it)."""

    limit_concurrency: int | None
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    timeout_keep_alive: float
    timeout_keep_alive_task: asyncio.TimerHandle | None
    timeout_keep_alive_handler: Callable[[], None]  # uvicorn's: close the connection when idle

    def connection_made(self, transport: asyncio.Transport) -> None:
        """Register the connection; close it when over the limit, else start its idle timer."""
        super().connection_made(transport)  # type: ignore[misc]
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            log.warning("closing a new connection: %d open, the limit is %d (REPLAY_MAX_CONNECTIONS)",
                        len(self.connections) - 1, self.limit_concurrency)
            transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)


class BoundedH11Protocol(_Bounded, H11Protocol):  # type: ignore[misc]
    """H11Protocol whose new connections time out when idle and are refused past the connection limit."""


class BoundedHttpToolsProtocol(_Bounded, HttpToolsProtocol):  # type: ignore[misc]
    """HttpToolsProtocol whose new connections time out when idle and are refused past the connection limit, and
    whose request bodies reach the app uncopied where they can (the module's docstring)."""

    def on_body(self, body: bytes) -> None:
        """uvicorn's `on_body` (read paused past its high-water mark, the app woken), keeping a part as it came
        when it is the only one waiting: the cycle's `receive` then hands it on without copying it."""
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        cycle = self.cycle
        # bytes where uvicorn declares a bytearray: only its `receive` reads it, through bytes(), and resets it
        cycle.body = body if not cycle.body else bytes(cycle.body) + body  # type: ignore[assignment]
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()


PROTOCOL = BoundedHttpToolsProtocol  # what `cli serve` runs
