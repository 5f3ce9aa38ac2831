"""Runs in each vLLM worker process: `WorkerCapture`, the capture state of one worker (one model runner).

What each model-runner hook (`runner.py`) does with it:
- `load_model` -> `startup`: checks (KV connectors, CUDA graphs, pipeline parallel),
  `bind_model` on every MoE router, the recorder, the PCP router mask, the sink process
  (only on the TP/PCP rank 0 of each DP rank) and one log line per worker. The capture mode
  (`config.CaptureMode`, by default GRAPH_SAFE on a CUDA device, EAGER elsewhere) picks the
  recorder: `GraphStepRecorder` through `graph_capture.GraphCapture` (fixed-shape device writes:
  CUDA graphs allowed for the layouts it covers) or `StepRecorder` (the eager path below).
- `execute_model` -> `on_execute`: notes the `SchedulerOutput`; the engine core's prefix-cache
  hits of newly scheduled requests go to the sink as references, finished/aborted requests as
  finish events.
- `_model_forward` -> `open_step` / `close_forward`: the step's request ids (an `OpenStep`);
  query_start_loc, positions and input ids go straight into the step's frame
  (`frame_buffer.StepFrameBuffer`, one reused buffer); captures outside a step
  (dummy/profile runs call the model directly) are ignored and counted.
- router `capture_fn` -> `on_topk`: restores this DP rank's rows (`sharding.restore`) and
  records them in the `StepRecorder` (a layer that did not write a row this step leaves it
  `STALE`); when the layer routes this DP rank's whole batch on CPU it only keeps the
  tensor (`StepRecorder.keep`).
  In GRAPH_SAFE mode `on_topk` writes every call (a graph is captured outside any step) and
  `close_forward` starts the asynchronous copy of the step's real rows.
- `sample_tokens` -> `on_sampled`: closes the step in the recorder straight into the frame's
  experts slot (`StepRecorder.end_step_into`), finishes the frame (flags, what spec decode
  verified and accepted, request names) and hands it to the sink (`handoff.StepHandoff.step_packed`:
  one non-blocking pipe write of the buffer; copied only if the pipe is full). The sink
  maps rows to the user's request ids, drops rejected drafts and streams to the service
  (`capture.vllm.sink`); none of that runs on the forward thread.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from capture.vllm.config import CaptureMode, PluginConfig
from capture.vllm.engine_core.prefix_hits import ATTR as HITS_ATTR
from capture.vllm.engine_core.scheduler import ATTR as FINISH_ATTR
from capture.vllm.worker.binder import bind_model, install_set_hook
from capture.vllm.worker.frame_buffer import StepFrameBuffer
from capture.vllm.worker.graph_capture import GraphCapture, graph_refusal, layout_of
from capture.vllm.worker.sharding import Parallel, pcp_mask_fixed_upstream, restore, routes_local_batch
from capture.worker.graph_recorder import GraphStepRecorder
from capture.worker.pcp_mask import PcpPaddingMask
from capture.worker.recorder import StepRecorder
from replay_format import RunShape, Source
from replay_format.step_frame import NO_SAMPLE, Ended, FinishStatus, Reference

if TYPE_CHECKING:  # imported when a sending rank starts its sink
    from capture.vllm.worker.handoff import StepHandoff

log = logging.getLogger("routing_replay.vllm")


class StartupError(RuntimeError):
    """The engine's configuration would make the capture record garbage; refused at load_model."""


class OpenStep:
    """What the worker knows of a step between `_model_forward` and `sample_tokens` (its frame's first half)."""

    __slots__ = ("req_ids", "query_start_loc", "positions", "token_ids", "num_tokens")

    def __init__(self, req_ids: list[str], query_start_loc: np.ndarray | None, positions: np.ndarray | None,
                 token_ids: np.ndarray | None, num_tokens: int | None = None) -> None:
        # The arrays are None when they live in the step's frame buffer (`WorkerCapture.frame`).
        self.req_ids = req_ids
        self.query_start_loc = query_start_loc  # int32 [num_reqs + 1]
        self.positions = positions  # int32 [n]
        self.token_ids = token_ids  # int32 [n], NO_TOKEN where unknown
        # A plain attribute: read once per layer.
        self.num_tokens = len(positions) if num_tokens is None and positions is not None else int(num_tokens or 0)


def info(msg: str, *args) -> None:
    """Log one line at INFO; vLLM's logging config may not propagate our logger, so stderr gets it too then."""
    text = msg % args if args else msg
    log.info(text)
    if not log.isEnabledFor(logging.INFO) or not logging.getLogger().handlers:
        print(text, file=sys.stderr, flush=True)


def model_num_hidden_layers(vcfg, moe_layers: tuple[int, ...]) -> int:
    """The model's layer count, dense layers included, as vLLM's own `routed_experts` counts it; 0 when unknown.

    vLLM sizes its routed-experts buffer by `model_config.get_total_num_hidden_layers()`
    (`routed_experts_capturer._get_routed_experts_shape`); without it, the HF text config's
    `num_hidden_layers`. A count that cannot hold the routers' layer ids (e.g. MTP layers numbered past
    it) is not used: 0 lets the service derive `max(moe_layers) + 1`.
    """
    model_config: Any = getattr(vcfg, "model_config", None)
    count = 0
    try:
        count = int(model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - an older or a stand-in config: fall back to the HF config
        for name in ("hf_text_config", "hf_config"):
            value = getattr(getattr(model_config, name, None), "num_hidden_layers", None)
            if isinstance(value, int) and not isinstance(value, bool):
                count = value
                break
    return count if moe_layers and count > moe_layers[-1] else 0


class WorkerCapture:
    """The capture state of one worker process (one model runner)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.handoff: StepHandoff | None = None  # on the rank that sends
        self._paused_handoff: StepHandoff | None = None  # set_sending(False) keeps it here
        self.recorder: StepRecorder | GraphStepRecorder | None = None  # from startup() on
        self.graph: GraphCapture | None = None  # GRAPH_SAFE mode: the fixed-shape router callback
        self.mode = config.capture_mode  # resolved (EAGER / GRAPH_SAFE) at startup
        self.frame: StepFrameBuffer | None = None  # from startup() on: the step frame built in place
        self.par = Parallel()
        self.layers: dict[int, int] = {}  # model layer -> MoE ordinal (its place in moe_layers)
        # id(MoERunner) -> MoE ordinal: vLLM's `MoERunner.layer_id` is a property that imports and
        # parses the layer name on every read (tens of microseconds per layer inside the engine).
        self.ordinals: dict[int, int] = {}
        self.model_id: int | None = None
        self.sched = None
        self.open: OpenStep | None = None  # the step the model is running
        self.capturing = False
        self.pending: OpenStep | None = None  # the step waiting for sample_tokens
        self.ignored_captures = 0
        self.steps = 0
        self.pcp_masks: PcpPaddingMask | None = None
        self.local_padding: torch.Tensor | None = None
        self.capture_s = 0.0  # time in the router callbacks
        self.hook_s = 0.0  # time in every hook (callbacks, step open, hand-off to the sink)
        self.enabled = True  # `set_enabled(False)` pauses capture (e.g. to measure its cost)
        self.local_layers: dict[int, bool] = {}  # MoE ordinal -> routes this DP rank's whole batch (static)
        self.chains: list = []  # each router's ChainedCapture (step_profile.py times them)

    # ---- startup -----------------------------------------------------------

    def startup(self, runner) -> None:
        """At load_model: check the config, bind every router, start the recorder (and the sink on a sending rank)."""
        model = getattr(runner, "model", None)
        if model is None or self.model_id == id(model):
            return
        vcfg = getattr(runner, "vllm_config", None)
        from capture.vllm.engine_core.routed_experts_tee import CaptureRoute, capture_route

        if capture_route(vcfg) is CaptureRoute.VLLM_TEE:  # vLLM captures itself; the engine core tees its rows
            self.model_id = id(model)
            info("routing-replay: worker capture off: vLLM's enable_return_routed_experts is on, the engine core "
                 "tees the rows vLLM commits (pid %d)", os.getpid())
            return
        self.check_config(vcfg)
        install_set_hook()
        bound = bind_model(model, self.on_topk)
        self.chains = [b.router.capture_fn for b in bound]
        self.layers = {b.layer_id: i for i, b in enumerate(sorted(bound, key=lambda b: b.layer_id))}
        self.ordinals = {id(b.runner): self.layers[b.layer_id] for b in bound}
        self.model_id = id(model)
        self.par = Parallel.from_vllm()
        first = bound[0].router
        moe_layers = tuple(sorted(b.layer_id for b in bound))
        shape = RunShape(len(bound), int(first.top_k), int(first.global_num_experts), moe_layers,
                         model_num_hidden_layers(vcfg, moe_layers))
        max_tokens = int(getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", 0) or 8192)
        self.start_recorder(vcfg, runner, bound, shape, max_tokens + 64)
        self.frame = StepFrameBuffer(shape)
        self.install_pcp_mask()
        if self.par.sends:
            self.handoff = self.make_handoff(shape)
        info(
            "routing-replay: capturing %d MoE layers (top-%d of %d experts) -> %s run %r; worker tp=%d/%d pcp=%d/%d "
            "dp=%d/%d; %s capture; %s (pid %d)",
            shape.num_moe_layers, shape.top_k, shape.num_experts, self.config.url, self.config.run_id,
            self.par.tp_rank, self.par.tp_size, self.par.pcp_rank, self.par.pcp_size, self.par.dp_rank,
            self.par.dp_size, self.mode,
            f"sending through sink pid {self.handoff.pid}" if self.handoff
            else "not sending (rank 0 of its TP/PCP group sends)",
            os.getpid(),
        )

    def check_config(self, vcfg) -> None:
        """StartupError naming the fix for each setting the capture cannot work with."""
        if vcfg is None:
            return
        problems = []
        if getattr(vcfg, "kv_transfer_config", None) is not None:
            problems.append(
                "a KV connector is configured (kv_transfer_config): KV it loads was computed by another engine, whose "
                "routing this worker never sees, so those positions would read GAP; capture on the engine that "
                "computes the KV, or start this one without the connector"
            )
        graphs = cuda_graphs(vcfg)
        if graphs is not None and self.mode == CaptureMode.EAGER:
            problems.append(
                f"CUDA graphs are on ({graphs}) and {self.config.capture_mode} capture was asked for: a replayed "
                "graph runs the MoE kernels without calling the router's capture callback, so every row would "
                "arrive STALE; start vLLM with enforce_eager=True (--enforce-eager), or unset "
                "ROUTING_REPLAY_CAPTURE_MODE (graph-safe capture on a GPU)"
            )
        par = getattr(vcfg, "parallel_config", None)
        if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
            problems.append("pipeline parallelism is not supported (each stage holds only its layers)")
        if problems:
            raise StartupError("routing-replay: refusing to start: " + "; ".join(problems))

    def start_recorder(self, vcfg, runner, bound: list, shape: RunShape, max_tokens: int) -> None:
        """The recorder of the resolved capture mode; a StartupError when CUDA graphs meet a layout it cannot cover."""
        device = torch.device(getattr(runner, "device", None) or "cpu")
        self.mode = self.config.capture_mode.resolve(device.type)
        if self.mode == CaptureMode.EAGER:
            if cuda_graphs(vcfg) is not None:  # e.g. AUTO on a device type other than "cuda"
                raise StartupError(f"routing-replay: refusing to start: CUDA graphs are on ({cuda_graphs(vcfg)}) on "
                                   f"a {device.type} device, where the capture is eager; start vLLM with "
                                   "enforce_eager=True (--enforce-eager) or set ROUTING_REPLAY_CAPTURE_MODE=graph_safe")
            self.recorder = StepRecorder(shape, max_tokens=max_tokens)
            return
        layouts = {self.layers[b.layer_id]: layout_of(b.runner) for b in bound}
        refusal = graph_refusal({getattr(b.runner, "layer_name", str(b.layer_id)): layouts[self.layers[b.layer_id]]
                                 for b in bound}, cuda_graphs(vcfg))
        if refusal is not None and cuda_graphs(vcfg) is not None:
            raise StartupError("routing-replay: refusing to start: " + refusal)
        if refusal is not None:  # eager engine: the eager path restores every layout
            info("routing-replay: graph-safe capture does not cover this layout; using the eager capture")
            self.mode = CaptureMode.EAGER
            self.recorder = StepRecorder(shape, max_tokens=max_tokens)
            return
        recorder = GraphStepRecorder(shape, max_tokens=max_tokens, device=device)
        self.recorder = recorder
        self.graph = GraphCapture(recorder, layouts, self.par)

    def make_handoff(self, shape: RunShape):
        """Start this worker's sink process; it sends as one writer, spilling under its own directory.

        At the worker's exit the hand-off is closed without waiting for the sink (`StepHandoff.close`).
        A `multiprocessing` finalizer, not `atexit`: vLLM's workers are `multiprocessing` children, and
        a forked one ends in `os._exit` (no `atexit`) after `multiprocessing.util._exit_function` has run
        the finalizers, also when a SIGINT or SIGTERM raised `SystemExit` in it; in a main process
        `multiprocessing` runs them from `atexit`.
        """
        from multiprocessing.util import Finalize

        from capture.sender_config import SenderConfig
        from capture.vllm.worker.handoff import StepHandoff

        cfg = self.config
        writer = f"vllm-dp{self.par.dp_rank}-{os.getpid()}-{os.urandom(3).hex()}"
        handoff = StepHandoff(SenderConfig(
            url=cfg.url, run_id=cfg.run_id, shape=shape, writer_id=writer, source=Source.VLLM_PLUGIN, token=cfg.token,
            spill_dir=cfg.spill_dir / writer,
        ))
        Finalize(None, handoff.close, args=(30.0,), kwargs={"wait": False}, exitpriority=10)
        return handoff

    def install_pcp_mask(self) -> None:
        """Under PCP, give the router a padding mask aligned with the gathered rows (seed 000).

        The runner then wraps the router's call in it (`runner.patch_apply_quant_method`)."""
        if self.par.pcp_size <= 1:
            return
        if pcp_mask_fixed_upstream():
            info("routing-replay: this vLLM gathers the PCP padding mask itself; not installing ours")
            return
        needed = None  # without vLLM's switch: always gather
        try:
            import vllm.envs as envs

            def needed() -> bool:
                return bool(envs.VLLM_MOE_SKIP_PADDING)
        except Exception:  # any error: keep gathering (the switch only saves a collective)
            pass
        self.pcp_masks = PcpPaddingMask(self.par.pcp_group, self.par.pcp_size, needed=needed)

    # ---- step ----------------------------------------------------------------

    def set_enabled(self, enabled: bool) -> None:
        """Pause (False) or resume capture."""
        self.enabled = bool(enabled)

    def set_sending(self, send: bool) -> None:
        """Stop (False) or resume handing steps to the sink; capture goes on (to measure the two apart)."""
        if not send and self.handoff is not None:
            self.handoff, self._paused_handoff = None, self.handoff
        elif send and self._paused_handoff is not None:
            self.handoff, self._paused_handoff = self._paused_handoff, None

    def cost(self) -> dict:
        """Capture cost so far, for `collective_rpc` (bench/vllm_overhead.py)."""
        return {"steps": self.steps, "mode": str(self.mode), "hook_s": self.hook_s, "capture_s": self.capture_s,
                "ignored_captures": self.ignored_captures, "sending": self.handoff is not None,
                "lost_frames": self.handoff.lost_frames if self.handoff is not None else 0,
                "backlogged_frames": self.handoff.backlogged_frames if self.handoff is not None else 0,
                "sink_cpu_s": _cpu_seconds(self.handoff.pid) if self.handoff is not None else None}

    def on_execute(self, scheduler_output) -> None:
        """execute_model: note the step's scheduler output; hand its ended requests to the sink."""
        self.sched = scheduler_output
        hits = getattr(scheduler_output, HITS_ATTR, None)
        if hits and self.handoff is not None:
            self.handoff.references([Reference(rid, start, end, source)
                                     for rid, ranges in hits.items() for start, end, source in ranges])
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished and self.handoff is not None:
            notes = getattr(scheduler_output, FINISH_ATTR, None) or {}
            ended = []
            for rid in finished:
                status, num_tokens = notes.get(rid, (None, None))
                ended.append(Ended(rid, num_tokens, None if status is None else FinishStatus(status)))
            self.handoff.finish(ended)

    def open_step(self, runner, input_ids, positions) -> None:
        """_model_forward: the step's requests, positions and input tokens; captures count from here.

        They are written straight into the step's frame (`frame_buffer.StepFrameBuffer.open`)."""
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        ids = input_ids if input_ids is not None else runner.input_ids.gpu
        pos = positions
        if pos is not None and pos.ndim > 1:  # M-RoPE: [3, n]; the text position is row 0
            pos = pos[0]
        assert self.recorder is not None and self.frame is not None  # the hooks call this only after startup()
        frame = self.frame
        req_ids = batch.req_ids[:num_reqs]
        self.open = OpenStep(req_ids, None, None, None, frame.open(req_ids, runner.query_start_loc.np, pos, ids))
        self.recorder.begin_step()
        self.capturing = True

    def close_forward(self) -> None:
        """The model returned: later captures are not this step's (GRAPH_SAFE: start copying its rows out)."""
        self.capturing = False
        self.pending, self.open = self.open, None
        if self.graph is not None and self.pending is not None:
            self.graph.recorder.start_close(self.pending.num_tokens)

    def on_topk(self, runner, topk_ids: torch.Tensor) -> None:
        """BaseRouter.capture_fn (logical ids, before EPLB). Never raises into the model."""
        if self.graph is not None:
            self.on_topk_graph(runner, topk_ids)
            return
        # EAGER mode (GRAPH_SAFE returned above): the recorder is a StepRecorder.
        recorder = cast(StepRecorder, self.recorder)
        if not self.capturing or self.open is None or recorder is None:
            self.ignored_captures += 1
            return
        t0 = time.perf_counter()
        try:
            layer = self.ordinals.get(id(runner))
            if layer is None:  # a runner bound without startup (tests, benches): read its layer id
                layer = self.layers[int(runner.layer_id)]
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

    def on_topk_graph(self, runner, topk_ids: torch.Tensor) -> None:
        """GRAPH_SAFE: every call writes, in a step or not (vLLM captures its graphs outside any step).

        What a write outside a step leaves carries an old stamp: the next step reads it STALE
        unless it writes the row again. Host work here runs once per captured graph, not per replay."""
        assert self.graph is not None
        t0 = time.perf_counter()
        try:
            layer = self.ordinals.get(id(runner))
            if layer is None:  # a runner bound without startup (tests, benches): read its layer id
                layer = self.layers[int(runner.layer_id)]
            self.graph.on_topk(layer, topk_ids)
        except Exception:  # any error: the layer's rows keep old stamps: the step is flagged STALE
            log.exception("routing-replay: capture failed in layer %s; its rows are sent flagged STALE",
                          getattr(runner, "layer_name", "?"))
        spent = time.perf_counter() - t0
        self.capture_s += spent
        self.hook_s += spent

    def on_sampled(self, output) -> None:
        """sample_tokens: close the step into its frame and hand the frame to the sink.

        The recorder writes the experts into the frame's slot (`StepRecorder.end_step_into`);
        the frame is written to the pipe from the reused buffer (`StepHandoff.step_packed`)."""
        step, self.pending = self.pending, None
        if step is None or self.recorder is None or self.frame is None:
            return
        self.steps += 1
        flags = self.recorder.end_step_into(self.frame.experts)
        if self.handoff is None:
            return
        drafts, sampled = spec_counts(step.req_ids, self.sched, output)
        self.handoff.step_packed(self.frame.close(flags, drafts, sampled))
        if self.config.verbose:
            info("routing-replay: step %d: %d rows (%d stale) of %d requests", self.steps, step.num_tokens,
                 0 if flags is None else int(np.count_nonzero(flags)), len(step.req_ids))


def cuda_graphs(vcfg) -> object | None:
    """vLLM's cudagraph_mode when CUDA graphs are on (anything but NONE), else None."""
    graphs = getattr(getattr(vcfg, "compilation_config", None), "cudagraph_mode", None)
    return graphs if graphs is not None and getattr(graphs, "name", str(graphs)) != "NONE" else None


def spec_counts(req_ids: list[str], sched, output) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(drafts verified, tokens sampled) per request of a spec-decode step; (None, None) for any other step."""
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) if sched is not None else None
    if not spec:
        return None, None
    drafts = np.array([len(spec.get(rid) or ()) for rid in req_ids], np.uint32)
    counts = {}
    if output is not None and getattr(output, "sampled_token_ids", None) is not None:
        counts = {rid: len(t) for rid, t in zip(output.req_ids, output.sampled_token_ids)}
    return drafts, np.array([counts.get(rid, NO_SAMPLE) for rid in req_ids], np.int32)


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far, from /proc; None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
