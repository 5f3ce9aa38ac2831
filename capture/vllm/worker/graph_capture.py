"""The graph-safe router callback for vLLM: which shardings it covers and the fixed-shape restore of each.

Runs in each vLLM worker, when the capture mode resolves to `CaptureMode.GRAPH_SAFE` (by default on a CUDA device):
`StepHooks.on_topk` hands each router call to `GraphCapture.on_topk`, which slices this DP rank's rows with shapes
fixed by the tensor and by Python ints, then `GraphStepRecorder.write`s them. `graph_sharding(runner)` decides each
MoE layer's `GraphSharding` from its static config: `LOCAL` and `DP_CONCAT` are covered under CUDA graphs;
`TP_GATHER` and `PCP` are eager only, and `graph_refusal` refuses them at start-up naming `--enforce-eager`.

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

import enum

import torch

from capture.vllm.worker.forward_sharding import MoeLayout, Parallel, dispatch_sizes
from capture.worker.graph_recorder import GraphStepRecorder


class GraphSharding(enum.StrEnum):
    """Where one MoE layer's router finds this DP rank's rows, as the graph-safe capture tells them apart (module
    docstring)."""

    LOCAL = "local"
    DP_CONCAT = "dp_concat"
    TP_GATHER = "tp_gather"
    PCP = "pcp"


COVERED = (GraphSharding.LOCAL, GraphSharding.DP_CONCAT)


def graph_sharding(runner) -> GraphSharding:
    """The sharding of one MoE layer, from its static MoE config (the same flags `forward_sharding.restore` reads)."""
    layout = MoeLayout.of(runner)
    if layout.pcp_size > 1:  # gathered, or all2all: either way not this rank's whole batch
        return GraphSharding.PCP
    if layout.naive:
        return GraphSharding.DP_CONCAT
    if layout.sp and layout.a2a:
        return GraphSharding.TP_GATHER
    return GraphSharding.LOCAL


def graph_refusal(shardings: dict[str, GraphSharding], graphs: object) -> str | None:
    """The start-up refusal for CUDA graphs with layers the graph-safe capture does not cover; None if all are."""
    bad = {name: sharding for name, sharding in shardings.items() if sharding not in COVERED}
    if not bad:
        return None
    kinds = sorted({str(sharding) for sharding in bad.values()})
    return (
        f"CUDA graphs are on ({graphs}) and {len(bad)} MoE layer(s) route rows laid out as {', '.join(kinds)} "
        f"(e.g. {next(iter(bad))}): the graph-safe capture restores only {', '.join(map(str, COVERED))} rows with "
        "fixed shapes; start vLLM with enforce_eager=True (--enforce-eager)"
    )


def dp_block(topk_ids: torch.Tensor, sizes: tuple[int, ...], par: Parallel) -> torch.Tensor:
    """This DP rank's rows of a naive-dispatch tensor: a slice whose bounds are host ints.

    `sizes`: rows each rank fed the dispatch, per DP rank, or per EP rank (DP x TP, DP-major)
    under sequence-parallel MoE, whose TP pieces of one DP rank are contiguous."""
    per_rank = par.tp_size if len(sizes) == par.dp_size * par.tp_size else 1
    start = sum(sizes[: par.dp_rank * per_rank])
    length = sum(sizes[par.dp_rank * per_rank : (par.dp_rank + 1) * per_rank])
    return topk_ids[start : start + length]


class GraphCapture:
    """The graph-safe router callback of one worker (module docstring)."""

    def __init__(self, recorder: GraphStepRecorder, shardings: dict[int, GraphSharding], par: Parallel) -> None:
        self.recorder = recorder
        self.shardings = shardings  # MoE ordinal -> its sharding (all in COVERED)
        self.par = par

    def on_topk(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Write this DP rank's rows of one layer; fixed-shape device work, whatever step state the host is in."""
        rows = topk_ids
        if self.shardings[layer] == GraphSharding.DP_CONCAT:
            from vllm.forward_context import get_forward_context

            rows = dp_block(topk_ids, dispatch_sizes(get_forward_context()), self.par)
        if rows.device != self.recorder.device:  # never on the graph path (the router runs on the device)
            rows = rows.to(self.recorder.device)
        self.recorder.write(layer, rows)
