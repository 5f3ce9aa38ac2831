"""Connections through a real 2-worker server on loopback (issue 41): slow request heads are bounded
(REPLAY_HEADER_TIMEOUT_S) and give way to real requests at the connection limit, so a writer gets through a flood
of them; a client that hangs up mid-upload is a 499 in one log line, never a 5xx."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
MAX_CONNECTIONS = 8  # per worker: slots scarce enough for a flood of a few dozen sockets
HEADER_TIMEOUT_S = 2
LINE_EVERY_S = 0.5  # a slow head's pace: one header line each, never the blank line that ends the head


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data = tmp_path_factory.mktemp("connections")
    env = {"REPLAY_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "REPLAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    with ServiceProcess(data / "data", workers=2, env=env, log_path=data / "service.log") as service:
        yield service


def _trickle(port: int, first: bytes, piece: bytes, lines: int) -> bytes | None:
    """Send `first`, then `piece` every LINE_EVERY_S up to `lines` times; what the server answered once it closed
    the connection (b"" when it said nothing), None when it was still open after the last piece."""
    with socket.create_connection(("127.0.0.1", port), timeout=LINE_EVERY_S) as sock:
        sock.sendall(first)
        answer = b""
        for _ in range(lines):
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
                return answer
            except TimeoutError:
                pass
            except ConnectionResetError:
                return answer
            try:
                sock.sendall(piece)
            except OSError:  # closed meanwhile: read what it said before
                continue
        return None


def _kept_alive_then_trickled(port: int) -> bytes | None:
    """A request answered 200 on a connection, then the next request's head trickled on it (as `_trickle`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        head, rest = first.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(rest) < length:
            rest += sock.recv(65536)
        sock.settimeout(LINE_EVERY_S)
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        answer = b""
        for line in range(8 * HEADER_TIMEOUT_S):
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
                return answer
            except TimeoutError:
                sock.sendall(b"x-slow-%d: y\r\n" % line)
        return None


def test_a_request_head_must_arrive_within_the_header_timeout(service):
    """A head sent a line at a time, on a new connection, after a kept-alive request, or as blank lines where a head
    is due: each connection is answered 408 (or, blank lines only, closed) once REPLAY_HEADER_TIMEOUT_S has passed,
    where it stayed open for as long as the lines came before (each byte stopped the idle timer)."""
    lines = 8 * HEADER_TIMEOUT_S  # 4x the timeout at LINE_EVERY_S
    results: dict[str, bytes | None] = {}
    cases = {
        "new connection": lambda: _trickle(service.port, b"POST /v1/ingest HTTP/1.1\r\n", b"x-slow: y\r\n", lines),
        "kept alive": lambda: _kept_alive_then_trickled(service.port),
        "blank lines": lambda: _trickle(service.port, b"\r\n", b"\r\n", lines),
    }

    def run(name: str) -> None:
        try:
            results[name] = cases[name]()
        except Exception as exc:  # shown by the assertions below, not lost in the thread
            results[name] = repr(exc).encode()

    threads = [threading.Thread(target=run, args=(name,)) for name in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    still_open = [name for name, answer in results.items() if answer is None]
    assert not still_open, f"still open after {lines * LINE_EVERY_S:g} s of a slow head: {still_open}"
    for name in ("new connection", "kept alive"):
        assert results[name].startswith(b"HTTP/1.1 408"), (name, results[name])
        assert b"REPLAY_HEADER_TIMEOUT_S" in results[name] and b"application/json" in results[name], results[name]
    assert calls.get(f"{service.url}/healthz").status_code == 200


class Flood:
    """`count` slow-head connections (as `_trickle`, never done) until `stop` or `flood_s`: each one the server
    closes connects again, so the flood keeps every slot it can take. `answers` counts how each ended: its status
    line's code, or "closed" without one."""

    def __init__(self, port: int, count: int, flood_s: float) -> None:
        self.port, self.count, self.flood_s = port, count, flood_s
        self.opened = 0
        self.answers: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._all(),), daemon=True)

    async def _all(self) -> None:
        until = asyncio.get_running_loop().time() + self.flood_s
        await asyncio.gather(*(self._one(until) for _ in range(self.count)))

    async def _one(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < until and not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            self.opened += 1
            try:
                writer.write(b"POST /v1/ingest HTTP/1.1\r\nhost: x\r\n")
                line = 0
                while loop.time() < until and not self.stop.is_set():
                    try:
                        answer = await asyncio.wait_for(reader.read(65536), LINE_EVERY_S)
                    except TimeoutError:
                        writer.write(b"x-slow-%d: y\r\n" % line)
                        line += 1
                        continue
                    self.answers[answer.split()[1].decode() if answer else "closed"] += 1
                    break
            except OSError:
                self.answers["closed"] += 1
            finally:
                writer.close()
            await asyncio.sleep(0.1)

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def test_a_writer_gets_through_a_flood_of_slow_heads_that_fills_every_connection_slot(service):
    """20 slow-head connections for 16 slots (8 per worker): the flood holds every slot (a connection of it is turned
    away), then a writer posts 10 ingests on one keep-alive client: each is answered 200, as connections still
    sending their heads give way to it (answered 503). Before, the flood held the slots for as long as it went on and
    the writer's connections were closed at once (0 of 10 through)."""
    with Flood(service.port, 2 * MAX_CONNECTIONS + 4, flood_s=60) as flood:
        deadline = time.monotonic() + 20
        while flood.opened < flood.count or not flood.answers:  # every slot taken: one of the flood was turned away
            assert time.monotonic() < deadline, f"the flood did not fill the slots: {flood.opened} opened"
            time.sleep(0.05)
        time.sleep(2 * LINE_EVERY_S)  # the turned-away ones connect again: both workers full
        rng = np.random.default_rng(41)
        bodies = [batch_bytes("flooded", "w", seq, [f"r{seq}"] * 8, np.arange(8), routes(rng, 8)) for seq in range(10)]
        statuses: list = []
        with httpx.Client(base_url=service.url, timeout=10) as writer:
            for data in bodies:
                try:
                    statuses.append(writer.post("/v1/ingest", content=data, headers=ARROW).status_code)
                except httpx.TransportError as exc:
                    statuses.append(type(exc).__name__)
        answers = dict(flood.answers)
    print(f"flood: {flood.opened} connections, ended {answers}; writer: {statuses}")
    assert statuses == [200] * 10, f"writer: {statuses}; flood: {answers}"
    assert answers.get("503", 0) >= 1, answers  # the writer's requests took slots the flood held
    assert ReplayClient(service.url).run("flooded").rows == 10 * 8


def _ingest_counts(service: ServiceProcess) -> Counter[str]:
    """replay_http_request_seconds_count of ingests and finishes, by route and status (the whole service's)."""
    counts: Counter[str] = Counter()
    for line in calls.get(f"{service.url}/metrics").text.splitlines():
        found = re.match(r'replay_http_request_seconds_count\{(.*)\} (\S+)$', line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) if found else {}
        if labels.get("route") in ("/v1/ingest", "/v1/runs/{run}/requests/{request}/finish"):
            counts[f"{labels['route']} {labels['status']}"] += int(float(found.group(2)))
    return counts


def _aborted(port: int, head: bytes, sent: bytes) -> None:
    """A request whose head and `sent`, the start of its body, arrive; then the client closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + sent)
        time.sleep(0.2)  # the server has the head and the first bytes: the request is under way


def test_an_upload_aborted_mid_body_is_a_499_in_one_log_line(service):
    """An ingest and a finish whose senders close their connections mid-body: /metrics counts each as a 499 and
    no 5xx, and the log has one line for each, no traceback. Before, the ingest was an 'unexpected error' with a
    traceback counted as a 500 (the 5xx alert fired for a client's abort), and the finish a 400."""
    before = _ingest_counts(service)
    log_start = service.log_path.stat().st_size
    _aborted(service.port, f"POST /v1/ingest HTTP/1.1\r\nhost: x\r\ncontent-type: {ARROW_STREAM_MEDIA_TYPE}\r\n"
             "content-length: 100000\r\n\r\n".encode(), b"\0" * 1000)
    _aborted(service.port, b"POST /v1/runs/aborted/requests/r/finish HTTP/1.1\r\nhost: x\r\n"
             b"content-type: application/json\r\ncontent-length: 40\r\n\r\n", b'{"num_tokens": ')
    deadline = time.monotonic() + 20
    while (new := _ingest_counts(service) - before).total() < 2:  # both counted, whatever their status
        assert time.monotonic() < deadline, f"not counted: {new}"
        time.sleep(0.1)
    assert new == {"/v1/ingest 499": 1, "/v1/runs/{run}/requests/{request}/finish 499": 1}, new
    assert not [line for line in calls.get(f"{service.url}/metrics").text.splitlines()
                if line.startswith("replay_http_request_seconds_count") and 'status="5' in line]
    # each log line was written before its request was counted (the handler logs, then the latency middleware counts)
    with open(service.log_path, "rb") as log:
        log.seek(log_start)
        written = log.read().decode(errors="replace")
    assert "Traceback" not in written, written
    for path in ("/v1/ingest", "/v1/runs/aborted/requests/r/finish"):
        lines = [line for line in written.splitlines() if path in line]
        assert len(lines) == 1 and "closed the connection" in lines[0] and "499" in lines[0], written
