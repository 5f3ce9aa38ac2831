"""The worker's lean step close: the same bytes and rows as the reference paths, without their per-step calls.

- `StepFrameBuffer` (the step frame built in place in one reused buffer) writes exactly the
  bytes `replay_format.step_frame.pack` writes, for every field combination (token ids or
  none, spec-decode counts or none, flags or none, uint8 and uint16 ids, odd sizes, request
  names changing between steps, a buffer that has to grow, the weight version set once and
  changed between steps, or never set), and `FrameReader` reads them.
- `StepRecorder.end_step_into` gives the experts and flags `end_step` gives: clean steps, ids
  out of range (-1 and >= num_experts), a layer missing, a layer kept twice, padding rows,
  too few rows, the `record` path.
- The whole hook path of `StepHooks` (step open, router callbacks, step close) on a
  stand-in runner (its `layer_id` property is never read per call: startup notes the ordinal),
  handing frames from the reused buffer to a real sink process and service:
  with the sink stopped (SIGSTOP) the pipe fills and frames wait in the backlog while the
  buffer is rewritten by later steps, and every route still arrives byte-equal.
No timed assertions (the speed is bench/capture.py's and bench/vllm_overhead.py's).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from capture.vllm.worker.frame_buffer import StepFrameBuffer
from capture.worker.recorder import StepRecorder
from replay_format import NO_TOKEN, Flag, FormatError, RunShape
from replay_format.step_frame import LENGTH, ConfigFrame, FrameReader, StepFrame, pack


def _frame(rng, shape: RunShape, lengths, with_tokens: bool, with_spec: bool, with_flags: bool, names_seed=0):
    n = int(sum(lengths))
    req_ids = [f"req-{names_seed}-{i}-{'x' * (i % 5)}-0123abcd" for i in range(len(lengths))]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = rng.integers(0, 1 << 20, n)
    token_ids = rng.integers(0, 1 << 17, n) if with_tokens else None
    experts = rng.integers(0, shape.num_experts, (n, shape.num_moe_layers, shape.top_k)).astype(shape.dtype)
    flags = rng.integers(0, 2, n).astype(np.uint16) if with_flags else None
    spec = (rng.integers(0, 4, len(lengths)).astype(np.uint32), rng.integers(-1, 5, len(lengths)).astype(np.int32))
    return req_ids, qsl, positions, token_ids, experts, flags, spec if with_spec else (None, None)


@pytest.mark.parametrize("num_experts", [8, 300])
@pytest.mark.parametrize("with_tokens", [True, False])
@pytest.mark.parametrize("with_spec", [True, False])
@pytest.mark.parametrize("with_flags", [True, False])
@pytest.mark.parametrize("with_version", [True, False])
def test_frame_buffer_writes_the_bytes_pack_writes(num_experts, with_tokens, with_spec, with_flags, with_version):
    shape = RunShape(num_moe_layers=3, top_k=3, num_experts=num_experts)  # odd row width: odd offsets
    buffer = StepFrameBuffer(shape, capacity=64)  # small: it has to grow
    reader = FrameReader()
    reader.read(pack(ConfigFrame(shape, {}))[LENGTH.size:])
    rng = np.random.default_rng(num_experts)
    # What the engine core said before each step (None: nothing new); the worker keeps the last.
    told = ["default", None, None, "rl-step-1", None, "x" * 128, "v2:ckpt/7@a+b=c"] if with_version else [None] * 7
    version = None
    # Decode-like steps repeat the batch (names reused), then the batch changes, grows and shrinks.
    for step, lengths in enumerate([[1, 1, 1], [1, 1, 1], [5, 1, 2, 7], [3], [0, 2], [1] * 40, [1, 1, 1]]):
        if told[step] is not None:
            buffer.set_weight_version(version := told[step])
        req_ids, qsl, positions, token_ids, experts, flags, (drafts, sampled) = _frame(
            rng, shape, lengths, with_tokens, with_spec, with_flags, names_seed=step // 2)
        as_tensor = step % 2 == 0  # the engine hands tensors (int64 positions); arrays work too
        n = buffer.open(req_ids, qsl, torch.from_numpy(positions) if as_tensor else positions,
                        None if token_ids is None else torch.from_numpy(token_ids) if as_tensor else token_ids)
        assert n == len(positions) and buffer.experts.shape == experts.shape
        buffer.experts[...] = experts
        got = bytes(buffer.close(flags, drafts, sampled))
        reference = StepFrame(req_ids, qsl, positions.astype(np.int32),
                              np.full(n, NO_TOKEN, np.int32) if token_ids is None else token_ids.astype(np.int32),
                              experts, np.zeros(n, np.uint16) if flags is None else flags, drafts, sampled, version)
        assert got == pack(reference)
        back = reader.read(got[LENGTH.size:])
        assert back.req_ids == req_ids and back.experts.tobytes() == experts.tobytes()
        assert back.weight_version == version


def test_frame_buffer_refuses_a_label_outside_the_rule_and_keeps_the_last():
    buffer = StepFrameBuffer(RunShape(num_moe_layers=1, top_k=1, num_experts=4))
    buffer.set_weight_version("default")
    for bad in ("", "with space", "x" * 129, "ünï"):
        with pytest.raises(FormatError, match="not a valid label"):
            buffer.set_weight_version(bad)
    buffer.open(["a-0123abcd"], np.array([0, 1], np.int32), np.array([0], np.int32), None)
    reader = FrameReader()
    reader.read(pack(ConfigFrame(buffer.shape, {}))[LENGTH.size:])
    assert reader.read(bytes(buffer.close(None))[LENGTH.size:]).weight_version == "default"


def test_frame_buffer_views_hold_the_steps_positions_and_tokens():
    shape = RunShape(num_moe_layers=2, top_k=2, num_experts=8)
    buffer = StepFrameBuffer(shape)
    positions = torch.arange(100, 110)  # a longer buffer than the step: only n values count
    buffer.open(["a-0123abcd", "b-0123abcd"], np.array([0, 3, 5, 99], np.int32), positions, None)
    assert buffer.positions.tolist() == list(range(100, 105))
    assert buffer.token_ids.tolist() == [NO_TOKEN] * 5
    with pytest.raises(ValueError):
        buffer.close(None, np.zeros(2, np.uint32), None)


SHAPE = RunShape(num_moe_layers=4, top_k=2, num_experts=16)


def _both(feed, n: int, shape: RunShape = SHAPE):
    """(experts, flags) from end_step and from end_step_into, the same layers fed to each recorder."""
    results = []
    for into in (False, True):
        rec = StepRecorder(shape, max_tokens=64)
        rec.begin_step()
        feed(rec)
        if into:
            experts = np.full((n, shape.num_moe_layers, shape.top_k), 77, shape.dtype)
            flags = rec.end_step_into(experts)
            results.append((experts, np.zeros(n, np.uint16) if flags is None else flags, flags is None))
        else:
            step = rec.end_step(None, np.zeros(n, np.int32))
            results.append((step.experts, step.flags, step.stale_rows == 0))
    (e1, f1, clean1), (e2, f2, clean2) = results
    assert e1.tobytes() == e2.tobytes() and f1.tolist() == f2.tolist() and clean1 == clean2
    return e2, f2, clean2


def _rows(n: int, seed: int, low: int = 0, high: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n, 2), generator=g, dtype=torch.int32) for _ in range(4)]


def test_end_step_into_matches_end_step_on_clean_and_flagged_steps():
    rows = _rows(6, 0)

    def keep_all(rec, rows=rows):
        for layer, r in enumerate(rows):
            rec.keep(layer, r)

    experts, _flags, clean = _both(keep_all, 6)
    assert clean and experts.tobytes() == torch.stack(rows, 1).numpy().astype(np.uint8).tobytes()
    _both(keep_all, 0)  # an empty step
    padded = _rows(9, 1)  # the engine's padding rows past n are dropped
    assert _both(lambda rec: [rec.keep(i, r) for i, r in enumerate(padded)], 6)[2]
    for bad in (-1, 16, 1 << 20):  # out of range: the row is flagged STALE, the id stored as 255
        wrong = [r.clone() for r in rows]
        wrong[2][4, 1] = bad
        experts, flags, clean = _both(lambda rec, w=wrong: [rec.keep(i, r) for i, r in enumerate(w)], 6)
        assert not clean and flags.tolist() == [0, 0, 0, 0, Flag.STALE, 0] and experts[4, 2, 1] == 255
    # A layer missing, a layer kept twice, too few rows, layers out of order, the record path.
    assert not _both(lambda rec: [rec.keep(i, rows[i]) for i in range(3)], 6)[2]
    assert not _both(lambda rec: [rec.keep(i, rows[min(i, 2)]) for i in (0, 1, 2, 2, 3)], 6)[2]
    assert not _both(lambda rec: [rec.keep(i, r[:4]) for i, r in enumerate(rows)], 6)[2]
    assert _both(lambda rec: [rec.keep(i, rows[i]) for i in (3, 1, 0, 2)], 6)[2]
    assert _both(lambda rec: [rec.record(i, r) for i, r in enumerate(rows)], 6)[2]
    wide = RunShape(num_moe_layers=4, top_k=2, num_experts=300)  # uint16 ids
    big = _rows(6, 3, high=300)
    experts, _flags, clean = _both(lambda rec: [rec.keep(i, r) for i, r in enumerate(big)], 6, wide)
    assert clean and experts.dtype == np.uint16 and experts.tobytes() == torch.stack(big, 1).numpy().astype(
        np.uint16).tobytes()


class _Ns:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _MoERunner:
    """Counts reads of `layer_id` (vLLM's is a property that imports and parses the layer name each time)."""

    reads = 0

    def __init__(self, layer: int) -> None:
        self.layer = layer

    @property
    def layer_id(self) -> int:
        _MoERunner.reads += 1
        return self.layer


def test_hook_path_through_a_stopped_sink_delivers_every_route(shared_service, tmp_path):
    """Frames from the reused buffer that wait in the backlog (sink stopped) are the steps' own bytes."""
    from capture.sender import SenderConfig
    from capture.vllm.sink.handoff import StepHandoff
    from capture.vllm.worker.binder import ChainedCapture
    from capture.vllm.worker.forward_sharding import Parallel
    from capture.vllm.worker.runner import v1_sampled_counts
    from capture.vllm.worker.step_hooks import StepHooks
    from replay_client.client import ReplayClient

    shape = RunShape(num_moe_layers=4, top_k=8, num_experts=64)
    requests, rows_per_step, steps = 8, 64, 80  # ~20 KB a frame: far over the pipe
    handoff = StepHandoff(SenderConfig(url=shared_service.url, run_id="step-cost", shape=shape, writer_id="w0",
                                       spill_dir=tmp_path / "spill" / "w0", flush_interval_s=0.05))
    wc = StepHooks(StepRecorder(shape, max_tokens=requests * rows_per_step), Parallel(),
                   {layer: layer for layer in range(4)}, frame=StepFrameBuffer(shape), handoff=handoff)
    wc.local_layers = dict.fromkeys(range(4), True)
    chains = [ChainedCapture(wc.on_topk, None, _MoERunner(layer)) for layer in range(4)]
    wc.moe_ordinal_by_runner = {id(chain.runner): layer for layer, chain in enumerate(chains)}  # as startup() notes
    n = requests * rows_per_step
    runner = _Ns(input_batch=_Ns(num_reqs=requests, req_ids=[f"user-{r}-0123abcd" for r in range(requests)]),
                 query_start_loc=_Ns(np=np.arange(requests + 1, dtype=np.int32) * rows_per_step),
                 input_ids=_Ns(gpu=torch.zeros(n, dtype=torch.int32)))
    rng = np.random.default_rng(5)
    sent = {r: [] for r in range(requests)}
    os.kill(wc.handoff.pid, signal.SIGSTOP)
    try:
        for step in range(steps):
            positions = torch.from_numpy(np.tile(np.arange(rows_per_step) + step * rows_per_step, requests))
            wc.on_execute(_Ns(finished_req_ids=set()))
            wc.open_step(runner, torch.from_numpy(rng.integers(0, 1000, n).astype(np.int32)), positions)
            # Distinct ids per row (a repeated one is flagged DUPLICATE by the service).
            topk = [torch.from_numpy(rng.permuted(np.tile(np.arange(64, dtype=np.int32), (n, 1)), axis=1)[:, :8].copy())
                    for _ in range(4)]
            for chain, layer_rows in zip(chains, topk):
                chain(layer_rows)
            wc.close_forward()
            wc.on_sampled(None, v1_sampled_counts)
            step_rows = torch.stack(topk, 1).numpy().astype(np.uint8)
            for r in range(requests):
                sent[r].append(step_rows[r * rows_per_step:(r + 1) * rows_per_step])
        assert wc.handoff._backlog_bytes > 0  # frames waited while the buffer was rewritten
    finally:
        os.kill(wc.handoff.pid, signal.SIGCONT)
    wc.on_execute(_Ns(finished_req_ids={f"user-{r}-0123abcd" for r in range(requests)}))
    assert wc.handoff.close(60.0) and wc.handoff.lost_frames == 0
    assert wc.steps == steps and wc.ignored_captures == 0
    assert _MoERunner.reads == 0  # the callback never reads the runner's layer_id property
    client = ReplayClient(shared_service.url)
    for r in range(requests):
        expected = np.concatenate(sent[r])
        route = client.get_route("step-cost", f"user-{r}", strict=True)
        assert route.experts.tobytes() == expected.tobytes()
