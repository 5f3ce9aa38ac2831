"""uvicorn's HTTP/1.1 protocols with the bounds they lack: idle new connections, slow request heads, and the number
of connections.

`BoundedHttpToolsProtocol` (what `serve` runs: `PROTOCOL`, `protocol(settings)` sets its header timeout) closes a
connection that sends no request within `timeout_keep_alive`, answers a JSON 408 to a request head not complete
`header_timeout_s` (REPLAY_HEADER_TIMEOUT_S) after its first byte, and at `limit_concurrency` makes room by closing
the connection that has waited longest for a head (else closes the newcomer or answers 503, as uvicorn does). It also
writes and receives body parts without uvicorn's copies. `BoundedH11Protocol` has the first two bounds only.

Design: docs/design/service_workers.md.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from replay_service.settings import ServiceSettings

log = logging.getLogger("replay_service")

NOTICE_EVERY_S = 10.0  # connections closed by the bounds are logged in one line per this many seconds per server
_ticks = itertools.count()  # orders connections by when they began waiting for a request head (lower: longer)


class _Closures:
    """Connections one server closed by the bounds, by reason: logged at the first, then once per NOTICE_EVERY_S
    while they go on (a flood of thousands of connections is a few log lines, not thousands)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.flushing = False

    def note(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        """Count one connection closed for `reason`; log now unless a line is already due."""
        self.counts[reason] += 1
        if not self.flushing:
            self._flush(loop)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flushing = bool(self.counts)
        if self.counts:
            log.warning("connections closed (one such line per %g s at most): %s", NOTICE_EVERY_S,
                        "; ".join(f"{count} {reason}" for reason, count in self.counts.items()))
            self.counts.clear()
            loop.call_later(NOTICE_EVERY_S, self._flush, loop)


_closures: weakref.WeakKeyDictionary[Any, _Closures] = weakref.WeakKeyDictionary()  # per uvicorn ServerState


class _Bounded:
    """The two bounds, for either uvicorn protocol (mixed in before it)."""

    limit_concurrency: int | None
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    server_state: Any
    timeout_keep_alive: float
    timeout_keep_alive_task: asyncio.TimerHandle | None
    timeout_keep_alive_handler: Callable[[], None]  # uvicorn's: close the connection when idle

    def connection_made(self, transport: asyncio.Transport) -> None:
        """Register the connection; past the limit make room for it or close it, then start its idle timer."""
        super().connection_made(transport)  # type: ignore[misc]
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency \
                and not self._make_room():
            self._note(f"new, past REPLAY_MAX_CONNECTIONS ({self.limit_concurrency} per worker), with no "
                       "connection to give way")
            self.connections.discard(self)  # its slot is free now, not once the loop reports the connection lost
            transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _make_room(self) -> bool:
        """Close another connection to make room for this one; whether one was closed (here: never)."""
        return False

    def _note(self, reason: str) -> None:
        """Count a connection closed by a bound (logged in one line per NOTICE_EVERY_S)."""
        _closures.setdefault(self.server_state, _Closures()).note(self.loop, reason)


class BoundedH11Protocol(_Bounded, H11Protocol):  # type: ignore[misc]
    """H11Protocol whose new connections time out when idle and are refused past the connection limit."""


class BoundedHttpToolsProtocol(_Bounded, HttpToolsProtocol):  # type: ignore[misc]
    """HttpToolsProtocol with every bound of the module's docstring (idle new connections, slow request heads, the
    number of connections, making room at the limit), whose request bodies reach the app uncopied where they can."""

    timeout_head: float = ServiceSettings.model_fields["header_timeout_s"].default

    def __init__(self, *args: Any, header_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if header_timeout_s is not None:
            self.timeout_head = header_timeout_s
        self.head_open = True  # the next bytes are (part of) a request head: none received, or the last body is in
        self.head_begun = False  # the parser is inside a request head
        self.heads_completed = 0
        self.timeout_head_task: asyncio.TimerHandle | None = None  # armed once a head's first byte is here
        self.waiting_since: int | None = None  # a tick while no request is under way (_ticks); None while one is

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Register the connection as waiting for its first request head, then the two bounds (_Bounded)."""
        self.waiting_since = next(_ticks)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, with the head timer stopped."""
        self._stop_head_timer()
        self.waiting_since = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's (parse, stop the idle timer); the head timer starts when these bytes began a head and left
        it incomplete, or were only blank lines where a head is due."""
        open_before, completed_before = self.head_open, self.heads_completed
        super().data_received(data)
        if self.timeout_head_task is None and self.head_open and not self.transport.is_closing() and (
                self.head_begun or (open_before and self.heads_completed == completed_before)):
            self.timeout_head_task = self.loop.call_later(self.timeout_head, self._head_timed_out)

    def on_message_begin(self) -> None:
        """uvicorn's; a head begins."""
        self.head_begun = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        """The head is here: its timer stops, and at the connection limit a connection with no request under way
        gives way to this request (uvicorn would answer it 503); then uvicorn's (the request starts, or queues)."""
        self._stop_head_timer()
        self.head_open = self.head_begun = False
        self.heads_completed += 1
        self.waiting_since = None
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) >= limit and len(self.tasks) < limit:
            self._make_room()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """uvicorn's; what follows the body is the next request's head."""
        self.head_open = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """uvicorn's (the next pipelined request starts, or the idle timer); with none under way the connection
        waits for its next head from now."""
        super().on_response_complete()
        if self.cycle.response_complete and not self.transport.is_closing():
            self.waiting_since = next(_ticks)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head (none under way), to make room for this
        one; False when every other connection has a request under way."""
        waiting = [c for c in self.connections if c is not self and getattr(c, "waiting_since", None) is not None
                   and not c.transport.is_closing()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since)
        limit = f"REPLAY_MAX_CONNECTIONS ({self.limit_concurrency} per worker)"
        refusal = None if oldest.timeout_head_task is None else (  # idle: closed without a word, as when idle long
            503, f"this connection gave way to another: the service is at {limit} and this request head had not "
                 "all arrived")
        oldest._close(refusal, f"to make room at {limit}, the one waiting longest for a request head")
        return True

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():  # closed meanwhile (a 408 of the body, a shutdown): nothing to bound
            self.timeout_head_task = None
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined head is late: close after
            self.timeout_head_task = None
            self.cycle.keep_alive = False  # the answer under way, as uvicorn's shutdown does
            return
        self._close((408, f"the request head did not arrive within {self.timeout_head:g} s (REPLAY_HEADER_TIMEOUT_S)"),
                    "past REPLAY_HEADER_TIMEOUT_S, the request head incomplete")

    def _close(self, refusal: tuple[int, str] | None, reason: str) -> None:
        """Close now, freeing the slot at once, after answering `refusal` (status, detail) as JSON if given."""
        if refusal is not None:
            self._write_refusal(*refusal)
        self._stop_head_timer()
        self._unset_keepalive_if_required()
        self.waiting_since = None
        self.connections.discard(self)  # its slot is free now, not once the loop reports the connection lost
        self.transport.close()
        self._note(reason)

    def _write_refusal(self, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)

    def _stop_head_timer(self) -> None:
        if self.timeout_head_task is not None:
            self.timeout_head_task.cancel()
            self.timeout_head_task = None

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


def protocol(settings: ServiceSettings) -> Callable[..., BoundedHttpToolsProtocol]:
    """What `serve` passes uvicorn as its HTTP protocol (`http=`): PROTOCOL with the settings' header timeout
    (picklable, for uvicorn's worker processes)."""
    return functools.partial(PROTOCOL, header_timeout_s=settings.header_timeout_s)
