"""Runs in each vLLM worker process: `StepHooks`, what the model-runner hooks do each step, and its counters.

Contract: `WorkerCapture.startup` builds one once the routers are bound; the V1 and V2 hooks (`runner.py`,
`runner_v2.py`) call `on_execute` (the scheduler output; the engine core's notes to the sink), `open_step` /
`close_forward` (the step's requests, positions and input ids into its frame), `on_topk` per router call (this DP
rank's rows into the recorder; calls outside a step are ignored and counted, except in GRAPH_SAFE mode, which writes
every call) and `on_sampled` (the step closed into its frame and handed to the sink). A capture that fails never
raises into the model: its layer's rows go STALE.
Design: docs/design/vllm_worker.md ("The step hooks").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np
import torch

from capture.vllm.log import info, log
from capture.vllm.scheduler_notes import notes_of
from capture.vllm.sink.handoff import StepHandoff
from capture.vllm.worker.forward_sharding import Parallel, PcpStep, restore, restore_pcp, routes_local_batch
from capture.vllm.worker.frame_buffer import StepFrameBuffer
from capture.vllm.worker.graph_capture import GraphCapture
from capture.worker.graph_recorder import GraphStepRecorder
from capture.worker.pcp_mask import PcpPaddingMask
from capture.worker.recorder import StepRecorder
from replay_format.step_frame import NO_SAMPLE, Ended

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.sequence import IntermediateTensors
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # What a runner's `sample_tokens` returns: V1's `GPUModelRunner.sample_tokens` (a non-last PP rank's
    # `IntermediateTensors` among them), V2's (`vllm.v1.worker.gpu.model_runner`: an `AsyncOutput`, an
    # `AsyncModelRunnerOutput`, or None after a failed `execute_model`).
    SamplerOutput: TypeAlias = ModelRunnerOutput | AsyncModelRunnerOutput | IntermediateTensors | None


class OpenStep:
    """What the worker knows of a step between `_model_forward` and `sample_tokens` (its frame's first half)."""

    __slots__ = ("req_ids", "query_start_loc", "positions", "token_ids", "num_tokens")

    def __init__(self, req_ids: list[str], query_start_loc: np.ndarray | None, positions: np.ndarray | None,
                 token_ids: np.ndarray | None, num_tokens: int | None = None) -> None:
        # The arrays are None when they live in the step's frame buffer (`StepHooks.frame`).
        self.req_ids = req_ids
        self.query_start_loc = query_start_loc  # int32 [num_reqs + 1]
        self.positions = positions  # int32 [n]
        self.token_ids = token_ids  # int32 [n], NO_TOKEN where unknown
        # A plain attribute: read once per layer.
        self.num_tokens = len(positions) if num_tokens is None and positions is not None else int(num_tokens or 0)


@dataclass(frozen=True)
class SampledCounts:
    """Per request of a spec-decode step, the tokens the sampler produced (accepted drafts + 1; 0 for a partial
    prefill chunk), as vLLM's own aux-output connector takes them (`num_sampled`)."""

    req_ids: list[str]  # the sampler's request order
    num_sampled: np.ndarray  # ints [len(req_ids)]


# How a runner's `sample_tokens` output gives its counts: (output, the step's request ids) -> counts or None.
# (A string: `SamplerOutput` names vLLM's classes, imported for the type checker only.)
SampledReader: TypeAlias = "Callable[[SamplerOutput, list[str]], SampledCounts | None]"


def spec_counts(req_ids: list[str], sched: SchedulerOutput | None, output: SamplerOutput,
                read_counts: SampledReader) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(drafts verified, tokens sampled) per request of a spec-decode step; (None, None) for any other step.

    `read_counts(output, req_ids)` is read only on a spec-decode step; a request it has no count for
    (or no counts at all: e.g. no sampler output) gets NO_SAMPLE."""
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) if sched is not None else None
    if not spec:
        return None, None
    drafts = np.array([len(spec.get(rid) or ()) for rid in req_ids], np.uint32)
    counts = read_counts(output, req_ids)
    if counts is None:
        return drafts, np.full(len(req_ids), NO_SAMPLE, np.int32)
    if len(counts.num_sampled) == len(req_ids) and counts.req_ids == req_ids:  # the step's own order (V2; V1 too)
        return drafts, np.asarray(counts.num_sampled, np.int32)
    by_id = dict(zip(counts.req_ids, counts.num_sampled.tolist()))
    return drafts, np.array([by_id.get(rid, NO_SAMPLE) for rid in req_ids], np.int32)


class StepHooks:
    """One worker's per-step capture state, what each model-runner hook does with it, and its counters.

    `moe_ordinal_by_layer` maps a model layer to its MoE ordinal (its place in `moe_layers`);
    `moe_ordinal_by_runner` the same by `id(MoERunner)`: vLLM's `MoERunner.layer_id` is a property that
    imports and parses the layer name on every read (tens of microseconds per layer inside the engine).
    `handoff` is the pipe to this worker's sink (None on a rank that does not send).
    """

    def __init__(self, recorder: StepRecorder | GraphStepRecorder, par: Parallel, moe_ordinal_by_layer: dict[int, int],
                 *, frame: StepFrameBuffer | None = None, graph: GraphCapture | None = None,
                 handoff: StepHandoff | None = None, pcp_masks: PcpPaddingMask | None = None,
                 moe_ordinal_by_runner: dict[int, int] | None = None, verbose: bool = False) -> None:
        self.recorder = recorder
        self.graph = graph  # GRAPH_SAFE mode: the fixed-shape router callback
        self.frame = frame  # the step frame built in place
        self.handoff = handoff
        self.par = par
        self.moe_ordinal_by_layer = moe_ordinal_by_layer
        self.moe_ordinal_by_runner = moe_ordinal_by_runner or {}
        self.local_layers: dict[int, bool] = {}  # MoE ordinal -> routes this DP rank's whole batch (static)
        self.pcp_masks = pcp_masks  # under PCP: the router's padding mask (`runner.patch_apply_quant_method`)
        self.local_padding: torch.Tensor | None = None  # this rank's PCP padding while a router runs
        self.pcp_step: PcpStep | None = None  # V2 under PCP: the open step's partition (`runner_v2`), until its close
        self.verbose = verbose  # one log line per step
        self.enabled = True  # `WorkerCapture.set_enabled(False)` pauses capture (e.g. to measure its cost)
        self.sched: SchedulerOutput | None = None  # the step's scheduler output
        self.open: OpenStep | None = None  # the step the model is running
        self.capturing = False
        self.pending: OpenStep | None = None  # the step waiting for sample_tokens
        self.steps = 0
        self.ignored_captures = 0
        self.capture_s = 0.0  # time in the router callbacks
        self.hook_s = 0.0  # time in every hook (callbacks, step open, hand-off to the sink)

    def carry_over(self, previous: StepHooks | None) -> None:
        """A new model's hooks go on from the last one's: paused or not, and the counters."""
        if previous is not None:
            self.enabled = previous.enabled
            self.steps, self.ignored_captures = previous.steps, previous.ignored_captures
            self.capture_s, self.hook_s = previous.capture_s, previous.hook_s
            if self.frame is not None and previous.frame is not None:  # told once: it holds until the next change
                self.frame.set_weight_version(previous.frame.weight_version)

    def on_execute(self, scheduler_output: SchedulerOutput) -> None:
        """execute_model: note the step's scheduler output; hand the engine core's notes on it to the sink."""
        self.sched = scheduler_output
        notes = notes_of(scheduler_output)
        if notes is not None and notes.weight_version is not None and self.frame is not None:
            try:
                self.frame.set_weight_version(notes.weight_version.label)  # the engine core checked the label
            except Exception:  # any error: never break the step (the rows go as version unknown)
                log.exception("routing-replay: cannot stamp steps with weight version %r", notes.weight_version)
                self.frame.set_weight_version(None)
        if notes is not None and notes.prefix_hits and self.handoff is not None:
            self.handoff.references(notes.prefix_hits)
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished and self.handoff is not None:
            known = notes.finished if notes is not None else {}
            self.handoff.finish([known.get(rid) or Ended(rid) for rid in finished])

    def open_step(self, runner: GPUModelRunner, input_ids: torch.Tensor | None,
                  positions: torch.Tensor | None) -> None:
        """_model_forward: the step's requests, positions and input tokens; captures count from here.

        They are written straight into the step's frame (`frame_buffer.StepFrameBuffer.open`). `runner` is V1's
        runner, or under Model Runner V2 a `runner_v2.V2StepView` holding the same attributes over V2's batch."""
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        ids = input_ids if input_ids is not None else runner.input_ids.gpu
        pos = positions
        if pos is not None and pos.ndim > 1:  # M-RoPE: [3, n]; the text position is row 0
            pos = pos[0]
        assert self.frame is not None  # the hooks call this only on hooks built with their frame
        frame = self.frame
        req_ids = batch.req_ids[:num_reqs]
        self.open = OpenStep(req_ids, None, None, None, frame.open(req_ids, runner.query_start_loc.np, pos, ids))
        self.recorder.begin_step()
        self.capturing = True

    def close_forward(self) -> None:
        """The model returned: later captures are not this step's (GRAPH_SAFE: start copying its rows out)."""
        self.capturing = False
        self.pcp_step = None
        self.pending, self.open = self.open, None
        if self.graph is not None and self.pending is not None:
            self.graph.recorder.start_close(self.pending.num_tokens)

    def on_topk(self, runner: MoERunner, topk_ids: torch.Tensor) -> None:
        """BaseRouter.capture_fn (logical ids, before EPLB). Never raises into the model."""
        if self.graph is not None:
            self.on_topk_graph(runner, topk_ids)
            return
        # EAGER mode (GRAPH_SAFE returned above): the recorder is a StepRecorder.
        recorder = cast(StepRecorder, self.recorder)
        if not self.capturing or self.open is None:
            self.ignored_captures += 1
            return
        t0 = time.perf_counter()
        try:
            layer = self.moe_ordinal_by_runner.get(id(runner))
            if layer is None:  # a runner bound without startup (tests, benches): read its layer id
                layer = self.moe_ordinal_by_layer[int(runner.layer_id)]
            local = self.local_layers.get(layer)
            if local is None:
                local = self.local_layers[layer] = routes_local_batch(runner)
            if local and topk_ids.is_cpu:
                # This rank routed this DP rank's whole batch: nothing to restore. The rows are
                # kept by reference and copied once per step for all layers (recorder.keep):
                # inside the engine each call per layer costs microseconds.
                recorder.keep(layer, topk_ids)
                rows = None
            elif local:
                rows = topk_ids[: self.open.num_tokens]
            elif self.pcp_step is not None:  # V2 under PCP: vLLM's partition of this step
                rows = restore_pcp(topk_ids, runner, self.par, self.pcp_step, self.open.num_tokens)
            else:
                from vllm.forward_context import get_forward_context, is_forward_context_available

                ctx = get_forward_context() if is_forward_context_available() else None
                rows = restore(topk_ids, runner, ctx, self.par, self.open.num_tokens, local_padding=self.local_padding)
            if rows is not None:
                recorder.record(layer, rows)
        except Exception:  # any error: the layer's rows stay unstamped: the step is flagged STALE
            log.exception("routing-replay: capture failed in layer %s; its rows are sent flagged STALE",
                          getattr(runner, "layer_name", "?"))
        spent = time.perf_counter() - t0
        self.capture_s += spent
        self.hook_s += spent

    def on_topk_graph(self, runner: MoERunner, topk_ids: torch.Tensor) -> None:
        """GRAPH_SAFE: every call writes, in a step or not (vLLM captures its graphs outside any step).

        What a write outside a step leaves carries an old stamp: the next step reads it STALE
        unless it writes the row again. Host work here runs once per captured graph, not per replay."""
        assert self.graph is not None
        t0 = time.perf_counter()
        try:
            layer = self.moe_ordinal_by_runner.get(id(runner))
            if layer is None:  # a runner bound without startup (tests, benches): read its layer id
                layer = self.moe_ordinal_by_layer[int(runner.layer_id)]
            self.graph.on_topk(layer, topk_ids)
        except Exception:  # any error: the layer's rows keep old stamps: the step is flagged STALE
            log.exception("routing-replay: capture failed in layer %s; its rows are sent flagged STALE",
                          getattr(runner, "layer_name", "?"))
        spent = time.perf_counter() - t0
        self.capture_s += spent
        self.hook_s += spent

    def on_sampled(self, output: SamplerOutput, read_counts: SampledReader) -> None:
        """sample_tokens: close the step into its frame and hand the frame to the sink.

        The recorder writes the experts into the frame's slot (`StepRecorder.end_step_into`);
        the frame is written to the pipe from the reused buffer (`StepHandoff.step_packed`).
        `read_counts` reads `output`'s sampled counts on a spec-decode step (`spec_counts`)."""
        step, self.pending = self.pending, None
        if step is None or self.frame is None:
            return
        self.steps += 1
        flags = self.recorder.end_step_into(self.frame.experts)
        if self.handoff is None:
            return
        drafts, sampled = spec_counts(step.req_ids, self.sched, output, read_counts)
        self.handoff.step_packed(self.frame.close(flags, drafts, sampled))
        if self.verbose:
            info("routing-replay: step %d: %d rows (%d stale) of %d requests", self.steps, step.num_tokens,
                 0 if flags is None else int(np.count_nonzero(flags)), len(step.req_ids))
