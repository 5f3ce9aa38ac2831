"""The workers of `replay-service serve` hold one set of tokens, and a worker that cannot start stops the service
(issue 41), through real servers of two workers (and one of a single process), each connection pinned to a known
worker by asking it `/healthz` (its `pid`):

- an edit to the tokens file, then a worker's death: the replacement holds the tokens every other worker holds (the
  ones in force), not the file as it is now; before, a revoked read token answered 200 on one worker, 401 on the other;
- a reload (`POST /v1/admin/reload-tokens`, or SIGHUP to `serve`) switches every worker to the file at once;
- a file that does not parse is refused (422 naming its line, or a log line for SIGHUP) and changes nothing;
- a worker that cannot build its app (here: the workers' shared folder removed, as logind's RemoveIPC or a temp
  cleaner does, then a worker's death) makes `serve` exit with STARTUP_FAILURE, naming the cause, and the port is
  released; before, uvicorn replaced it with another that failed alike, forever, on a bound port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.service import ServiceProcess, calls
from tests.test_service_workers import KEEP, pinned

READ, WRITE, ADMIN, NEW_READ = "r" * 24, "w" * 24, "a" * 24, "n" * 24
TOKENS = f"{READ} read\n{WRITE} write\n{ADMIN} admin\n"
EDITED = f"{WRITE} write\n{ADMIN} admin\n{NEW_READ} read\n"  # READ revoked, NEW_READ added
BROKEN = f"{ADMIN} admin\n{READ} root\n"  # line 2: no such role
RELOAD = "/v1/admin/reload-tokens"
STARTUP_FAILURE = 3  # uvicorn's exit status of a process that cannot start


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def statuses(workers: dict[int, httpx.Client], token: str) -> dict[int, int]:
    """Each worker's answer to a read with `token`: 200, or 401 for a token it does not hold."""
    return {pid: http.get("/v1/runs", headers=bearer(token)).status_code for pid, http in workers.items()}


def replace_a_worker(service: ServiceProcess, victim: int) -> dict[int, httpx.Client]:
    """kill -9 of `victim`; once uvicorn's replacement has answered, one pinned connection per worker."""
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    answered: set[int] = set()
    while not (victim not in (now := service.worker_pids()) and len(now) == 2 and now <= answered):
        assert time.monotonic() < deadline, f"no replacement worker: {service.log_path.read_text()[-3000:]}"
        try:
            answered.add(calls.get(f"{service.url}/healthz", timeout=5).json()["pid"])  # a new connection each
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    workers = pinned(service.url, 2)
    assert victim not in workers
    return workers


def until_logged(service: ServiceProcess, text: str, after: int, timeout: float = 30.0) -> str:
    """The log past byte `after` once it holds `text` (the supervisor takes a signal in its loop, every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        tail = service.log_path.read_bytes()[after:].decode(errors="replace")
        if text in tail:
            return tail
        assert time.monotonic() < deadline, f"{text!r} never logged: {tail[-3000:]}"
        time.sleep(0.05)


def test_every_worker_holds_the_same_tokens_until_a_reload_switches_them_all(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    env = {"REPLAY_TOKENS_FILE": str(tokens)}
    with ServiceProcess(tmp_path / "data", workers=2, args=KEEP, env=env) as service:
        workers = pinned(service.url, 2)
        assert set(statuses(workers, READ).values()) == {200}
        # the file is edited (READ revoked, NEW_READ added), then a worker dies: its replacement starts meanwhile
        tokens.write_text(EDITED)
        workers = replace_a_worker(service, min(workers))
        assert statuses(workers, READ) == dict.fromkeys(workers, 200), "the replacement read the edited file"
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 401)

        # the admin call, through one worker, switches every worker to the file
        assert next(iter(workers.values())).post(RELOAD, headers=bearer(READ)).status_code == 403  # admin only
        done = next(iter(workers.values())).post(RELOAD, headers=bearer(ADMIN))
        assert done.status_code == 200, done.text
        assert done.json() == {"generation": 2, "tokens": 3, "file": str(tokens)}
        assert statuses(workers, READ) == dict.fromkeys(workers, 401)
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 200)
        workers = replace_a_worker(service, max(workers))  # a replacement holds the reloaded tokens
        assert statuses(workers, READ) == dict.fromkeys(workers, 401)
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 200)

        # a file that does not parse: refused with its line named, every worker keeps generation 2
        tokens.write_text(BROKEN)
        for http in workers.values():
            refused = http.post(RELOAD, headers=bearer(ADMIN))
            assert refused.status_code == 422, refused.text
            assert f"{tokens}:2" in refused.json()["detail"] and "generation 2" in refused.json()["detail"]
        assert statuses(workers, READ) == dict.fromkeys(workers, 401)
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 200)
        assert service.proc is not None
        logged = service.log_path.stat().st_size
        os.kill(service.proc.pid, signal.SIGHUP)  # the same through SIGHUP to the parent: a log line
        assert f"{tokens}:2" in until_logged(service, "SIGHUP: tokens not reloaded", logged)
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 200)
        assert statuses(workers, ADMIN) == dict.fromkeys(workers, 200)

        # SIGHUP to the parent with a file that parses: every worker switches, none is replaced
        tokens.write_text(TOKENS)
        before = service.worker_pids()
        logged = service.log_path.stat().st_size
        os.kill(service.proc.pid, signal.SIGHUP)
        until_logged(service, "(generation 3)", logged)
        assert statuses(workers, READ) == dict.fromkeys(workers, 200)
        assert statuses(workers, NEW_READ) == dict.fromkeys(workers, 401)
        assert service.worker_pids() == before == set(workers)  # uvicorn's own SIGHUP replaces every worker


def test_one_process_reloads_alike(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    with ServiceProcess(tmp_path / "data", env={"REPLAY_TOKENS_FILE": str(tokens)}) as service, \
            httpx.Client(base_url=service.url, timeout=30) as http:
        tokens.write_text(EDITED)
        assert http.get("/v1/runs", headers=bearer(READ)).status_code == 200  # read at start, not per request
        tokens.write_text(BROKEN)
        refused = http.post(RELOAD, headers=bearer(ADMIN))
        assert refused.status_code == 422 and f"{tokens}:2" in refused.json()["detail"], refused.text
        tokens.write_text(EDITED)
        assert http.post(RELOAD, headers=bearer(ADMIN)).json()["generation"] == 2
        assert http.get("/v1/runs", headers=bearer(READ)).status_code == 401
        assert http.get("/v1/runs", headers=bearer(NEW_READ)).status_code == 200
        tokens.write_text(TOKENS)
        assert service.proc is not None
        logged = service.log_path.stat().st_size
        os.kill(service.proc.pid, signal.SIGHUP)
        until_logged(service, "(generation 3)", logged)
        assert http.get("/v1/runs", headers=bearer(READ)).status_code == 200
        assert http.get("/v1/runs", headers=bearer(NEW_READ)).status_code == 401


def test_an_open_service_has_no_tokens_to_reload(shared_service):
    refused = httpx.post(f"{shared_service.url}{RELOAD}", timeout=30)
    assert refused.status_code == 409 and "no tokens file" in refused.json()["detail"], refused.text


def shared_folder(worker: int) -> Path:
    """The folder a worker shares with the others (its metrics folder's parent: ops/workers.py)."""
    environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0") if item)
    return Path(environ[b"PROMETHEUS_MULTIPROC_DIR"].decode()).parent


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_worker_that_cannot_start_stops_the_service_naming_why(tmp_path):
    (tmp_path / "tokens").write_text(TOKENS)
    service = ServiceProcess(tmp_path / "data", workers=2, env={"REPLAY_TOKENS_FILE": str(tmp_path / "tokens")}).start()
    try:
        assert service.proc is not None
        victim = min(service.worker_pids())
        folder = shared_folder(victim)
        shutil.rmtree(folder)  # what logind's RemoveIPC does to a user's /dev/shm, or a cleaner to an old /tmp folder
        os.kill(victim, signal.SIGKILL)
        try:
            service.proc.wait(60)  # a replacement starts, fails, and the supervisor stops every worker
        except subprocess.TimeoutExpired:
            pytest.fail(f"the service still runs: {service.log_path.read_text()[-3000:]}")
        log = service.log_path.read_text()
        assert service.proc.returncode == STARTUP_FAILURE, log[-3000:]
        last = log.strip().splitlines()[-1]
        assert last.startswith("replay-service: stopped: worker ") and "could not build its app" in last, last
        assert "FileNotFoundError" in last and str(folder) in last, last
        assert refused(service.port)
    finally:
        service.stop()
