"""The HTTP floor: a server that does nothing but send bytes it already holds, in its own process.

A benchmark reads the same answer from it as from the service, with the same client, to show what the
client's HTTP stack and the loopback socket alone cost on this machine: no service can be faster than that
from that client. Every request on a keep-alive connection is answered with the one body given, by one thread
per connection writing the whole answer with `sendall`; a request's own body (its Content-Length) is received
into a scratch buffer and dropped, so writers posting to it measure the floor of sending (`bench/ingest.py`).

    with BytesServer(body) as url:
        httpx.Client().get(url).content == body
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
from types import TracebackType

END_OF_HEADERS = b"\r\n\r\n"


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
