"""Bounded work per request, through a real server: sizes refused before allocation, inputs that were 500s,
slow bodies, idle connections, and a full disk (issue 13, items 2, 3 and 6)."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

from capture.sender import RouteSender, SenderConfig
from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes
from tests.support.service import ServiceProcess, calls, read_answers, served_in_thread

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
NPY = {"content-type": "application/x-npy"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def stored(shared_service):
    """The shared service with run `limits`: request `r` of 11 tokens (10 rows), finished."""
    rng = np.random.default_rng(13)
    body = batch_bytes("limits", "w", 0, ["r"] * 10, np.arange(10), routes(rng, 10))
    assert calls.post(f"{shared_service.url}/v1/ingest", content=body, headers=ARROW).status_code == 200
    assert calls.post(f"{shared_service.url}/v1/runs/limits/requests/r/finish", json={"num_tokens": 11}).is_success
    return shared_service


# Each sizes an allocation far past REPLAY_MAX_LAYOUT_TOKENS (8 Mi tokens by default). The old code planned
# them first (seq_length=2e9 allocated ~15 GiB; these stay small enough to run on it: 422 or 500 there).
TOO_LARGE = [
    ("megatron", {"packing": "bshd", "seq_length": 20_000_000}, "seq_length=20000000"),
    ("megatron", {"packing": "thd", "pad_multiple": 20_000_000}, "pad_multiple=20000000"),
    ("megatron", {"tp_size": 1 << 16, "cp_size": 1 << 8, "sequence_parallel": False}, "pad_multiple=33554432"),
    ("megatron", {"convention": "slime", "data_pad_size_multiplier": 1 << 30}, "total_multiple=1073741824"),
    ("verl", {"prompt_lengths": [2], "prompt_width": 20_000_000, "response_width": 10}, "prompt_width=20000000"),
]


@pytest.mark.parametrize("kind,fields,words", TOO_LARGE)
def test_allocations_are_refused_before_anything_is_allocated(stored, kind, fields, words):
    for run in ("limits", "no-such-run"):  # refused before the store is read: an unknown run is still a 413
        started = time.perf_counter()
        answer = calls.post(f"{stored.url}/v1/trainer/{kind}",
                            json={"sequences": [{"run": run, "request": "r"}], **fields})
        elapsed_ms = (time.perf_counter() - started) * 1e3
        assert answer.status_code == 413, answer.text
        assert answer.headers["content-type"] == "application/json"
        assert words in answer.json()["detail"] and "REPLAY_MAX_LAYOUT_TOKENS" in answer.json()["detail"]
        print(f"{kind} {fields} refused in {elapsed_ms:.1f} ms")  # measured, reported, not asserted
    assert calls.get(f"{stored.url}/healthz").status_code == 200


def _npy(shape) -> bytes:
    out = io.BytesIO()
    np.save(out, np.ones(shape, np.int32))
    return out.getvalue()


DEEP = "[" * 100_000 + "]" * 100_000
SGLANG = {"routed_experts": base64.b64encode(np.ones(4, np.int32).tobytes()).decode(), "num_layers": 1, "top_k": 2,
          "num_experts": 8}

# Each answered 500 (text) on the code of issue 13: (method, path, body or json, headers, params, status, words).
WERE_500 = {
    "deep moe_layers in an SGLang body": (
        "/v1/runs/deep/requests/r/routes", json.dumps(SGLANG)[:-1] + ', "moe_layers": ' + DEEP + "}", JSON, {},
        400, "nested too deeply"),
    "deeply nested SGLang body": ("/v1/runs/deep/requests/r/routes", DEEP, JSON, {}, 400, "nested too deeply"),
    "[Infinity] in a finish": ("/v1/runs/limits/requests/r9/finish", '{"num_tokens": [Infinity]}', JSON, {}, 422,
                               "num_tokens"),
    "[Infinity] in a trainer body": (
        "/v1/trainer/megatron", '{"sequences": [{"run": "limits", "request": "r"}], "moe_ordinals": [Infinity]}',
        JSON, {}, 422, "moe_ordinals"),
    "num_tokens 2^63 in a finish": ("/v1/runs/limits/requests/r9/finish", json.dumps({"num_tokens": 2**63}), JSON,
                                    {}, 422, "num_tokens"),
    "pad_multiple 2^64": ("/v1/trainer/megatron", json.dumps(
        {"sequences": [{"run": "limits", "request": "r"}], "pad_multiple": 2**64}), JSON, {}, 422, "pad_multiple"),
    "tp_size 2^64": ("/v1/trainer/megatron", json.dumps(
        {"sequences": [{"run": "limits", "request": "r"}], "tp_size": 2**64, "sequence_parallel": False}), JSON, {},
        422, "tp_size"),
    "seq_length 2^64": ("/v1/trainer/megatron", json.dumps(
        {"sequences": [{"run": "limits", "request": "r"}], "packing": "bshd", "seq_length": 2**64}), JSON, {}, 422,
        "seq_length"),
    "verl widths 2^64": ("/v1/trainer/verl", json.dumps(
        {"sequences": [{"run": "limits", "request": "r"}], "prompt_lengths": [2], "prompt_width": 2**64,
         "response_width": 1}), JSON, {}, 422, "prompt_width"),
    "verl prompt length 2^64": ("/v1/trainer/verl", json.dumps(
        {"sequences": [{"run": "limits", "request": "r"}], "prompt_lengths": [2**64], "prompt_width": 4,
         "response_width": 10}), JSON, {}, 422, "prompt_lengths"),
    "an .npy of shape (n, 0, K)": ("/v1/runs/empty-layers/requests/r/routes", _npy((3, 0, 2)), NPY,
                                   {"num_experts": 8}, 422, "holds no ids"),
    "a 0-row .npy upload": ("/v1/runs/empty-npy/requests/r/routes", _npy((0, 2, 2)), NPY, {"num_experts": 8}, 422,
                            "holds no ids"),
    "a 0-row SGLang upload": ("/v1/runs/empty-json/requests/r/routes", json.dumps({**SGLANG, "routed_experts": ""}),
                              JSON, {}, 422, "holds no ids"),
}


@pytest.mark.parametrize("name", sorted(WERE_500))
def test_inputs_that_were_500s_are_json_4xx(stored, name):
    path, body, headers, params, status, words = WERE_500[name]
    answer = calls.post(stored.url + path, content=body, headers=headers, params=params, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert words in answer.json()["detail"]
    for run in ("deep", "empty-layers", "empty-npy", "empty-json"):  # a refused upload leaves no (empty) run
        assert calls.get(f"{stored.url}/v1/runs/{run}").status_code == 404


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one request on an open connection and read its whole answer (content-length framed)."""
    sock.sendall(request)
    head, body = read_answers(sock, 1)[0]
    return head + b"\r\n\r\n" + body


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_open(tmp_path):
    # A route that fails as no real one does any more (every known 500 is a 4xx now), on the service's own app
    # served by uvicorn with the service's protocol.
    from replay_service.app import create_app
    from replay_service.ops.connections import BoundedH11Protocol
    from replay_service.settings import ServiceSettings

    app = create_app(ServiceSettings(data_dir=tmp_path / "data"))

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    app.router.routes.insert(0, app.router.routes.pop())  # before the web view's catch-all mount
    with served_in_thread(app, http=BoundedH11Protocol) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        first = _exchange(sock, b"GET /v1/boom HTTP/1.1\r\nhost: x\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 500") and b"application/json" in first and b"RuntimeError" in first
        second = _exchange(sock, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # the same connection
        assert second.startswith(b"HTTP/1.1 200")


def _stalled_upload(url: str, results: list, index: int) -> None:
    """An ingest whose body trickles at 1 byte/s; records the status it ends with (None: never answered)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=1) as sock:
        sock.sendall(f"POST /v1/ingest HTTP/1.1\r\nhost: x\r\ncontent-type: {ARROW_STREAM_MEDIA_TYPE}\r\n"
                     "content-length: 100000\r\n\r\n".encode())
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"\0")
                answer = sock.recv(65536)
                results[index] = int(answer.split()[1]) if answer else None
                return
            except TimeoutError:
                continue  # a second passed: send the next byte
            except OSError:
                return


def test_stalled_uploads_do_not_stop_other_writers(tmp_path):
    env = {"REPLAY_BODY_TIMEOUT_S": "2", "REPLAY_KEEP_ALIVE_TIMEOUT_S": "1"}
    with ServiceProcess(tmp_path / "data", env=env) as service:
        stalled: list = [None] * 8
        threads = [threading.Thread(target=_stalled_upload, args=(service.url, stalled, i)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # every stalled upload has started, more than max_concurrent_ingests (4) of them
        written: list = [None] * 4

        def writer(w: int) -> None:
            rng = np.random.default_rng(w)
            with httpx.Client(base_url=service.url, timeout=15) as client:
                statuses = []
                for seq in range(3):
                    body = batch_bytes("busy", f"w{w}", seq, [f"r{w}"] * 8, np.arange(8) + 8 * seq, routes(rng, 8))
                    try:
                        statuses.append(client.post("/v1/ingest", content=body, headers=ARROW).status_code)
                    except httpx.TimeoutException:
                        statuses.append("timeout")
                written[w] = statuses

        writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in writers:
            t.start()
        for t in writers + threads:
            t.join(60)
        assert written == [[200, 200, 200]] * 4
        assert stalled == [408] * 8
        assert ReplayClient(service.url).run("busy").rows == 4 * 3 * 8

        # an idle connection (nothing sent) is closed after the keep-alive timeout
        with socket.create_connection(("127.0.0.1", service.port), timeout=10) as idle:
            assert idle.recv(1) == b""


ROOT = os.geteuid() == 0


def _fill(path) -> None:
    """Write zeros to `path` until its filesystem is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_a_507_and_recovers(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)]).returncode:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        with ServiceProcess(mount / "data", log_path=tmp_path / "service.log") as service:
            rng = np.random.default_rng(3)
            bodies = [batch_bytes("full", "w", seq, ["r"] * 512, np.arange(512) + 512 * seq, routes(rng, 512))
                      for seq in range(3)]
            assert calls.post(f"{service.url}/v1/ingest", content=bodies[0], headers=ARROW).status_code == 200
            _fill(mount / "filler")
            answer = calls.post(f"{service.url}/v1/ingest", content=bodies[1], headers=ARROW)
            assert answer.status_code == 507, answer.text
            assert "disk is full" in answer.json()["detail"]
            assert not list((mount / "data").rglob("*.tmp")), "a refused write left its .tmp file"

            # the sender treats 507 like an unavailable service: spilled and retried, never refused
            config = SenderConfig(url=service.url, run_id="full-sender", shape=QWEN3_SHAPE,
                                  spill_dir=tmp_path / "spill", flush_interval_s=0.05, backoff_max_s=0.2)
            sender = RouteSender(config)
            sender.submit(["s"] * 8, np.arange(8), routes(rng, 8))
            time.sleep(1.0)
            assert sender.stats.retried >= 1 and sender.stats.refused == 0

            (mount / "filler").unlink()  # space returns
            assert calls.post(f"{service.url}/v1/ingest", content=bodies[1], headers=ARROW).status_code == 200
            assert sender.close(30)
            assert sender.stats.refused == 0
            assert ReplayClient(service.url).run("full").rows == 1024
            assert ReplayClient(service.url).run("full-sender").rows == 8
    finally:
        subprocess.run(["umount", "-l", str(mount)])
