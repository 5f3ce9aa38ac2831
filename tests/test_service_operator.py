"""What an operator meets with `replay-service serve`, through real services of two workers (issue 52).

- A refusal that leaves a request body unread closes the connection: an upload declaring 1 GiB gets its 413 and
  the connection is closed after the bytes already in flight (unfixed, the server read and dropped the whole GiB);
  the same for a chunked body past the limit and for a 401 given before the body.
- `kill -9` of the `serve` parent leaves its shared folder (STALE table, tokens snapshot, metrics: RAM on
  /dev/shm); the next `serve` removes it. Under a writer, three crashes in a row leave one folder: the live one's.
- A bad setting or argument is refused in one line naming it, its value and what it needs, with exit status 2.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from replay_service.ops.workers import OWNER_FILE, SHARED_PREFIX
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, free_port

pytestmark = pytest.mark.slow  # services of two workers, killed and started again

TOKEN = "operator-writes-0123456789"
LIMIT = 4 << 20  # REPLAY_MAX_BODY_BYTES here: a chunked body passes it after four chunks
CHUNK = 1 << 20
ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("operator")
    (root / "tokens").write_text(f"{TOKEN} write\n")
    with ServiceProcess(root / "data", workers=2, env={"REPLAY_TOKENS_FILE": str(root / "tokens"),
                                                       "REPLAY_MAX_BODY_BYTES": str(LIMIT)}) as proc:
        yield proc


def _upload(port: int, head: bytes, body_chunk, limit_s: float = 30.0) -> tuple[bytes, int]:
    """Send `head`, then `body_chunk()` over and over until the server closes the connection: (the answer's head,
    the body bytes sent). The limit is a hang guard, not a timing assertion."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        s.settimeout(0.0)
        sent, answer, pending = 0, b"", b""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                pending = pending or body_chunk()
                done = s.send(pending)
                sent, pending = sent + done, pending[done:]
            except BlockingIOError:
                time.sleep(0.001)  # the server reads no faster: let it answer
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                got = s.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                break
            if not got:
                break
            answer += got
        else:
            pytest.fail(f"the connection was still open after {sent >> 20} MiB sent")
    return answer.split(b"\r\n\r\n")[0], sent


def _headers(head: bytes) -> dict[bytes, bytes]:
    lines = head.split(b"\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines if b":" in line)}


def test_an_upload_declaring_1_gib_is_refused_and_its_connection_closed_at_once(service):
    head = (b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\n\r\n" % (TOKEN.encode(), ARROW.encode(), 1 << 30))
    started = time.monotonic()
    answer, sent = _upload(service.port, head, lambda: b"\0" * CHUNK)
    print(f"413 and close after {sent >> 20} MiB, {time.monotonic() - started:.3f} s")  # reported, not asserted
    assert answer.startswith(b"HTTP/1.1 413") and _headers(answer)[b"connection"] == b"close"
    assert sent < 64 << 20  # what was in flight; unfixed: the whole GiB, read and dropped


def test_a_chunked_body_past_the_limit_is_refused_and_closed(service):
    head = (b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: %s\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % (TOKEN.encode(), ARROW.encode()))
    chunk = b"%x\r\n%s\r\n" % (CHUNK, b"\0" * CHUNK)
    answer, sent = _upload(service.port, head, lambda: chunk)
    assert answer.startswith(b"HTTP/1.1 413") and _headers(answer)[b"connection"] == b"close"
    assert LIMIT < sent < LIMIT + (64 << 20)


def test_a_refusal_before_the_body_closes_the_connection(service):
    head = (b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (ARROW.encode(), 1 << 30))
    answer, sent = _upload(service.port, head, lambda: b"\0" * CHUNK)
    assert answer.startswith(b"HTTP/1.1 401") and _headers(answer)[b"connection"] == b"close"
    assert sent < 64 << 20
    with httpx.Client(base_url=service.url, headers={"authorization": f"Bearer {TOKEN}"}) as http:
        body = batch_bytes("operator", "w", 0, ["r"] * 4, np.arange(4), routes(np.random.default_rng(1), 4))
        ok = http.post("/v1/ingest", content=body, headers={"content-type": ARROW})
        assert ok.status_code == 200 and "connection" not in ok.headers  # a body read whole keeps its connection


# ---- the shared folder of a crashed parent -------------------------------------------------------------------


def _folders_of(pids: set[int]) -> list[Path]:
    """The shared folders (wherever serve put them: /dev/shm, else the temp folder) whose owner is one of `pids`."""
    import tempfile

    found = []
    for place in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        for folder in place.glob(f"{SHARED_PREFIX}*"):
            try:
                if int((folder / OWNER_FILE).read_text().split()[0]) in pids:
                    found.append(folder)
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_a_crash_loop_under_a_writer_leaves_one_shared_folder(tmp_path):
    """Three `kill -9`s of the parent while a writer posts, each followed by a new `serve` on the same data
    directory: after each start, the crashed parent's folder is gone and the new one's is there."""
    data = tmp_path / "data"
    port = free_port()
    stop = threading.Event()
    acknowledged: list[int] = []

    def writer() -> None:
        rng = np.random.default_rng(7)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            seq = 0
            while not stop.is_set():
                body = batch_bytes("crash", "w", seq, [f"r{seq}"] * 8, np.arange(8), routes(rng, 8))
                try:
                    if http.post("/v1/ingest", content=body, headers={"content-type": ARROW}).status_code == 200:
                        acknowledged.append(seq)
                        seq += 1
                except httpx.HTTPError:
                    time.sleep(0.05)  # down between a crash and the next start

    parents: set[int] = set()
    thread = threading.Thread(target=writer, daemon=True)
    try:
        for crash in range(4):
            service = ServiceProcess(data, port=port, workers=2).start()
            parents.add(service.proc.pid)
            if crash == 0:
                thread.start()
            (mine,) = _folders_of({service.proc.pid})
            assert _folders_of(parents) == [mine], f"start {crash}: folders of crashed parents are left"
            if crash == 3:
                service.stop()
                break
            time.sleep(0.5)  # the writer's batches land
            workers = service.worker_pids()
            service.kill9()
            _wait_gone(workers)
            assert mine.exists()  # what a crash leaves, until the next start
    finally:
        stop.set()
        thread.join(10)
    assert _folders_of(parents) == []  # a clean stop removes its own
    assert acknowledged, "the writer never stored a batch"


def _wait_gone(pids: set[int], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s  # a hang guard: workers die with their parent (PR_SET_PDEATHSIG)
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---- start-up refusals ---------------------------------------------------------------------------------------


REFUSALS = {
    "integer": ({"REPLAY_MAX_CONNECTIONS": "abc"}, [], "REPLAY_MAX_CONNECTIONS='abc': Input should be a valid integer"),
    "data-file": ({}, ["--data", "{file}"], "--data='{file}': it names a file: the store needs a directory"),
    "option-bound": ({}, ["--max-connections", "0"], "--max-connections='0': Input should be greater than or equal "
                                                     "to 1"),
    "index-url": ({"REPLAY_INDEX_URL": "mysql://db/x"}, [], "REPLAY_INDEX_URL='mysql://db/x': the index is a "
                                                            "PostgreSQL database"),
    "two-at-once": ({"REPLAY_WORKERS": "-1", "REPLAY_HOT_READS": "soon"}, [],
                    "REPLAY_WORKERS='-1': Input should be greater than or equal to 0; REPLAY_HOT_READS='soon': "
                    "Input should be 'event_loop' or 'thread'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_setting_is_refused_in_one_line(tmp_path, case):
    env, args, said = REFUSALS[case]
    file = tmp_path / "a-file"
    file.write_text("")
    args = [a.format(file=file) for a in args]
    command = [sys.executable, "-m", "replay_service.ops.cli", "serve", "--port", "0",
               *(args if "--data" in args else ["--data", str(tmp_path / "data"), *args])]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"replay-service: {said.format(file=file)}"), lines[0]
