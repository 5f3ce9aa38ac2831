"""The background sender against a real service process: nothing lost, nothing twice, never blocking."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from capture.sender import RouteSender, SenderConfig
from replay_service.client import ReplayClient
from tests.support.service import ServiceProcess, free_port
from tests.support.data import QWEN3_SHAPE, many_routes

STEP_ROWS = 512


def _steps(num_steps: int, requests: int = 8, seed: int = 0):
    """Scheduler-like steps: each request advances by a chunk per step."""
    rng = np.random.default_rng(seed)
    per_request = STEP_ROWS // requests
    for step in range(num_steps):
        ids = [f"req-{r}" for r in range(requests) for _ in range(per_request)]
        positions = np.tile(np.arange(step * per_request, (step + 1) * per_request), requests)
        yield ids, positions, many_routes(rng, STEP_ROWS), rng.integers(0, 50000, STEP_ROWS)


def _expected(num_steps: int, requests: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    out: dict[str, list] = {}
    for ids, positions, experts, _ in _steps(num_steps, requests, seed):
        for r in range(requests):
            sel = np.array(ids) == f"req-{r}"
            out.setdefault(f"req-{r}", []).append(experts[sel])
    return {k: np.concatenate(v) for k, v in out.items()}


def _config(url, spill, **kw) -> SenderConfig:
    kw.setdefault("batch_rows", 2048)
    kw.setdefault("flush_interval_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    return SenderConfig(url=url, run_id="cap", shape=QWEN3_SHAPE, spill_dir=spill, **kw)


def _assert_all_arrived(url, expected, num_tokens=None):
    client = ReplayClient(url)
    run = client.run("cap")
    assert run["rows"] == sum(len(v) for v in expected.values())
    assert run["flagged"]["CONFLICT"] == 0 and run["flagged"]["STALE"] == 0
    for request_id, rows in expected.items():
        route = client.get_route("cap", request_id, strict=True)
        assert route.experts.tobytes() == rows.tobytes()


def test_kill_mid_stream_then_every_row_arrives_once(tmp_path):
    port = free_port()
    data = tmp_path / "data"
    service = ServiceProcess(data, port=port).start()
    sender = RouteSender(_config(service.url, tmp_path / "spill"))
    steps = list(_steps(60))
    for i, (ids, pos, ex, tok) in enumerate(steps):
        sender.submit(ids, pos, ex, token_ids=tok)
        if i == 20:
            sender.flush(30)
            service.kill9()
        if i == 40:
            service = ServiceProcess(data, port=port, log_path=tmp_path / "back.log").start()
    for r in range(8):
        sender.finish(f"req-{r}", 60 * STEP_ROWS // 8 + 1)
    assert sender.close(60)
    try:
        assert sender.stats.retried > 0 and sender.stats.spilled_batches > 0
        assert sender.stats.drained_batches == sender.stats.spilled_batches
        assert sender.stats.sent_rows == 60 * STEP_ROWS and sender.stats.dropped_rows == 0
        _assert_all_arrived(service.url, _expected(60))
        assert ReplayClient(service.url).request("cap", "req-3")["status"] == "finished"
        assert not list((tmp_path / "spill").iterdir())
    finally:
        service.stop()


def test_full_queue_spills_instead_of_blocking(tmp_path):
    port = free_port()  # nothing listens yet
    sender = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill", max_queue_bytes=1 << 20))
    for ids, pos, ex, tok in _steps(40):
        sender.submit(ids, pos, ex, token_ids=tok)
    # Everything submitted went to disk or memory; submit never waited for the network.
    deadline = time.monotonic() + 30
    while sender.stats.spilled_batches < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.stats.spilled_batches >= 5
    assert sender.stats.sent_batches == 0
    with ServiceProcess(tmp_path / "data", port=port):
        assert sender.flush(60)
        assert sender.stats.drained_batches == sender.stats.spilled_batches
        _assert_all_arrived(f"http://127.0.0.1:{port}", _expected(40))
        sender.close(10)


def test_close_flushes_and_leftovers_drain_at_next_start(tmp_path):
    with ServiceProcess(tmp_path / "data") as service:
        sender = RouteSender(_config(service.url, tmp_path / "spill", flush_interval_s=5.0))
        for ids, pos, ex, tok in _steps(5):
            sender.submit(ids, pos, ex, token_ids=tok)
        assert sender.close(30)  # a partial batch still waiting on flush_interval goes out now
        _assert_all_arrived(service.url, _expected(5))

    port = free_port()
    down = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill2"))
    for ids, pos, ex, tok in _steps(6, seed=1):
        down.submit(ids, pos, ex, token_ids=tok)
    assert not down.close(1.0)  # service down: left on disk, not lost
    assert list((tmp_path / "spill2").glob("*.item"))
    with ServiceProcess(tmp_path / "data2", port=port) as service:
        later = RouteSender(_config(service.url, tmp_path / "spill2"))  # a new writer id, same spill dir
        assert later.flush(60)
        later.close(5)
        _assert_all_arrived(service.url, _expected(6, seed=1))


def test_drops_only_past_the_disk_budget_and_says_so(tmp_path, caplog):
    port = free_port()
    sender = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill", max_queue_bytes=1 << 16,
                                 max_spill_bytes=1 << 20, batch_rows=512))
    with caplog.at_level(logging.ERROR, logger="routing_replay.sender"):
        for ids, pos, ex, tok in _steps(20):
            sender.submit(ids, pos, ex, token_ids=tok)
        deadline = time.monotonic() + 30
        while sender.stats.dropped_rows == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sender.stats.dropped_rows > 0
    assert any("DROPPED" in r.message for r in caplog.records)
    sender.close(0.5)


def test_refused_batches_are_counted_not_retried(tmp_path):
    with ServiceProcess(tmp_path / "data") as service:
        sender = RouteSender(_config(service.url, tmp_path / "spill"))
        bad = np.zeros((4, 48, 8), np.uint8)
        sender.submit(["ok"] * 4, np.arange(4), bad)
        sender.submit(["../x"] * 4, np.arange(4), bad)  # an id the service refuses: 422
        assert sender.close(30)
        assert sender.stats.refused >= 1
