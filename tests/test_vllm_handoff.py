"""The worker -> sink process hand-off, against a real service process (no vLLM needed).

What the plugin's hooks do per step, without the engine: `StepHandoff.step` with the
scheduler's internal ids, then `finish`. Shown: routes land under the user's ids, equal;
spec-decode steps drop rejected rows; a stopped sink (SIGSTOP) never makes `step` wait
and loses nothing; closing the pipe without a close frame (a worker killed) still
delivers; a dead sink is counted, not hung on; the sink stays quiet in the engine's log
(no line per HTTP request, one summary at close); each step's weight version reaches the service
on every row of it (steps of several versions and of none read back per row); the frame format
(step_frame.md) round-trips every frame kind and the sink refuses a newer major version, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from capture.sender import SenderConfig
from capture.vllm.sink.handoff import StepHandoff
from replay_client.client import ReplayClient
from replay_format import FormatError, RunShape
from replay_format.request_notes import FinishStatus, Reference
from replay_format.step_frame import (
    LENGTH,
    NO_SAMPLE,
    CloseFrame,
    ConfigFrame,
    Ended,
    FinishFrame,
    FrameReader,
    ReferencesFrame,
    StepFrame,
    pack,
)
from tests.support.service import calls

SHAPE = RunShape(num_moe_layers=4, top_k=8, num_experts=64)
ROWS_PER_REQUEST = 6


def _config(service, tmp_path, run_id: str) -> SenderConfig:
    return SenderConfig(url=service.url, run_id=run_id, shape=SHAPE, writer_id="w0", spill_dir=tmp_path / "spill",
                        flush_interval_s=0.05)


def _handoff(service, tmp_path, run_id: str, **kw) -> StepHandoff:
    return StepHandoff(_config(service, tmp_path, run_id), **kw)


def _steps(num_steps: int, requests: int, seed: int = 0):
    """Decode-like steps: each request adds ROWS_PER_REQUEST rows per step."""
    rng = np.random.default_rng(seed)
    for step in range(num_steps):
        n = requests * ROWS_PER_REQUEST
        experts = np.stack([np.stack([rng.choice(64, 8, replace=False) for _ in range(4)]) for _ in range(n)])
        yield StepFrame(
            req_ids=[f"user-{r}-0123abcd" for r in range(requests)],  # vLLM's internal ids
            query_start_loc=np.arange(requests + 1, dtype=np.int32) * ROWS_PER_REQUEST,
            positions=np.tile(np.arange(step * ROWS_PER_REQUEST, (step + 1) * ROWS_PER_REQUEST, dtype=np.int32),
                              requests),
            token_ids=rng.integers(0, 1000, n).astype(np.int32),
            experts=experts.astype(np.uint8),
            flags=np.zeros(n, np.uint16),
        )


def _expected(steps, requests):
    return {f"user-{r}": np.concatenate([s.experts[r * ROWS_PER_REQUEST:(r + 1) * ROWS_PER_REQUEST] for s in steps])
            for r in range(requests)}


def _finish_all(handoff, requests, num_steps):
    handoff.finish([Ended(f"user-{r}-0123abcd", num_steps * ROWS_PER_REQUEST + 1, FinishStatus.FINISHED)
                    for r in range(requests)])


def _assert_routes(url, run_id, expected):
    client = ReplayClient(url)
    for request_id, rows in expected.items():
        summary = client.request(run_id, request_id)
        assert summary.status == "finished" and summary.rows == len(rows)
        route = client.get_route(run_id, request_id, strict=True)
        assert route.experts.tobytes() == rows.tobytes()


def test_steps_land_under_the_users_ids(service, tmp_path):
    steps = list(_steps(20, requests=3))
    handoff = _handoff(service, tmp_path, "h1")
    for step in steps:
        handoff.step(step)
    _finish_all(handoff, 3, 20)
    assert handoff.close(30.0) and handoff.proc.returncode == 0
    _assert_routes(service.url, "h1", _expected(steps, 3))


def test_rows_carry_the_weight_version_of_their_step(service, tmp_path):
    """Steps under "default", then "rl-step-1" (the sink merges only steps of one version), then a 1.2 writer's
    (no version): every row reads back with its step's version, unknown as null."""
    steps = list(_steps(9, requests=2, seed=5))
    versions = ["default"] * 3 + ["rl-step-1"] * 4 + [None] * 2
    handoff = _handoff(service, tmp_path, "h-versions")
    for step, version in zip(steps, versions):
        step.weight_version = version
        handoff.step(step)
    _finish_all(handoff, 2, 9)
    assert handoff.close(30.0) and handoff.proc.returncode == 0
    _assert_routes(service.url, "h-versions", _expected(steps, 2))
    for r in range(2):
        answer = calls.get(f"{service.url}/v1/runs/h-versions/requests/user-{r}/routes", params={"format": "json"})
        assert answer.status_code == 200, answer.text
        got = [row.get("weight_version") for row in answer.json()["rows"]]
        assert got == [v for v in versions for _ in range(ROWS_PER_REQUEST)], got


def test_prefix_cache_hits_read_as_the_computing_requests_rows(service, tmp_path):
    """A request that took positions from the prefix cache reads the rows of the request that computed them."""
    steps = list(_steps(4, requests=2))  # user-0 and user-1 compute positions 0..23
    handoff = _handoff(service, tmp_path, "h-refs")
    # Sent before any row of the run (as when a group's samples hit each other in an engine's first
    # step); user-9 reuses user-0's first 12 positions; a resumed request's hit on its own blocks is no reference.
    handoff.references([Reference("user-9-0123abcd", 0, 12, "user-0-0123abcd"),
                        Reference("user-1-0123abcd", 0, 6, "user-1-0123abcd")])
    for step in steps:
        handoff.step(step)
    own = StepFrame(req_ids=["user-9-0123abcd"], query_start_loc=np.array([0, 2], np.int32),
                    positions=np.array([12, 13], np.int32), token_ids=np.array([7, 8], np.int32),
                    experts=next(_steps(1, requests=1, seed=7)).experts[:2], flags=np.zeros(2, np.uint16))
    handoff.step(own)
    _finish_all(handoff, 2, 4)
    handoff.finish([Ended("user-9-0123abcd", 15, FinishStatus.FINISHED)])
    assert handoff.close(30.0)
    expected = _expected(steps, 2)
    expected["user-9"] = np.concatenate([expected["user-0"][:12], own.experts])
    _assert_routes(service.url, "h-refs", expected)
    summary = ReplayClient(service.url).request("h-refs", "user-9")
    assert summary.referenced_rows == 12 and summary.clean, summary


def test_spec_decode_rejected_rows_dropped(service, tmp_path):
    step = next(_steps(1, requests=2))
    handoff = _handoff(service, tmp_path, "h2")
    # Request 0 verified 5 drafts, 2 accepted (+ the bonus token: 3 sampled): rows 3..5 are dropped.
    step.drafts, step.sampled = np.array([5, 0], np.uint32), np.array([3, 1], np.int32)
    handoff.step(step)
    handoff.finish([Ended("user-0-0123abcd", 4, FinishStatus.FINISHED),
                    Ended("user-1-0123abcd", 7, FinishStatus.FINISHED)])
    assert handoff.close(30.0)
    client = ReplayClient(service.url)
    assert client.request("h2", "user-0").rows == 3
    assert client.get_route("h2", "user-0").experts.tobytes() == step.experts[:3].tobytes()
    assert client.get_route("h2", "user-1").experts.tobytes() == step.experts[6:].tobytes()


def test_stopped_sink_never_blocks_a_step_and_loses_nothing(service, tmp_path):
    steps = list(_steps(400, requests=8, seed=1))  # ~6 MB of frames: far over the 1 MiB pipe
    handoff = _handoff(service, tmp_path, "h3")
    os.kill(handoff.pid, signal.SIGSTOP)
    try:
        for step in steps:  # would hang here if a full pipe made `step` wait
            handoff.step(step)
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
        handoff.step(step)
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
        handoff.step(step)
    assert handoff.lost_frames >= 3
    assert "sink process" in caplog.text and "lost" in caplog.text


def test_sink_is_quiet_and_summarises_once_at_close(service, tmp_path):
    steps = list(_steps(5, requests=2, seed=4))
    with open(tmp_path / "sink.log", "w+") as out:
        handoff = _handoff(service, tmp_path, "h6", output=out)
        for step in steps:
            handoff.step(step)
        _finish_all(handoff, 2, 5)
        assert handoff.close(30.0) and handoff.proc.returncode == 0
        out.seek(0)
        lines = out.read().splitlines()
    _assert_routes(service.url, "h6", _expected(steps, 2))
    assert not [line for line in lines if "HTTP Request" in line], lines  # httpx's line per request is off
    summaries = [line for line in lines if "routing-replay sender w0:" in line]
    assert len(summaries) == 1 and "(closed)" in summaries[0], lines
    assert "2 finishes and 0 reference calls" in summaries[0], summaries


def _round_trip(frame, reader: FrameReader):
    data = pack(frame)
    (size,) = LENGTH.unpack_from(data)
    assert size == len(data) - LENGTH.size
    return reader.read(data[LENGTH.size:])


def test_config_frame_carries_the_models_layer_count():
    """1.1: the plugin's num_hidden_layers (vLLM's get_total_num_hidden_layers) reaches the sink."""
    shape = RunShape(num_moe_layers=2, top_k=8, num_experts=64, moe_layers=(3, 5), num_hidden_layers=7)
    assert _round_trip(ConfigFrame(shape, {}), FrameReader()).shape.num_hidden_layers == 7


def _reader() -> FrameReader:
    reader = FrameReader()
    config = _round_trip(ConfigFrame(SHAPE, {"run_id": "r"}), reader)
    assert config.shape == SHAPE and config.sender == {"run_id": "r"} and reader.config is config
    return reader


@pytest.mark.parametrize("with_tokens", [True, False])
@pytest.mark.parametrize("with_spec", [True, False])
@pytest.mark.parametrize("version", ["rl-step-12", None])
def test_packed_step_frame_round_trip(with_tokens, with_spec, version):
    step = next(_steps(1, requests=3, seed=3))
    step.weight_version = version
    step.req_ids = ["plain-0123abcd", "ünïcode-0123abcd", "with\nnewline"]
    step.flags[4] = 2
    if not with_tokens:
        step.token_ids[:] = -1  # NO_TOKEN: the one spelling of "unknown"
    if with_spec:
        step.drafts, step.sampled = np.array([0, 3, 2], np.uint32), np.array([1, 2, NO_SAMPLE], np.int32)
    got = _round_trip(step, _reader())
    assert isinstance(got, StepFrame) and got.req_ids == step.req_ids
    for name in ("query_start_loc", "positions", "token_ids", "experts", "flags"):
        np.testing.assert_array_equal(getattr(got, name), getattr(step, name))
    if with_spec:
        np.testing.assert_array_equal(got.drafts, step.drafts)
        np.testing.assert_array_equal(got.sampled, step.sampled)
    else:
        assert got.drafts is None and got.sampled is None
    assert got.weight_version == version


def test_a_step_without_a_version_reads_unknown_and_a_bad_label_is_refused():
    """1.3: bit 1 and the label after the request ids; a 1.2 writer's step (no bit) reads as version unknown."""
    reader = _reader()
    plain = next(_steps(1, requests=2, seed=4))
    old = pack(plain)[LENGTH.size:]  # the 1.2 layout: no bit 1, nothing after the request ids
    assert old[1 + 8] & 2 == 0 and reader.read(old).weight_version is None
    plain.weight_version = "v7"
    new = pack(plain)[LENGTH.size:]
    bits = 1 + 8  # kind, rows, requests, then the bits
    assert new[:bits] == old[:bits] and new[bits] == old[bits] | 2 and new[bits + 1 : len(old)] == old[bits + 1 :]
    assert new[len(old):] == b"\x02v7" and reader.read(new).weight_version == "v7"
    with pytest.raises(FormatError, match="not a valid label"):
        reader.read(new[:-2] + b" 7")  # a space: outside the label rule
    with pytest.raises(FormatError, match="step frame"):
        reader.read(new[:-1])  # the label cut short
    plain.weight_version = "two words"
    with pytest.raises(FormatError, match="not a valid label"):
        pack(plain)


def test_control_frames_round_trip_and_bad_frames_are_refused():
    reader = _reader()
    ended = [Ended("a-0123abcd", 7, FinishStatus.ABORTED), Ended("b", None, None),
             Ended("c", 82, FinishStatus.FINISHED, remote_decode=True)]  # 1.4: decoded on another engine
    assert _round_trip(FinishFrame(ended), reader) == FinishFrame(ended)
    assert b'"remote_decode": true' in pack(FinishFrame(ended[2:])) and b"remote_decode" not in pack(
        FinishFrame(ended[:2]))  # written only where set: a 1.3 frame is read as before
    with pytest.raises(FormatError, match="finish frame: bad entry"):
        reader.read(b"F" + json.dumps([{"request_id": "c", "remote_decode": 1}]).encode())
    assert _round_trip(CloseFrame(12.5), reader) == CloseFrame(12.5)
    hits = ReferencesFrame([Reference("b-0123abcd", 0, 64, "a-0123abcd"), Reference("1_c-0123abcd", 32, 48, "c")])
    assert _round_trip(hits, reader) == hits
    with pytest.raises(FormatError, match="references frame: bad entry"):
        reader.read(b"R" + json.dumps([["b", 5, 5, "a"]]).encode())  # empty range
    step = pack(next(_steps(1, requests=2)))[LENGTH.size:]
    with pytest.raises(FormatError, match="step frame"):
        reader.read(step[:-3])  # cut short
    with pytest.raises(FormatError, match="unknown frame kind"):
        reader.read(b"P" + step[1:])  # the pickled frames of before: gone
    with pytest.raises(FormatError, match="before the configuration"):
        FrameReader().read(step)


def _newer_config_frame(major: int) -> bytes:
    md = ConfigFrame(SHAPE, {}).to_metadata()
    md["format_version"] = f"{major}.0"
    body = b"C" + json.dumps(md).encode()
    return LENGTH.pack(len(body)) + body


def test_newer_major_version_is_refused_with_a_clear_error():
    with pytest.raises(FormatError, match="format_version 2.0 is newer than this reader knows"):
        FrameReader().read(_newer_config_frame(2)[LENGTH.size:])
    read_fd, write_fd = os.pipe()  # the real sink process, handed such a stream
    proc = subprocess.Popen([sys.executable, "-m", "capture.vllm.sink", str(read_fd)], pass_fds=(read_fd,),
                            stderr=subprocess.PIPE, text=True)
    os.close(read_fd)
    os.write(write_fd, _newer_config_frame(2))
    os.close(write_fd)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "cannot read the worker's frames" in err and "newer than this reader knows" in err, err
