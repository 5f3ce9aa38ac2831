"""Runs in each vLLM worker at load_model: the recorder of the capture mode, once the routers are bound.

The asked-for mode (`config.CaptureMode`) is resolved on the model's device (AUTO: GRAPH_SAFE on
CUDA, EAGER elsewhere). GRAPH_SAFE gets a `GraphStepRecorder` written through `graph_capture.GraphCapture`
when every bound layer's sharding is one it covers; an engine without CUDA graphs falls back to the
eager `StepRecorder` otherwise, one with CUDA graphs is refused naming `--enforce-eager`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture.vllm.config import CaptureMode
from capture.vllm.log import info
from capture.vllm.worker.binder import BoundLayer
from capture.vllm.worker.forward_sharding import Parallel
from capture.vllm.worker.graph_capture import GraphCapture, graph_refusal, graph_sharding
from capture.vllm.worker.startup_checks import StartupError, cuda_graphs
from capture.worker.graph_recorder import GraphStepRecorder
from capture.worker.recorder import StepRecorder
from replay_format import RunShape


@dataclass(frozen=True)
class RecorderChoice:
    """The resolved mode (EAGER or GRAPH_SAFE), its recorder, and the graph-safe router callback (GRAPH_SAFE only)."""

    mode: CaptureMode
    recorder: StepRecorder | GraphStepRecorder
    graph: GraphCapture | None = None


def choose_recorder(asked: CaptureMode, vcfg: Any, device: torch.device, bound: Sequence[BoundLayer],
                    moe_ordinal_by_layer: dict[int, int], shape: RunShape, max_tokens: int,
                    par: Parallel) -> RecorderChoice:
    """The recorder of `asked` on `device` for the `bound` layers; a StartupError when CUDA graphs meet a sharding
    it cannot cover (module docstring)."""
    mode = asked.resolve(device.type)
    if mode == CaptureMode.EAGER:
        if cuda_graphs(vcfg) is not None:  # e.g. AUTO on a device type other than "cuda"
            raise StartupError(f"routing-replay: refusing to start: CUDA graphs are on ({cuda_graphs(vcfg)}) on "
                               f"a {device.type} device, where the capture is eager; start vLLM with "
                               "enforce_eager=True (--enforce-eager) or set ROUTING_REPLAY_CAPTURE_MODE=graph_safe")
        return RecorderChoice(mode, StepRecorder(shape, max_tokens=max_tokens))
    shardings = {moe_ordinal_by_layer[b.layer_id]: graph_sharding(b.runner) for b in bound}
    by_name = {getattr(b.runner, "layer_name", str(b.layer_id)): shardings[moe_ordinal_by_layer[b.layer_id]]
               for b in bound}
    refusal = graph_refusal(by_name, cuda_graphs(vcfg))
    if refusal is not None and cuda_graphs(vcfg) is not None:
        raise StartupError("routing-replay: refusing to start: " + refusal)
    if refusal is not None:  # eager engine: the eager path restores every sharding
        info("routing-replay: graph-safe capture does not cover this layout; using the eager capture")
        return RecorderChoice(CaptureMode.EAGER, StepRecorder(shape, max_tokens=max_tokens))
    recorder = GraphStepRecorder(shape, max_tokens=max_tokens, device=device)
    return RecorderChoice(mode, recorder, GraphCapture(recorder, shardings, par))
