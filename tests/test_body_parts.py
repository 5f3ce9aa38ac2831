"""Request bodies through the service's HTTP protocol arrive whole, however their parts fall.

`BoundedHttpToolsProtocol.on_body` keeps a part that arrives alone as the bytes it came as (no copy) and joins
parts that arrive before the app reads them (ops/connections.py). Through a real uvicorn on loopback with that
protocol, bodies sent in parts of every size (one byte, around uvicorn's 64 KiB high-water mark, megabytes), with
pauses between some parts and two requests in one send, reach the app byte-equal; and a real ingest through
the same protocol stores rows that read back byte-equal.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_service.app import create_app
from replay_service.ops.connections import PROTOCOL
from replay_service.settings import ServiceSettings
from tests.support.data import batch_bytes, routes
from tests.support.service import read_answers, served_in_thread

HIGH_WATER = 1 << 16  # uvicorn's flow_control.HIGH_WATER_LIMIT


async def _digest_app(scope, receive, send) -> None:
    """Answers the SHA-256 of the request body and how many ASGI messages brought it; slow to start reading, so
    that parts arriving meanwhile wait together (joined by `on_body`)."""
    if scope["type"] != "http":
        return
    await asyncio.sleep(0.02)
    digest, parts, more = hashlib.sha256(), 0, True
    while more:
        message = await receive()
        digest.update(message.get("body", b""))
        parts += 1
        more = message.get("more_body", False)
    answer = f"{digest.hexdigest()} {parts}".encode()
    headers = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def _request(body: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("part", [1, 4093, HIGH_WATER - 1, HIGH_WATER + 1, 1 << 20])
def test_bodies_in_parts_of_every_size_arrive_whole(part):
    rng = np.random.default_rng(part)
    sizes = [0, 1, HIGH_WATER - 1, HIGH_WATER, HIGH_WATER + 1, 3 * (1 << 20) + 7]
    if part == 1:
        sizes = [0, 1, 300, 5000]  # a byte at a time: small bodies only
    with served_in_thread(_digest_app, http=PROTOCOL, loop="uvloop") as port, \
            socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, size in enumerate(sizes):
            body = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            wire = _request(body)
            for k, lo in enumerate(range(0, len(wire), part)):
                sock.sendall(wire[lo : lo + part])
                if k % 7 == i % 7 and part > 1:
                    time.sleep(0.002)  # now and then the app reads before the next part arrives
            digest, _ = read_answers(sock, 1)[0][1].split()
            assert digest.decode() == hashlib.sha256(body).hexdigest(), (part, size)
        # Two requests in one send: the second's body follows the first's in the same parts.
        first, second = (rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (HIGH_WATER * 3 + 5, 77))
        sock.sendall(_request(first) + _request(second))
        digests = [body.split()[0].decode() for _, body in read_answers(sock, 2)]
        assert digests == [hashlib.sha256(b).hexdigest() for b in (first, second)]


def test_an_ingest_through_the_protocol_reads_back_byte_equal(tmp_path):
    app = create_app(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    rng = np.random.default_rng(9)
    experts = routes(rng, 12000)  # a body of several high-water marks
    positions = np.arange(12000, dtype=np.int32)
    with served_in_thread(app, http=PROTOCOL, loop="uvloop") as port:
        client = ReplayClient(f"http://127.0.0.1:{port}")
        try:
            assert client.ingest(batch_bytes("parts", "w", 0, ["r"] * 12000, positions, experts)).stored
            assert client.get_route("parts", "r", strict=True).experts.tobytes() == experts.tobytes()
        finally:
            client.close()
