"""uvicorn's HTTP/1.1 protocol with two bounds it lacks: idle new connections and the number of connections.

uvicorn starts its keep-alive timer only after a response, so a connection that never sends a
request stays open for ever, and `limit_concurrency` counts it: a few hundred idle sockets make
every later request a 503. Here the same timer (`timeout_keep_alive`) also runs from the moment
a connection is made (any byte received stops it, as uvicorn does between requests), and a
connection past `limit_concurrency` is closed at once instead of being held.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("replay_service")


class BoundedH11Protocol(H11Protocol):
    """H11Protocol whose new connections time out when idle and are refused past the connection limit."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Register the connection; close it when over the limit, else start its idle timer."""
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            log.warning("closing a new connection: %d open, the limit is %d (REPLAY_MAX_CONNECTIONS)",
                        len(self.connections) - 1, self.limit_concurrency)
            transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
