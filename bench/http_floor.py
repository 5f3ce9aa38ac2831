"""The HTTP floor: a server that does nothing but send bytes it already holds, in its own process.

A benchmark reads the same answer from it as from the service, with the same client, to show what the
client's HTTP stack and the loopback socket alone cost on this machine: no service can be faster than that
from that client. Every request on a keep-alive connection is answered with the one body given, by one thread
per connection writing the whole answer with `sendall`; a request's own body (its Content-Length) is received
into a scratch buffer and dropped, so writers posting to it measure the floor of sending (`bench/ingest.py`).

    with BytesServer(body) as url:
        httpx.Client().get(url).content == body

`uvicorn_floor` is the same answer from the service's own HTTP stack with nothing behind it: uvicorn with the
service's options (httptools, uvloop, as many worker processes) running a bare ASGI app that reads each request's
body through `receive`, drops it and answers. Between the two floors and the service, a bench can tell the
socket's cost from uvicorn's and from the service's own.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.service import ServiceProcess

END_OF_HEADERS = b"\r\n\r\n"
ROOT = Path(__file__).resolve().parent.parent
ANSWER_VARIABLE = "HTTP_FLOOR_ANSWER"  # the floor app's answer body, hex, for uvicorn's worker processes
TYPE_VARIABLE = "HTTP_FLOOR_CONTENT_TYPE"


def _content_length(head: bytes) -> int:
    """A request head's Content-Length (0 without one)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _answer_each_request(conn: socket.socket, answer: bytes) -> None:
    """Send `answer` once per request received on `conn` (its body read and dropped), until the client closes."""
    pending = b""
    scratch = memoryview(bytearray(1 << 20))
    with conn:
        while True:
            while END_OF_HEADERS not in pending:
                data = conn.recv(1 << 16)
                if not data:
                    return
                pending += data
            head, pending = pending.split(END_OF_HEADERS, 1)
            length = _content_length(head)
            body_left = length - len(pending)
            pending = pending[length:]  # what came after this body: the next request's start
            while body_left > 0:
                got = conn.recv_into(scratch[: min(body_left, len(scratch))])
                if not got:
                    return
                body_left -= got
            conn.sendall(answer)


def _serve(listener: socket.socket, body: bytes, content_type: str) -> None:
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type.encode() +
              b"\r\ncontent-length: " + str(len(body)).encode() + END_OF_HEADERS + body)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_answer_each_request, args=(conn, answer), daemon=True).start()


class BytesServer:
    """A loopback HTTP/1.1 server, in a child process, answering every request with `body`; its URL on entry."""

    def __init__(self, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.process = multiprocessing.get_context("fork").Process(
            target=_serve, args=(self.listener, body, content_type), daemon=True)

    def __enter__(self) -> str:
        self.process.start()
        host, port = self.listener.getsockname()
        return f"http://{host}:{port}"

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.process.kill()
        self.process.join()
        self.listener.close()


def floor_app() -> Any:
    """The bare ASGI app `uvicorn_floor` runs (uvicorn's factory, called in each worker): every request's body is
    received and dropped, and the answer in the environment sent; `/healthz` answers this worker's pid, as the
    service's does (`ServiceProcess` waits until every worker has answered it)."""
    body = bytes.fromhex(os.environ[ANSWER_VARIABLE])
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", os.environ[TYPE_VARIABLE].encode()),
                         (b"content-length", str(len(body)).encode())]}
    health = f'{{"pid": {os.getpid()}}}'.encode()
    health_start = {"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(health)).encode())]}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        healthz = scope["path"] == "/healthz"
        await send(health_start if healthz else start)
        await send({"type": "http.response.body", "body": health if healthz else body})

    return app


@contextmanager
def uvicorn_floor(body: bytes, content_type: str = "application/octet-stream",
                  workers: int = 1) -> Iterator[ServiceProcess]:
    """uvicorn with the service's HTTP options (its protocol, `ops.connections.PROTOCOL`; uvloop) and `workers`
    processes, answering every request with `body`: a child process started, awaited and stopped as the service is
    (`ServiceProcess`, with this module as the program it runs; its `url`, and its processes for their CPU)."""
    with tempfile.TemporaryDirectory(prefix="uvicorn-floor-") as scratch, ServiceProcess(
            Path(scratch) / "data", env={ANSWER_VARIABLE: body.hex(), TYPE_VARIABLE: content_type},
            program=[sys.executable, "-m", "bench.http_floor"], cwd=ROOT, workers=workers) as floor:
        yield floor


if __name__ == "__main__":  # uvicorn_floor's child, given the command line ServiceProcess gives `serve`
    import argparse

    import uvicorn

    from replay_service.ops.connections import PROTOCOL

    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    for option in ("--data", "--host", "--log-level"):
        parser.add_argument(option)
    for option in ("--port", "--workers"):
        parser.add_argument(option, type=int)
    args = parser.parse_args()
    uvicorn.run("bench.http_floor:floor_app", factory=True, host=args.host, port=args.port, workers=args.workers,
                http=PROTOCOL, loop="uvloop", log_level=args.log_level, access_log=False)
