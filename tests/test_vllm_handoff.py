"""The worker -> sink process hand-off, against a real service process (no vLLM needed).

What the plugin's hooks do per step, without the engine: `StepHandoff.step` with the
scheduler's internal ids, then `finish`. Shown: routes land under the user's ids, equal;
spec-decode steps drop rejected rows; a stopped sink (SIGSTOP) never makes `step` wait
and loses nothing; closing the pipe without a close frame (a worker killed) still
delivers; a dead sink is counted, not hung on.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from capture.vllm import frames
from capture.vllm.handoff import StepHandoff
from replay_format import RunShape
from replay_service.client import ReplayClient

SHAPE = RunShape(num_moe_layers=4, top_k=8, num_experts=64)
ROWS_PER_REQUEST = 6


def _handoff(service, tmp_path, run_id: str, **kw) -> StepHandoff:
    return StepHandoff({
        "url": service.url, "run_id": run_id, "writer_id": "w0", "source": "vllm-plugin",
        "spill_dir": str(tmp_path / "spill"), "flush_interval_s": 0.05,
        "shape": {"num_moe_layers": SHAPE.num_moe_layers, "top_k": SHAPE.top_k, "num_experts": SHAPE.num_experts,
                  "moe_layers": tuple(SHAPE.moe_layers)},
    }, token=None, **kw)


def _steps(num_steps: int, requests: int, seed: int = 0):
    """Decode-like steps: each request adds ROWS_PER_REQUEST rows per step."""
    rng = np.random.default_rng(seed)
    for step in range(num_steps):
        n = requests * ROWS_PER_REQUEST
        experts = np.stack([np.stack([rng.choice(64, 8, replace=False) for _ in range(4)]) for _ in range(n)])
        yield {
            "req_ids": [f"user-{r}-0123abcd" for r in range(requests)],  # vLLM's internal ids
            "query_start_loc": np.arange(requests + 1, dtype=np.int32) * ROWS_PER_REQUEST,
            "positions": np.tile(np.arange(step * ROWS_PER_REQUEST, (step + 1) * ROWS_PER_REQUEST, dtype=np.int32), requests),
            "token_ids": rng.integers(0, 1000, n),
            "experts": experts.astype(np.uint8),
            "flags": np.zeros(n, np.uint16),
        }


def _expected(steps, requests):
    return {f"user-{r}": np.concatenate([s["experts"][r * ROWS_PER_REQUEST:(r + 1) * ROWS_PER_REQUEST] for s in steps])
            for r in range(requests)}


def _finish_all(handoff, requests, num_steps):
    handoff.finish([(f"user-{r}-0123abcd", num_steps * ROWS_PER_REQUEST + 1, "finished") for r in range(requests)])


def _assert_routes(url, run_id, expected):
    client = ReplayClient(url)
    for request_id, rows in expected.items():
        summary = client.request(run_id, request_id)
        assert summary["status"] == "finished" and summary["rows"] == len(rows)
        route = client.get_route(run_id, request_id, strict=True)
        assert route.experts.tobytes() == rows.tobytes()


def test_steps_land_under_the_users_ids(service, tmp_path):
    steps = list(_steps(20, requests=3))
    handoff = _handoff(service, tmp_path, "h1")
    for step in steps:
        handoff.step(**step)
    _finish_all(handoff, 3, 20)
    assert handoff.close(30.0) and handoff.proc.returncode == 0
    _assert_routes(service.url, "h1", _expected(steps, 3))


def test_spec_decode_rejected_rows_dropped(service, tmp_path):
    step = next(_steps(1, requests=2))
    handoff = _handoff(service, tmp_path, "h2")
    # Request 0 verified 5 drafts, 2 accepted (+ the bonus token: 3 sampled): rows 3..5 are dropped.
    handoff.step(**step, spec={"user-0-0123abcd": [1, 2, 3, 4, 5]}, sampled={"user-0-0123abcd": 3, "user-1-0123abcd": 1})
    handoff.finish([("user-0-0123abcd", 4, "finished"), ("user-1-0123abcd", 7, "finished")])
    assert handoff.close(30.0)
    client = ReplayClient(service.url)
    assert client.request("h2", "user-0")["rows"] == 3
    assert client.get_route("h2", "user-0").experts.tobytes() == step["experts"][:3].tobytes()
    assert client.get_route("h2", "user-1").experts.tobytes() == step["experts"][6:].tobytes()


def test_stopped_sink_never_blocks_a_step_and_loses_nothing(service, tmp_path):
    steps = list(_steps(400, requests=8, seed=1))  # ~6 MB of frames: far over the 1 MiB pipe
    handoff = _handoff(service, tmp_path, "h3")
    os.kill(handoff.pid, signal.SIGSTOP)
    try:
        for step in steps:  # would hang here if a full pipe made `step` wait
            handoff.step(**step)
        assert handoff._backlog_bytes > 0  # the pipe filled; the rest waits in memory
    finally:
        os.kill(handoff.pid, signal.SIGCONT)
    _finish_all(handoff, 8, 400)
    assert handoff.close(60.0) and handoff.lost_frames == 0
    _assert_routes(service.url, "h3", _expected(steps, 8))


def test_worker_gone_without_close_still_delivers(service, tmp_path):
    steps = list(_steps(10, requests=2, seed=2))
    handoff = _handoff(service, tmp_path, "h4")
    for step in steps:
        handoff.step(**step)
    _finish_all(handoff, 2, 10)
    os.close(handoff._fd)  # what the kernel does when the worker dies (kill -9)
    handoff._fd = -1
    assert handoff.proc.wait(60) == 0
    _assert_routes(service.url, "h4", _expected(steps, 2))


def test_dead_sink_is_counted_not_waited_for(service, tmp_path, caplog):
    handoff = _handoff(service, tmp_path, "h5")
    handoff.proc.kill()
    handoff.proc.wait()
    for step in _steps(3, requests=1):
        handoff.step(**step)
    assert handoff.lost_frames >= 3
    assert "sink process" in caplog.text and "lost" in caplog.text


@pytest.mark.parametrize("with_tokens", [True, False])
def test_packed_step_frame_round_trip(with_tokens):
    step = next(_steps(1, requests=3, seed=3))
    step["req_ids"] = ["plain-0123abcd", "ünïcode-0123abcd", "with\nnewline"]
    step["flags"][4] = 2
    if not with_tokens:
        step["token_ids"] = None
    frame = frames.pack_step(**step)
    kind, got = frames.unpack(frame[frames.LENGTH.size:], np.uint8, (4, 8))
    assert kind == "step" and got.req_ids == step["req_ids"]
    for name in ("query_start_loc", "positions", "experts", "flags"):
        np.testing.assert_array_equal(getattr(got, name), step[name])
    assert (got.token_ids is None) if not with_tokens else np.array_equal(got.token_ids, step["token_ids"])
