"""`RouteSender`, the background sender: routing rows to the replay service; runs in the vLLM plugin's sink process.

Engine-neutral (numpy, pyarrow, httpx; no torch). `submit()` is a copy and an append under a lock, never network or
disk. A batcher thread coalesces rows into row batches (`replay_format.rows`, a per-writer `seq` each) and queues
them up to `max_queue_bytes`, spilling past that, or while the service is down or anything is spilled
(`capture.sender.spill`); a network thread posts the spill, oldest first, then the queue to `/v1/ingest`, retrying
with capped backoff (a retry resends the same `(run_id, writer_id, seq)`). Finish events and prefix-cache references
(`reference()`) travel in the same ordered stream. Rows are dropped only past `max_spill_bytes` (counted, logged).

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import httpx

from capture.sender.config import SenderConfig, SenderStats
from capture.sender.items import Item, ItemMaker, Pending
from capture.sender.row_chunk import RequestIndex, RowChunk
from capture.sender.spill import Spilled, SpillFolder
from replay_format import ARROW_STREAM_MEDIA_TYPE, JSON_MEDIA_TYPE
from replay_format.request_notes import Finish, FinishStatus, Reference
from replay_format.spill import ItemKind

log = logging.getLogger("routing_replay.sender")


class RouteSender:
    """Queues rows and finish events and delivers them in order (see module docstring)."""

    def __init__(self, config: SenderConfig, http: httpx.Client | None = None) -> None:
        self.config = config
        self.stats = SenderStats()
        self._lock = threading.Condition()
        self.spill = SpillFolder(Path(config.spill_dir), config.max_spill_bytes, self._lock)
        # The writer's name on every call: a load balancer in front of replicas keeps a writer on one replica by it
        # (docs/scale_out.md, "Spreading writers"); the service reads the writer from the body, never from here.
        headers = {"x-replay-writer": f"{config.run_id}/{config.writer_id}"}
        if config.token:
            headers["authorization"] = f"Bearer {config.token}"
        self.http = http or httpx.Client(base_url=config.url.rstrip("/"), timeout=config.request_timeout_s,
                                         headers=headers)
        self._items = ItemMaker(config)  # the batcher thread's
        self._pending: list[Pending] = []  # submitted, not yet batched
        self._pending_rows = 0
        self._queue: deque[Item] = deque()
        self._queue_bytes = 0
        self._closing = False
        self._current: Item | None = None  # being delivered
        self._down = False  # the last delivery attempt failed: new batches go to disk
        self._summary_at = time.monotonic()
        self._summarised = self.stats.as_dict()
        self._batcher = threading.Thread(target=self._batch_loop, name="replay-batcher", daemon=True)
        self._network = threading.Thread(target=self._network_loop, name="replay-network", daemon=True)
        self._batcher.start()
        self._network.start()

    # ---- forward-pass side ---------------------------------------------------

    def submit(self, request_ids: str | RequestIndex | Sequence[str], positions, experts, token_ids=None,
               flags=None, weight_version: str | None = None) -> None:
        """Queue rows; copies the arrays (capture buffers are reused next step). Never blocks on I/O.

        `request_ids`: one id for all rows, an id per row, or a `RequestIndex` (names and an
        int index into them per row: what a step already has; no per-row strings).
        `token_ids`: NO_TOKEN (-1) where unknown; None when every one is.
        `weight_version`: the label of the weights that computed these rows (`replay_format.weight_versions`);
        None: unknown. Every batch carries the `weight_version` column (null where unknown).
        """
        n = len(positions)
        if n == 0:
            return
        chunk = RowChunk.of(request_ids, positions, experts, token_ids, flags, self.config.shape.dtype,
                            weight_version)
        with self._lock:
            if self._closing:
                raise RuntimeError("sender is closed")
            self._pending.append(chunk)
            self._pending_rows += n
            self.stats.submitted_rows += n
            if self._pending_rows >= self.config.batch_rows:
                self._lock.notify_all()

    def finish(self, request_id: str, num_tokens: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        """Mark a request ended; sent after every row submitted before it."""
        with self._lock:
            self._pending.append(Finish(request_id, int(num_tokens), FinishStatus(status)))
            self._lock.notify_all()

    def reference(self, references: Sequence[Reference]) -> None:
        """Queue prefix-cache references (stored ids), in order with the rows.

        The service resolves each whichever of it and the source's rows comes first.
        """
        if not references:
            return
        with self._lock:
            self._pending.append([Reference(r.request_id, int(r.start), int(r.end), r.source_request_id)
                                  for r in references])

    # ---- batcher -------------------------------------------------------------

    def _take_pending(self) -> list[Pending]:
        with self._lock:
            taken, self._pending, self._pending_rows = self._pending, [], 0
            return taken

    def _batch_loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            with self._lock:
                if not self._closing and self._pending_rows < self.config.batch_rows and not any(
                    isinstance(entry, Finish) for entry in self._pending
                ):
                    self._lock.wait(max(0.0, self.config.flush_interval_s - (time.monotonic() - last_flush)))
                closing = self._closing
            self._log_summary(periodic=True)
            taken = self._take_pending()
            if taken or time.monotonic() - last_flush >= self.config.flush_interval_s:
                last_flush = time.monotonic()
            for item in self._items.items(taken, closing):
                self._enqueue(item)
            if closing and not taken:
                with self._lock:
                    if not self._pending:
                        return

    def _enqueue(self, item: Item) -> None:
        with self._lock:
            fits = self._queue_bytes + len(item.payload) <= self.config.max_queue_bytes
            if fits and not self.spill and not self._down:
                self._queue.append(item)
                self._queue_bytes += len(item.payload)
                self._lock.notify_all()
                return
        self._spill(item)

    # ---- spill ---------------------------------------------------------------

    def _spill(self, item: Item) -> None:
        """Put `item` in the spill folder, or drop it (counted, logged) when the folder is over its budget."""
        if not self.spill.fits(len(item.payload)):
            self.stats.dropped_batches += 1
            self.stats.dropped_rows += item.rows
            log.error(
                "routing-replay: DROPPED %s seq %d (%d rows): spill directory %s is over its %d-byte budget "
                "and the service at %s is not taking data", item.kind.value, item.seq, item.rows, self.spill.path,
                self.spill.max_bytes, self.config.url,
            )
            return
        if self.spill.write(item, self.config.writer_id):
            with self._lock:
                self.stats.spilled_batches += item.kind == ItemKind.BATCH

    # ---- network -------------------------------------------------------------

    def _next_item(self) -> Spilled | Item | None:
        """The next item to post: the spill's oldest, else the queue's; None once closed with nothing left."""
        with self._lock:
            while True:
                spilled = self.spill.oldest()
                if spilled is not None:
                    self._current = spilled.item
                    return spilled
                if self._queue:
                    item = self._queue.popleft()
                    self._queue_bytes -= len(item.payload)
                    self._current = item
                    return item
                if self._closing and not self._batcher.is_alive():
                    return None
                self._lock.wait(0.1)

    def _network_loop(self) -> None:
        while True:
            got = self._next_item()
            if got is None:
                return
            item = got.item if isinstance(got, Spilled) else got
            try:
                self._deliver(item)
            except _GiveUp:
                if not isinstance(got, Spilled):
                    self._spill(item)
                return
            with self._lock:
                if isinstance(got, Spilled):
                    self.spill.remove(got.path)
                    self.stats.drained_batches += item.kind == ItemKind.BATCH
                self._current = None
                self._lock.notify_all()

    def _post(self, item: Item) -> httpx.Response:
        if item.kind == ItemKind.BATCH:
            return self.http.post("/v1/ingest", content=item.payload, headers={"content-type": ARROW_STREAM_MEDIA_TYPE})
        return self.http.post(item.header.path, content=item.payload, headers={"content-type": JSON_MEDIA_TYPE})

    def _deliver(self, item: Item) -> None:
        """Post until acknowledged; 4xx is final (logged, counted), anything else retries."""
        delay = self.config.backoff_initial_s
        while True:
            try:
                answer = self._post(item)
                if answer.status_code < 400:
                    self._down = False
                    if item.kind == ItemKind.BATCH:
                        self.stats.sent_batches += 1
                        self.stats.sent_rows += item.rows
                    elif item.kind == ItemKind.REFERENCES:
                        self.stats.sent_references += 1
                    else:
                        self.stats.sent_finishes += 1
                    return
                if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):
                    self.stats.refused += 1
                    log.error("routing-replay: service refused %s seq %d: %s %s", item.kind.value, item.seq,
                              answer.status_code, answer.text[:500])
                    return
            except httpx.HTTPError as exc:
                log.debug("routing-replay: %s seq %d not delivered: %s", item.kind.value, item.seq, exc)
            self.stats.retried += 1
            if self._closing and self._deadline is not None and time.monotonic() > self._deadline:
                raise _GiveUp()
            # The service is down: what waits in memory goes to disk (it survives this process).
            self._down = True
            self._spill_queue()
            time.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    def _spill_queue(self) -> None:
        with self._lock:
            moving = list(self._queue)
            self._queue.clear()
            self._queue_bytes = 0
        for item in moving:
            self._spill(item)

    # ---- shutdown ------------------------------------------------------------

    _deadline: float | None = None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is acknowledged (True) or timeout (False)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.notify_all()
            while self._pending or self._queue or self.spill or self._current is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = 30.0) -> bool:
        """Send what is left within `timeout`; whatever is unsent then stays spilled on disk."""
        self._deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._batcher.join(timeout)
        done = self.flush(max(0.0, self._deadline - time.monotonic()))
        if not done:
            # Persist the in-memory queue; the network thread's current item is retried until the deadline.
            with self._lock:
                moving = ([self._current] if self._current is not None else []) + list(self._queue)
                self._queue.clear()
                self._queue_bytes = 0
            for item in moving:  # the in-flight one too: if it also lands, the service stores it once
                self._spill(item)
            log.warning("routing-replay: close() timed out; %d items left in %s for the next start",
                        len(self.spill), self.spill.path)
        self._network.join(1.0)
        self._log_summary(periodic=False)
        return done

    def _log_summary(self, periodic: bool) -> None:
        """One counters line: periodic ones at most every summary_interval_s and only after a change."""
        now = time.monotonic()
        if periodic and now - self._summary_at < self.config.summary_interval_s:
            return
        counters = self.stats.as_dict()
        if periodic and counters == self._summarised:
            return
        self._summary_at, self._summarised = now, counters
        log.info("routing-replay sender %s: %s%s", self.config.writer_id, self.stats.summary(),
                 "" if periodic else " (closed)")


class _GiveUp(Exception):
    pass



__all__ = ["RouteSender", "SenderConfig", "SenderStats"]
