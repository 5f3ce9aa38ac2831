"""Runs in the vLLM process that captures (a worker, or the engine core's tee): its steps go over a pipe to its sink.

`start_sink(config, shape, writer_prefix, source)` starts one sink (outside vLLM's process tree: `launch.py`) and
returns its `StepHandoff`, the pipe. What the forward thread pays per step: one non-blocking `write` of the step's
frame; if the pipe is full, frames wait in an in-memory backlog a helper thread writes as the sink reads, and only
past `max_backlog_bytes` does `send` wait. A dead sink is an error logged once and its frames are counted as lost
(`lost_frames`). At the process's exit (`close(wait=False)`, registered by `start_sink`) the backlog is written out
and the pipe closed without waiting for the sink, which finishes on its own.

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import threading
import time
from collections import deque
from multiprocessing.util import Finalize
from typing import IO

from capture.sender.config import SenderConfig
from capture.vllm.config import PluginConfig
from capture.vllm.log import log
from capture.vllm.sink.launch import SinkProcess
from replay_format import RunShape, Source
from replay_format.request_notes import Reference
from replay_format.step_frame import CloseFrame, ConfigFrame, Ended, FinishFrame, ReferencesFrame, StepFrame, pack

_F_SETPIPE_SZ = 1031  # Linux fcntl: grow the pipe (unprivileged up to /proc/sys/fs/pipe-max-size, 1 MiB)


class StepHandoff:
    """Starts the sink process and writes it frames without ever waiting on the forward path (module docstring).

    `output`: where the sink's stdout and stderr go (default: the worker's, so its lines join vLLM's log).
    """

    def __init__(self, config: SenderConfig, max_backlog_bytes: int = 256 * 2**20, output: IO | None = None) -> None:
        read_fd, self._fd = os.pipe()
        try:
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        try:
            self.proc = SinkProcess(read_fd, config.token, output)
        finally:
            os.close(read_fd)
        os.set_blocking(self._fd, False)
        self.max_backlog_bytes = max_backlog_bytes
        self._backlog: deque[memoryview] = deque()  # frames (or their unwritten ends), in order
        self._backlog_bytes = 0
        self._cond = threading.Condition()
        self._flusher: threading.Thread | None = None
        self.lost_frames = 0
        self.backlogged_frames = 0  # frames that found the pipe full (the sink behind)
        self._closed = False
        self._written_out = False  # set at close: every frame reached the pipe
        self._send(pack(ConfigFrame(config.shape, config.to_dict())))

    @property
    def pid(self) -> int:
        """The sink process's id."""
        return self.proc.pid

    def step(self, frame: StepFrame) -> None:
        """Hand one captured step to the sink."""
        self._send(pack(frame))

    def step_packed(self, packed: memoryview) -> None:
        """Hand one step frame already packed (length prefix included) to the sink, e.g. a reused buffer's view.

        The caller may overwrite `packed` once this returns: only the part the pipe did not take is copied.
        """
        self._send(packed, borrowed=True)

    def finish(self, ended: list[Ended]) -> None:
        """Requests that ended, after the steps holding their rows."""
        self._send(pack(FinishFrame(ended)))

    def references(self, references: list[Reference]) -> None:
        """Prefix-cache hits of requests this step scheduled, before the step's frame."""
        self._send(pack(ReferencesFrame(references)))

    def _send(self, packed: bytes | memoryview, borrowed: bool = False) -> None:
        """Hand one frame to the sink; waits only while the backlog is over its bound.

        `borrowed`: `packed` is the caller's to reuse, so what goes to the backlog is a copy.
        """
        frame = memoryview(packed)
        with self._cond:
            if self._fd < 0:
                self.lost_frames += 1
                return
            if not self._backlog:
                try:
                    frame = frame[os.write(self._fd, frame):]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    self._sink_died()
                    return
                if not frame:
                    return
            if borrowed:
                frame = memoryview(bytes(frame))
            self._backlog.append(frame)
            self._backlog_bytes += len(frame)
            self.backlogged_frames += 1
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="replay-handoff", daemon=True)
                self._flusher.start()
            self._cond.notify_all()
            while self._backlog_bytes > self.max_backlog_bytes and self._fd >= 0:
                self._cond.wait(0.1)

    def _flush_loop(self) -> None:
        # Runs only once the pipe has been full: writes the backlog as the sink reads.
        while True:
            with self._cond:
                while not self._backlog and not self._closed:
                    self._cond.wait()
                if not self._backlog or self._fd < 0:  # closed and written out, or the sink is gone
                    return
                fd = self._fd
            writable = select.poll()  # not select(): a worker may hold more than FD_SETSIZE (1024) descriptors
            writable.register(fd, select.POLLOUT)
            writable.poll(500)
            with self._cond:
                if self._fd < 0 or not self._backlog:
                    continue
                head = self._backlog[0]
                try:
                    written = os.write(self._fd, head)
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    self._sink_died()
                    continue
                self._backlog_bytes -= written
                if written < len(head):
                    self._backlog[0] = head[written:]
                else:
                    self._backlog.popleft()
                self._cond.notify_all()

    def _sink_died(self) -> None:  # with the lock held
        self.lost_frames += len(self._backlog) + 1
        log.error("routing-replay: the sink process (pid %d) exited with %s; captured rows from now on are lost",
                  self.proc.pid, self.proc.poll())
        self._backlog.clear()
        self._backlog_bytes = 0
        os.close(self._fd)
        self._fd = -1
        self._cond.notify_all()

    def close(self, timeout: float = 30.0, wait: bool = True) -> bool:
        """Write out the backlog, tell the sink to finish (send or spill within `timeout`), close the pipe.

        With `wait`, then wait for the sink to exit: True if it did. Without (the worker's exit: vLLM
        may kill a worker that lingers, and the sink finishes on its own), True if every frame reached
        the pipe. Later calls only wait, or answer again.
        """
        if not self._closed:
            self._send(pack(CloseFrame(timeout)))
            deadline = time.monotonic() + timeout + 5.0
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                while self._backlog and self._fd >= 0 and time.monotonic() < deadline:
                    self._cond.wait(0.1)
                if self._backlog:
                    self.lost_frames += len(self._backlog)
                    log.error("routing-replay: %d frames were still waiting for the sink (pid %d) at close; lost",
                              len(self._backlog), self.proc.pid)
                    self._backlog.clear()
                    self._backlog_bytes = 0
                if self._fd >= 0:
                    os.close(self._fd)  # end of input for the sink
                    self._fd = -1
            self._written_out = self.lost_frames == 0
        if not wait:
            return self._written_out
        try:
            self.proc.wait(timeout + 5.0)
        except subprocess.TimeoutExpired:
            log.error("routing-replay: the sink process (pid %d) did not finish in %.0f s", self.proc.pid, timeout)
            return False
        return True


def start_sink(config: PluginConfig, shape: RunShape, writer_prefix: str, source: Source) -> StepHandoff:
    """Start this process's sink; it sends as one writer, `source` on its rows, spilling under its own directory.

    The writer id is `writer_prefix` (`vllm-dp0` for a worker, `vllm-tee-dp0` for the engine core's
    tee), this process's id and a random suffix. At the process's exit the hand-off is closed without
    waiting for the sink (`StepHandoff.close`). A `multiprocessing` finalizer, not `atexit`: vLLM's
    workers are `multiprocessing` children, and a forked one ends in `os._exit` (no `atexit`) after
    `multiprocessing.util._exit_function` has run the finalizers, also when a SIGINT or SIGTERM raised
    `SystemExit` in it; in a main process `multiprocessing` runs them from `atexit`.
    """
    writer = f"{writer_prefix}-{os.getpid()}-{os.urandom(3).hex()}"
    handoff = StepHandoff(SenderConfig(
        url=config.url, run_id=config.run_id, shape=shape, writer_id=writer, source=source, token=config.token,
        spill_dir=config.spill_dir / writer,
    ))
    Finalize(None, handoff.close, args=(30.0,), kwargs={"wait": False}, exitpriority=10)
    return handoff
