"""Runs in each vLLM worker process: `WorkerCapture`, one worker's capture (one model runner), started at load_model.

`startup` (the `load_model` hook, `runner.py`) composes the parts, each in its own module: the start-up checks
(`startup_checks.check_config`), `bind_model` on every MoE router (`binder.py`) and a warning for each way the
engine routes unlike the checkpoint (`startup_checks.routing_divergences`), the recorder of the capture mode
(`recorder_choice.choose_recorder`), the PCP router mask (`forward_sharding.pcp_padding_mask`), the sink process
(`capture.vllm.sink.handoff.start_sink`, only on the TP/PCP rank 0 of each DP rank), then the per-step hook state
(`step_hooks.StepHooks`) and one log line. With vLLM's own `enable_return_routed_experts` on it binds nothing: the
engine core tees the rows vLLM commits (`capture.vllm.config.capture_source`).

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from capture.vllm.config import CaptureMode, PluginConfig, capture_source
from capture.vllm.log import info, warn
from capture.vllm.sink.handoff import StepHandoff, start_sink
from capture.vllm.worker.binder import bind_model, install_set_hook
from capture.vllm.worker.forward_sharding import Parallel, pcp_padding_mask
from capture.vllm.worker.frame_buffer import StepFrameBuffer
from capture.vllm.worker.recorder_choice import choose_recorder
from capture.vllm.worker.startup_checks import check_config, model_num_hidden_layers, routing_divergences
from capture.vllm.worker.step_hooks import StepHooks
from replay_format import RunShape, Source


def _before_start(runner, topk_ids) -> None:
    """What the routers call between `bind_model` and the step hooks' start, a few lines later (load_model runs
    no forward in between)."""


class WorkerCapture:
    """One worker's capture: started on each loaded model, then its `hooks` run every step (module docstring).

    `start_sink(config, shape, writer_prefix, source)` starts the sink of a sending rank
    (`capture.vllm.sink.handoff.start_sink`; a test passes its own).
    """

    def __init__(self, config: PluginConfig,
                 start_sink: Callable[[PluginConfig, RunShape, str, Source], StepHandoff] = start_sink) -> None:
        self.config = config
        self.start_sink = start_sink
        self.mode: CaptureMode = config.capture_mode  # resolved (EAGER / GRAPH_SAFE) at startup
        self.hooks: StepHooks | None = None  # from startup() on, when this worker captures
        self.chains: list = []  # each router's ChainedCapture (step_profile.py times them)
        self.model_id: int | None = None  # the model the hooks are bound to
        self._paused_handoff: StepHandoff | None = None  # set_sending(False) keeps the hooks' hand-off here

    def startup(self, runner) -> None:
        """At load_model: check the config, bind every router, start the recorder (and the sink on a sending rank)."""
        model = getattr(runner, "model", None)
        if model is None or self.model_id == id(model):
            return
        vcfg = getattr(runner, "vllm_config", None)
        if capture_source(vcfg) is Source.VLLM_OUTPUT:  # vLLM captures itself; the engine core tees its rows
            self.model_id = id(model)
            info("routing-replay: worker capture off: vLLM's enable_return_routed_experts is on, the engine core "
                 "tees the rows vLLM commits (pid %d)", os.getpid())
            return
        check_config(vcfg, self.config.capture_mode)
        install_set_hook()
        bound = bind_model(model, _before_start)
        for divergence in routing_divergences(vcfg, [b.router for b in bound]):
            warn("routing-replay: %s; the run's agreement report (a trainer's comparison) shows the mismatch per "
                 "layer, and replaying the stored routes makes the trainer follow this engine", divergence)
        chains = [b.router.capture_fn for b in bound]
        by_layer = {b.layer_id: i for i, b in enumerate(sorted(bound, key=lambda b: b.layer_id))}
        by_runner = {id(b.runner): by_layer[b.layer_id] for b in bound}
        self.model_id = id(model)
        par = Parallel.from_vllm()
        first = bound[0].router
        moe_layers = tuple(sorted(b.layer_id for b in bound))
        shape = RunShape(len(bound), int(first.top_k), int(first.global_num_experts), moe_layers,
                         model_num_hidden_layers(vcfg, moe_layers))
        max_tokens = int(getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", 0) or 8192)
        device = torch.device(getattr(runner, "device", None) or "cpu")
        choice = choose_recorder(self.config.capture_mode, vcfg, device, bound, by_layer, shape, max_tokens + 64, par)
        frame = StepFrameBuffer(shape)
        pcp_masks = pcp_padding_mask(par)
        handoff = self.start_sink(self.config, shape, f"vllm-dp{par.dp_rank}", Source.VLLM_PLUGIN) if par.sends \
            else None
        hooks = StepHooks(choice.recorder, par, by_layer, frame=frame, graph=choice.graph, handoff=handoff,
                          pcp_masks=pcp_masks, moe_ordinal_by_runner=by_runner, verbose=self.config.verbose)
        hooks.carry_over(self.hooks)
        for chain in chains:
            chain.ours = hooks.on_topk
        self.hooks, self.chains, self.mode = hooks, chains, choice.mode
        info(
            "routing-replay: capturing %d MoE layers (top-%d of %d experts) -> %s run %r; worker tp=%d/%d pcp=%d/%d "
            "dp=%d/%d; %s capture; %s (pid %d)",
            shape.num_moe_layers, shape.top_k, shape.num_experts, self.config.url, self.config.run_id,
            par.tp_rank, par.tp_size, par.pcp_rank, par.pcp_size, par.dp_rank, par.dp_size, choice.mode,
            f"sending through sink pid {handoff.pid}" if handoff else "not sending (rank 0 of its TP/PCP group sends)",
            os.getpid(),
        )

    def set_enabled(self, enabled: bool) -> None:
        """Pause (False) or resume capture."""
        if self.hooks is not None:
            self.hooks.enabled = bool(enabled)

    def set_sending(self, send: bool) -> None:
        """Stop (False) or resume handing steps to the sink; capture goes on (to measure the two apart)."""
        hooks = self.hooks
        if hooks is None:
            return
        if not send and hooks.handoff is not None:
            hooks.handoff, self._paused_handoff = None, hooks.handoff
        elif send and self._paused_handoff is not None:
            hooks.handoff, self._paused_handoff = self._paused_handoff, None

    def cost(self) -> dict:
        """Capture cost so far, for `collective_rpc` (bench/vllm_overhead.py)."""
        hooks = self.hooks
        handoff = hooks.handoff if hooks is not None else None
        return {"steps": hooks.steps if hooks else 0, "mode": str(self.mode),
                "hook_s": hooks.hook_s if hooks else 0.0, "capture_s": hooks.capture_s if hooks else 0.0,
                "ignored_captures": hooks.ignored_captures if hooks else 0, "sending": handoff is not None,
                "lost_frames": handoff.lost_frames if handoff is not None else 0,
                "backlogged_frames": handoff.backlogged_frames if handoff is not None else 0,
                "sink_cpu_s": _cpu_seconds(handoff.pid) if handoff is not None else None}


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far, from /proc; None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
