"""The read paths' plumbing (issue 14): the protocol the service runs, and answers of known length.

Both uvicorn protocols the service may run keep their two bounds (idle new connections, connections
past the limit); the batch read and the trainer slices answer with a Content-Length (built whole,
sent in a few writes) and every byte sent; a batch past the held bound is streamed, the same bytes.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI

from replay_client import ReplayClient
from replay_format import LayerAxis
from replay_format.route import read_routes
from replay_format.rows import Rows, RowsMeta
from replay_service.api import encode
from replay_service.app import open_store
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ops.connections import PROTOCOL, BoundedH11Protocol, BoundedHttpToolsProtocol
from replay_service.settings import ServiceSettings
from tests.support.data import QWEN3_SHAPE, routes, store_requests
from tests.support.service import calls, free_port

RUN = "read-paths"
LENGTHS = {"a": 300, "b": 17, "c": 1025}


def test_the_service_runs_httptools():
    # h11 joins every body part into new bytes; httptools writes a part (a view of the ids) as it is
    assert PROTOCOL is BoundedHttpToolsProtocol


@pytest.fixture(params=[BoundedHttpToolsProtocol, BoundedH11Protocol], ids=["httptools", "h11"])
def bounded_server(request):
    """A uvicorn server of `/ok` with the protocol, a 1 s keep-alive and at most 2 connections."""
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical", http=request.param,
                                           timeout_keep_alive=1, limit_concurrency=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_idle_new_connection_is_closed(bounded_server):
    with socket.create_connection(("127.0.0.1", bounded_server), timeout=10) as idle:
        assert idle.recv(1) == b""  # closed by the server after its keep-alive timeout, no request sent


def test_a_connection_past_the_limit_is_closed_at_once(bounded_server):
    with socket.create_connection(("127.0.0.1", bounded_server), timeout=10), \
            socket.create_connection(("127.0.0.1", bounded_server), timeout=10), \
            socket.create_connection(("127.0.0.1", bounded_server), timeout=10) as third:
        assert third.recv(1) == b""  # closed at once, not held
    for _ in range(100):  # the server serves again once it has seen them go (uvicorn 503s at the limit)
        with socket.create_connection(("127.0.0.1", bounded_server), timeout=10) as again:
            again.sendall(b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n")
            status = again.recv(65536).split(b"\r\n")[0]
        if status == b"HTTP/1.1 200 OK":
            break
        time.sleep(0.02)
    assert status == b"HTTP/1.1 200 OK"


@pytest.fixture(scope="module")
def stored(shared_service):
    """The shared service with run `read-paths`: LENGTHS requests, finished; their routes as sent."""
    with ReplayClient(shared_service.url) as client:
        sent = store_requests(client, RUN, LENGTHS, seed=1414)  # a seed of its own: equal rows elsewhere are STALE
    return shared_service, sent


def test_the_batch_read_has_a_length_and_every_byte(stored):
    service, sent = stored
    names = ["c", "a", "b", "a"]
    answer = calls.post(f"{service.url}/v1/runs/{RUN}/routes/batch", json={"requests": names}, timeout=30)
    assert answer.status_code == 200
    assert answer.headers.get("content-length") == str(len(answer.content))  # built whole, not streamed
    with ReplayClient(service.url) as client:
        got = client.get_routes(RUN, names)
    assert [r.request_id for r in got] == names
    for name, route in zip(names, got):
        assert route.experts.tobytes() == sent[name].tobytes()
        assert route.experts.flags.writeable


def test_the_trainer_slice_has_a_length_and_every_byte(stored):
    service, sent = stored
    with ReplayClient(service.url) as client:
        batch = client.megatron_batch([(RUN, "a"), (RUN, "c")], packing="thd")
    answer = calls.post(f"{service.url}/v1/trainer/megatron", timeout=30,
                        json={"sequences": [{"run": RUN, "request": "a"}, {"run": RUN, "request": "c"}]})
    assert answer.status_code == 200 and answer.headers["content-length"] == str(len(answer.content))
    valid = batch.valid.astype(bool)
    assert batch.experts[valid].tobytes() == np.concatenate([sent["a"], sent["c"]]).tobytes()


@pytest.mark.parametrize("axis", list(LayerAxis))
def test_a_batch_past_the_held_bound_streams_the_same_bytes(tmp_path, monkeypatch, axis):
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        rng = np.random.default_rng(3)
        ids = routes(rng, 40)
        positions = np.concatenate([np.arange(25), np.arange(15)]).astype(np.int32)
        pipeline.ingest(Rows(RowsMeta(RUN, "w", 0, QWEN3_SHAPE), ["x", "y"], np.array([0] * 25 + [1] * 15, np.int32),
                          positions, np.zeros(40, np.int32), ids.reshape(40, -1), np.zeros(40, np.uint16)))
        store.finish(RUN, "x", 26, "finished")
        store.finish(RUN, "y", 20, "finished")  # 4 GAP rows at its end

        def body() -> bytes | list:
            got = encode.batch_answer(store, RUN, ["y", "x"], 0, None, False, 16, axis)
            if isinstance(got, encode.Answer):
                return b"".join(bytes(p) for p in got.parts)
            return [bytes(p) for chunk in got for p in chunk]

        whole = body()
        assert isinstance(whole, bytes)
        monkeypatch.setattr(encode, "HELD_ANSWER_BYTES", 1000)
        streamed = body()
        assert isinstance(streamed, list) and b"".join(streamed) == whole
    finally:
        store.close()


def test_rows_without_token_ids_read_back_as_no_token(tmp_path):
    # the store's and the client's fast path for a column of nulls only (a writer that sends no token ids)
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        ids = routes(np.random.default_rng(4), 6)
        tokens = np.array([5, -1, 7, 8, -1, 9], np.int32)
        for seq, (name, sent) in enumerate((("none", np.full(6, -1, np.int32)), ("some", tokens))):
            pipeline.ingest(Rows(RowsMeta(RUN, "w", seq, QWEN3_SHAPE), [name], np.zeros(6, np.int32),
                              np.arange(6, dtype=np.int32), sent, ids.reshape(6, -1), np.zeros(6, np.uint16)))
            route = store.read_route(RUN, name, 0, 6)
            assert route.token_ids.dtype == np.int32 and route.token_ids.tolist() == sent.tolist()
            answer = encode.route_answer(RUN, route, 0, encode.RouteFormat.ARROW, 4096)
            (got,) = read_routes(bytearray(b"".join(bytes(p) for p in answer.parts)))[1]
            assert got.token_ids.dtype == np.int32 and got.token_ids.tolist() == sent.tolist()
            assert got.token_ids.flags.writeable and got.experts.tobytes() == ids.tobytes()
    finally:
        store.close()
