"""The sink process: turns a worker's captured steps into rows for the service.

One per sending worker (or engine core's tee), started by `handoff.StepHandoff` (`main(FD, STATUS_FD)`). It reads
frames (`replay_format.step_frame`) from the pipe in order (configuration, steps and finish events, close), maps
rows to the user's request ids and drops rejected spec-decode rows (`StepBook`), and hands them to a `RouteSender`.
End of input (the worker exited, even by kill -9) closes the sender like a close frame; requests left without a
finish are finished from the engine cores' journals (`capture.vllm.finish_notes`, waited for up to
`JOURNAL_WAIT_S`). It claims its spill directory in the shared spill root and sends what stopped sinks left first.

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from capture.sender import RouteSender, SenderConfig
from capture.vllm.config import ENV_SINK_TOKEN
from capture.vllm.finish_notes import live_writers, read_notes
from capture.vllm.log import log
from capture.vllm.sink.book import StepBook
from capture.vllm.sink.spill_root import adopt, claim, release
from replay_format import FormatError
from replay_format.request_notes import Finish, FinishStatus, Reference
from replay_format.step_frame import (
    LENGTH,
    CloseFrame,
    ConfigFrame,
    Ended,
    FinishFrame,
    FrameReader,
    ReferencesFrame,
    StepFrame,
)

_READ_SIZE = 1 << 20
# Below the engine's processes: the sink needs a few percent of a core on average and has
# seconds of slack (the pipe, then the worker's backlog); vLLM's engine core is on every
# step's critical path. At the same priority, its bursts delayed the engine's steps.
_NICE = 10
# One line per HTTP request (httpx logs each at INFO) would flood the engine's log.
_QUIET_LOGGERS = ("httpx", "httpcore")
# At the end of the stream, how long to wait for a running engine core's last finish notes (it
# aborts the requests still running only as it stops, possibly after this sink's worker is gone).
JOURNAL_WAIT_S = 10.0


def read_frames(fd: int, pause_s: float = 0.02) -> Iterator[bytes | None]:
    """Frame bodies from the pipe, in order, until end of input; None after each read's frames.

    Read in bursts: after draining the pipe the sink sleeps `pause_s` before reading
    again, so it wakes ~50 times a second rather than once per step. Woken per step,
    it preempted vLLM's engine-core process on the shared core each time, and the
    engine's steps waited on that (bench/vllm_overhead.py: on/off 0.87 vs 0.98 without
    sending). A frame cut short by the writer's death is dropped.
    """
    pending = bytearray()
    while chunk := os.read(fd, _READ_SIZE):
        pending += chunk
        at = 0
        while len(pending) - at >= LENGTH.size:
            (size,) = LENGTH.unpack_from(pending, at)
            end = at + LENGTH.size + size
            if end > len(pending):
                break
            yield bytes(pending[at + LENGTH.size : end])
            at = end
        del pending[:at]
        yield None  # end of what this read brought
        if len(chunk) < _READ_SIZE:  # drained: let the next frames gather
            time.sleep(pause_s)


class Sink:
    """Steps and finish events to rows and finish calls, in order.

    Plain steps (no spec decode) that arrive together are merged and handed to the sender
    as one: the bookkeeping and the copies then run once per read rather than once per step;
    steps of another weight version than the held ones are not merged with them (a hand-over is one version).
    """

    def __init__(self, sender: RouteSender) -> None:
        self.sender = sender
        self.book = StepBook()
        self._plain: list[StepFrame] = []

    def step(self, frame: StepFrame) -> None:
        """One step, in order with the others."""
        if frame.drafts is None:
            if self._plain and self._plain[-1].weight_version != frame.weight_version:
                self.flush()
            self._plain.append(frame)
            return
        self.flush()
        self._rows(frame)

    def finish(self, ended: list[Ended]) -> None:
        """Requests that ended: their finish calls go after their rows."""
        self.flush()
        for end in ended:
            if end.remote_decode:  # its rows are sent; the decode engine's writer finishes it
                self.book.forget(end.request_id)
                continue
            self._finish(self.book.finish(end.request_id, end.num_tokens, end.status))

    def finish_from_journals(self, spill_root: Path, wait_s: float = JOURNAL_WAIT_S) -> int:
        """Finish the requests still open at the end of the stream from the engine cores' journals; how many.

        Reads again every 50 ms, up to `wait_s`, while some are still open and an engine core with a
        journal under `spill_root` still runs.
        """
        self.flush()
        deadline = time.monotonic() + wait_s
        finished = 0
        while self.book.requests:
            notes = read_notes(spill_root)
            for internal in [rid for rid in self.book.requests if rid in notes]:
                status, num_tokens = notes[internal]
                done = self.book.finish(internal, num_tokens, FinishStatus(status))
                if done is not None:
                    self._finish(done)
                    finished += 1
            if not self.book.requests or not live_writers(spill_root) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if finished:
            log.info("routing-replay sink: %d requests finished from the engine core's journal", finished)
        return finished

    def references(self, references: list[Reference]) -> None:
        """Prefix-cache hits, in stored ids, to the sender (the service resolves them in either order with rows)."""
        mapped = [self.book.reference(r) for r in references]
        self.sender.reference([m for m in mapped if m is not None])

    def _finish(self, done: Finish | None) -> None:
        if done is not None:
            self.sender.finish(done.request_id, done.num_tokens, done.status)

    def flush(self) -> None:
        """Hand the plain steps held so far to the sender."""
        group, self._plain = self._plain, []
        if len(group) > 1:
            group = [_merged(group)]
        for frame in group:
            self._rows(frame)

    def _rows(self, frame: StepFrame) -> None:
        keep = self.book.keep_mask(frame)
        kept = self.book.row_ids(frame, keep)
        if not kept.requests.index.size:
            return
        sel = np.flatnonzero(kept.keep)
        self.sender.submit(kept.requests, positions=frame.positions[sel], experts=frame.experts[sel],
                           token_ids=frame.token_ids[sel], flags=frame.flags[sel], weight_version=frame.weight_version)


def _merged(group: list[StepFrame]) -> StepFrame:
    """Consecutive plain steps of one weight version as one (a request appears once per step it ran in)."""
    offsets = np.cumsum([0] + [f.num_tokens for f in group])
    query_start_loc = np.concatenate([f.query_start_loc[:-1] + off for f, off in zip(group, offsets)] + [offsets[-1:]])
    return StepFrame(
        req_ids=[rid for f in group for rid in f.req_ids],
        query_start_loc=query_start_loc.astype(np.int32),
        positions=np.concatenate([f.positions for f in group]),
        token_ids=np.concatenate([f.token_ids for f in group]),
        experts=np.concatenate([f.experts for f in group]),
        flags=np.concatenate([f.flags for f in group]),
        weight_version=group[0].weight_version,
    )


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def main(fd: int, status_fd: int | None = None) -> int:
    """Run the sink on pipe `fd` until close or end of input; 2 when the stream cannot be read at all.

    `status_fd`: the status pipe of a detached sink (`capture.vllm.sink.launch.SinkProcess`); the
    exit status is written there as a decimal line when the sink is done, and the pipe closed.
    """
    code = 1  # an exception: what the interpreter would exit with
    try:
        code = _serve(fd)
    finally:
        if status_fd is not None:
            try:
                os.write(status_fd, b"%d\n" % code)
                os.close(status_fd)
            except OSError:
                pass  # the worker is gone: nobody waits for the status
    return code


def _serve(fd: int) -> int:
    _configure_logging()
    os.nice(_NICE)
    for stop in (signal.SIGINT, signal.SIGTERM):  # the worker's end of the pipe decides when to stop
        signal.signal(stop, signal.SIG_IGN)
    bodies = read_frames(fd)
    reader = FrameReader()
    first = next((body for body in bodies if body is not None), None)
    try:
        config = reader.read(first) if first is not None else None
        if not isinstance(config, ConfigFrame):
            raise FormatError("the stream does not start with a configuration frame")
        sender_config = SenderConfig.from_dict(config.sender, config.shape, os.environ.get(ENV_SINK_TOKEN) or None)
    except FormatError as exc:
        log.error("routing-replay sink: cannot read the worker's frames (%s); exiting, nothing is captured", exc)
        return 2
    own = Path(sender_config.spill_dir)
    lock = claim(own.parent, own.name)  # before the sender reads its directory
    try:
        adopt(own.parent, own)
    except OSError as exc:  # what others left stays where it is; this sink's own rows still go
        log.error("routing-replay sink: cannot take over what stopped writers left in %s: %s", own.parent, exc)
    sender = RouteSender(sender_config)
    sink = Sink(sender)
    close_timeout = 30.0
    for body in bodies:
        what = "frame"
        try:
            if body is None:
                sink.flush()
                continue
            frame = reader.read(body)
            what = type(frame).__name__
            if isinstance(frame, StepFrame):
                sink.step(frame)
            elif isinstance(frame, FinishFrame):
                sink.finish(frame.ended)
            elif isinstance(frame, ReferencesFrame):
                sink.references(frame.references)
            elif isinstance(frame, CloseFrame):
                close_timeout = frame.timeout_s
                break
        except Exception:  # any error: one bad step must not stop the others
            log.exception("routing-replay sink: failed to handle a %s", what)
    try:
        sink.flush()
        sink.finish_from_journals(own.parent, min(JOURNAL_WAIT_S, close_timeout / 3))
    except Exception:  # any error: the sender still closes (it spills what it cannot send)
        log.exception("routing-replay sink: failed to hand over the last steps")
    sender.close(close_timeout)
    release(own.parent, own.name, lock)
    return 0
