"""The STALE table's feed between hosts: replicas on one PostgreSQL index learn each other's recently stored rows.

Contract: `note` queues the rows this process stored and its table remembered (bounded; no ingest waits on the
feed); a thread (`start`, `close`) publishes them to the index every `interval_s` and adds every other host's entries
of the last `window_s` to this host's table (checks/recent.py). Lossy by design: a flush that fails is dropped and
counted, never retried.
Design: docs/design/ingest.md ("The STALE feed between replicas").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import numpy as np

from replay_service.checks.recent import RecentRows
from replay_service.store.index import Index

_RECORD = np.dtype([("hash", "<u8"), ("request", "<i8"), ("position", "<i4"), ("token", "<i4")])
_LOOKBACK = 64  # entries numbered before the newest read, read again: one committed out of number order is not lost
_PAGE = 256  # entries read per query
log = logging.getLogger("replay_service")


def pack(hashes: np.ndarray, request: np.ndarray, position: np.ndarray, token: np.ndarray) -> bytes:
    """Rows as one feed entry's records (the format `unpack` reads; private to this module and the index's table)."""
    out = np.empty(len(hashes), _RECORD)
    out["hash"], out["request"], out["position"], out["token"] = hashes, request, position, token
    return out.tobytes()


def unpack(records: bytes) -> np.ndarray:
    """A feed entry's rows (a structured array with fields hash, request, position, token)."""
    return np.frombuffer(records, _RECORD)


class FeedCounter(Protocol):
    """Where the feed counts the rows it moves (`metrics.ServiceMetrics.stale_feed_rows`): `labels(direction).inc(n)`
    with direction published, learnt or dropped."""

    def labels(self, direction: str) -> Any: ...


class _NoCounter:
    def labels(self, direction: str) -> Any:
        return self

    def inc(self, amount: int = 1) -> None:
        pass


class StaleFeed:
    """One process's side of the feed: `note` in the ingest path, `start` / `close` around its thread."""

    def __init__(self, index: Index, table: RecentRows, host: str, interval_s: float, window_s: float,
                 max_pending_rows: int = 1 << 22) -> None:
        """`host` names this host's entries (every process of one `serve` shares it: their table is one)."""
        self.index = index
        self.table = table
        self.host = host
        self.interval_s = interval_s
        self.window_s = window_s
        self.max_pending_rows = max_pending_rows
        self.counter: FeedCounter = _NoCounter()  # the app gives its metrics' counter (app.py)
        self._pending: list[bytes] = []
        self._pending_rows = 0
        self._lock = threading.Lock()  # the rows noted
        self._round = threading.Lock()  # one round at a time (the thread's, and `close`'s or a caller's)
        self._seen: set[int] = set()  # entry numbers read, within the lookback
        self._after = 0
        self._pruned_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stale-feed", daemon=True)
        self.round_at: float | None = None  # when the last round finished (the feed's lag is the time since)

    def start(self) -> StaleFeed:
        """Start the thread that publishes and learns every `interval_s`."""
        self._thread.start()
        return self

    def note(self, hashes: np.ndarray, request: np.ndarray, position: np.ndarray, token: np.ndarray) -> None:
        """Rows this process stored and its table remembered, to publish with the next flush (bounded: past
        `max_pending_rows` the rows are dropped and counted)."""
        if not len(hashes):
            return
        with self._lock:
            if self._pending_rows + len(hashes) > self.max_pending_rows:
                self.counter.labels("dropped").inc(len(hashes))
                return
            self._pending.append(pack(hashes, request, position, token))
            self._pending_rows += len(hashes)

    def step(self) -> None:
        """One round: publish what was noted, learn what other hosts published, drop entries past the window."""
        with self._round:
            self._step()

    def _step(self) -> None:
        with self._lock:
            pending, rows = self._pending, self._pending_rows
            self._pending, self._pending_rows = [], 0
        now = time.time()
        if pending:
            try:
                self.index.publish_recent(self.host, now, b"".join(pending))
                self.counter.labels("published").inc(rows)
            except Exception:  # any error (the index unreachable): these rows are not shared; the table is lossy
                self.counter.labels("dropped").inc(rows)
                log.warning("STALE feed: %d rows not published (the index did not take them)", rows, exc_info=True)
        self._learn(now)
        if now - self._pruned_at > 60:  # every process prunes about once a minute (a delete of nothing is cheap)
            self.index.prune_published(now - self.window_s)
            self._pruned_at = now
        self.round_at = time.time()

    def _learn(self, now: float) -> None:
        """Add the other hosts' entries not read yet: their numbers first (a few bytes each, the lookback included),
        then the rows of the unread ones only."""
        while True:
            ids = self.index.published_ids(max(0, self._after - _LOOKBACK), now - self.window_s, self.host, _PAGE)
            unread = [i for i in ids if i not in self._seen]
            if unread:
                for entry in self.index.published(unread[0], unread[-1], self.host):
                    if entry.feed_id in self._seen:
                        continue
                    self._seen.add(entry.feed_id)
                    rows = unpack(entry.records)
                    self.table.check_and_add(rows["hash"], rows["request"], rows["position"], rows["token"],
                                             np.ones(len(rows), np.bool_))
                    self.counter.labels("learnt").inc(len(rows))
            if ids:
                self._after = max(self._after, ids[-1])
                self._seen = {i for i in self._seen if i > self._after - _LOOKBACK}
            if len(ids) < _PAGE or not unread:
                return

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # any error: logged, and the next round tries again
                log.warning("STALE feed round failed", exc_info=True)

    def close(self) -> None:
        """Publish what is noted and stop the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        try:
            self.step()
        except Exception:  # any error: the index is closing too
            pass
