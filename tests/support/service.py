"""Run a real replay service in a subprocess on a loopback port (tests, benchmarks, notebooks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

# The tests' one-off calls (`calls.get(url)`), in place of httpx's module functions: `httpx.get` builds a client
# per call, and every client loads the CA bundle into a new TLS context (~55 ms here, for plain-http calls
# too); 406 such calls were a third of the fast loop. Like the module functions it keeps no connection
# between calls (no keep-alive: each call connects afresh), so a test sees the same connections as before.
calls = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_in_thread(app: Any, **options: Any) -> Iterator[int]:
    """`app` served by a real uvicorn on loopback in a thread of this process (uvicorn.Config `options`: the HTTP
    protocol, the loop); its port, once it has started."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def read_answers(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """The next `count` HTTP answers on `sock`, each `(head, body)`, content-length framed (answers may arrive
    together: a pipelined request's answer is read after the one before it)."""
    data, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, data = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(data) < length:
            data += sock.recv(65536)
        answers.append((head, data[:length]))
        data = data[length:]
    return answers


PORT_TRIES = 3  # starts on another chosen port when the one chosen was taken before the service bound it


class PortTaken(RuntimeError):
    """The service could not bind the port chosen for it (`ServiceProcess.start` tries another)."""


class ServiceProcess:
    def __init__(self, data_dir: Path, port: int | None = None, env: dict[str, str] | None = None,
                 log_path: Path | None = None, demo: bool = False, cpus: set[int] | None = None, nice: int = 0,
                 args: list[str] | None = None, host: str = "127.0.0.1", netns: str | None = None,
                 program: list[str] | None = None, cwd: Path | None = None, workers: int = 1) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        # a port `free_port` chose may be taken before the service binds it (another process's listener, or the
        # ephemeral source port of any connection on the machine): the first start then moves to another one
        self._may_move = port is None
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or self.data_dir.parent / f"service-{self.port}.log"
        self.demo = demo
        self.cpus = cpus  # pin the service to these CPUs (benchmarks: keep it off the measured cores)
        self.nice = nice  # benchmarks: below the measured processes, as if on another machine
        self.args = list(args or [])  # more `serve` options (e.g. --host 0.0.0.0 --insecure)
        self.host = host  # the address it listens on (not loopback: pass args=["--insecure"] too)
        self.netns = netns  # run it inside this network namespace (`ip netns exec`, which execs: same pid)
        # what runs `serve`: this interpreter's CLI module, or e.g. an installed console script (tests/test_wheel.py)
        self.program = list(program or [sys.executable, "-m", "replay_service.ops.cli"])
        self.cwd = cwd
        # worker processes: 1 unless a test is about several (the service's default, 0, is one per core)
        self.workers = workers
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        """Start the service and wait until every worker answers (RuntimeError naming the log's end otherwise). A
        first start whose chosen port was taken meanwhile tries again on another; a restart keeps its address."""
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start(timeout)
            except PortTaken:
                self.port = free_port()
        return self._start(timeout)

    def _start(self, timeout: float) -> ServiceProcess:
        cmd = [*self.program, "serve", "--data", str(self.data_dir),
               "--host", self.host, "--port", str(self.port), "--log-level", "warning",
               "--workers", str(self.workers)]
        if self.demo:
            cmd.append("--demo")
        cmd += self.args
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self._log = open(self.log_path, "ab")
        logged = self._log.tell()
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=self._place if self.cpus or self.nice else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                log = self.log_path.read_bytes()[logged:].decode(errors="replace")
                if self._may_move and "[Errno 98]" in log:  # EADDRINUSE, as uvicorn words it either way
                    raise PortTaken(self.port)
                raise RuntimeError(f"service exited with {self.proc.returncode}; log: {log[-3000:]}")
            try:
                answer = calls.get(f"{self.url}/healthz", timeout=1.0)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if answer.status_code == 200 and self._every_worker_serves(answer.json()["pid"], deadline):
                self._may_move = False  # a restart (a test's kill and start again) keeps the address it had
                return self
        self.stop()
        raise RuntimeError(f"service did not come up in {timeout}s; log: {self.log_path.read_text()[-3000:]}")

    def _every_worker_serves(self, first: int, deadline: float) -> bool:
        """Wait until each worker has answered /healthz once (on a new connection each time; the kernel hands a
        connection to any worker), so a test never meets a worker still in its start-up. One worker answering
        is not enough: a worker in its lifespan start-up has a stack deeper than faulthandler prints (100
        frames), and a test that signals or kills it meets a process that is not yet what it tests."""
        answered = {first}
        while time.monotonic() < deadline:
            if self.worker_pids() <= answered:
                return True
            try:
                answered.add(calls.get(f"{self.url}/healthz", timeout=1.0).json()["pid"])
            except httpx.HTTPError:
                time.sleep(0.05)
        return False

    def _place(self) -> None:  # in the child, before exec
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if self.nice:
            os.nice(self.nice)

    def children(self) -> dict[int, bytes]:
        """The service process's children now (its workers, multiprocessing's helpers): pid -> command line."""
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = open(f"/proc/{pid}/stat").read()
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:  # ended meanwhile
                continue
            if self.proc is not None and int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                out[int(pid)] = cmdline
        return out

    def worker_pids(self) -> set[int]:
        """The service's worker processes (its children running the app; not multiprocessing's resource tracker)."""
        return {pid for pid, cmdline in self.children().items() if b"spawn_main" in cmdline}

    def thread_stacks(self, wait_s: float = 10.0) -> str:
        """Every thread's stack in the serving processes (each worker, or the one process), as they wrote them to
        the log on SIGUSR1 (replay_service/ops/stacks.py): what a test prints when the service hangs."""
        assert self.proc is not None
        start = self.log_path.stat().st_size
        for pid in sorted(self.worker_pids()) or [self.proc.pid]:
            before = self.log_path.stat().st_size
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            self._until_the_log_rests(before, time.monotonic() + wait_s)  # one at a time: they share the log
        with open(self.log_path, "rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    def _until_the_log_rests(self, size: int, deadline: float) -> None:
        """Wait until the log has grown past `size` and then not grown for 0.2 s (a dump is written in one go by
        the signal handler, but only once its process is scheduled), or until the deadline."""
        last, quiet_since = size, time.monotonic()
        while time.monotonic() < deadline:
            now = self.log_path.stat().st_size
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif now > size and time.monotonic() - quiet_since >= 0.2:
                return
            time.sleep(0.02)

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
