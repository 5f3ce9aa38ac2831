"""Engine-neutral routing capture: restore one MoE layer's rows, gather the PCP padding mask, record steps, send.

Laid out by the process each part runs in:
- `capture.worker` (the inference worker; torch): `sharding` (where a DP rank's rows lie),
  `restore` (undo it with collectives), `pcp_mask` (the router's padding mask), `recorder`.
- `capture.sender` (no torch): batches rows to the service (`route_sender`; `row_chunk`: the rows on their way;
  `items`, `spill`, `config`).
  The vLLM plugin runs it in its sink process; another engine may run it in its worker.
- `capture.vllm` (the vLLM plugin): `engine_core/`, `worker/` and `sink/`, one package per process
  (`sink/` also holds the sink's client, which the worker and the engine core both start it with).

    from capture import RowSharding, Strategy, restore_rows
    sharding = RowSharding(
        num_tokens=241,            # real tokens of this DP rank in this step
        strategy=Strategy.ALLTOALL,  # or its value "alltoall"; every Strategy is listed below
        tokens_across_dp=None,     # rows per DP rank (naive_dp, padded_dp, mc2 with DP > 1); under PCP: per PCP rank
        dp_rank=0,
        tp_size=2, tp_rank=1,
        padded_num_tokens=None,    # mc2 padding target; else ceil(pcp_size * max(tokens_across_dp) / tp_size) * tp_size
        pcp_size=1, pcp_rank=0,
    )
    rows = restore_rows(topk_ids, sharding, tp_group=None, pcp_group=None, pcp_padding=None, pcp_restore_index=None)
    # -> [num_tokens, top_k], scheduler order, the same on every TP/PCP rank (topk_ids' dtype; may be a view)

Strategies (`Strategy`: where this rank's rows are in topk_ids):
- local: this rank's batch. naive_dp: all DP ranks' rows concatenated rank-major, take
  this rank's span. padded_dp: max(tokens_across_dp) * dp_size rows, rank r at [r*max, r*max+n).
- sequence_parallel: batch padded to a multiple of tp_size, split evenly over TP (gathered).
- alltoall: padded to max(n, tp_size), torch.tensor_split over TP (uneven: 241 -> 121+120),
  gathered in split order, first n kept. mc2/fused_mc2: padded to padded_num_tokens, split.
Row counts come from the sharding only; a topk_ids row count it cannot produce raises
ValueError naming the sharding and the count (before any collective). tp_group/pcp_group
are torch ProcessGroups (vLLM: GroupCoordinator.device_group); None means the default
group; the group's size and this rank's place in it are checked against the sharding.

PCP (pcp_size > 1): topk_ids holds the PCP-gathered rows (rank-major, each rank's chunk
with its padding); pcp_padding is this rank's bool mask (True = padding, its length is the
chunk, equal on every PCP rank); pcp_restore_index lists, in sequence order, the gathered
row (padding included) of each real token. The mask is all-gathered over pcp_group,
padding rows are dropped by index (a -1 is never cast), the index applied, and every real
row must be used exactly once (ValueError). Without a mask, num_tokens splits evenly.

Composition, as vLLM orders it (MoERunner: naive DP/EP dispatch, then the PCP all-gather,
then the quant method's prepare, which TP-splits for All2All/MC2, then the router):
alltoall/mc2 split the PCP-gathered batch, so the restore TP-gathers first and keeps
pcp_size * chunk rows; sequence_parallel shards each chunk in model code before the MoE
layer, so each PCP block is rebuilt from the TP pieces; naive_dp/padded_dp dispatch
inside each PCP block, so this DP rank's span is taken from every block. Then the mask.

Also: `PcpPaddingMask` (the router's gathered padding mask), `StepRecorder` (per-step
buffer with write stamps, Flag.STALE; `end_step` returns a `RecordedStep`) and
`RouteSender` / `SenderConfig` (batching, HTTP, spill; `submit` takes a step's request ids as a
`RequestIndex`, names and a per-row index into them, or as plain ids).
"""

import importlib

# Imported on first use (PEP 562): the vLLM plugin's sink process needs `capture.sender`,
# not torch, which the worker modules import.
_HOME = {
    "RowSharding": "capture.worker.sharding", "ShardPlan": "capture.worker.sharding",
    "Strategy": "capture.worker.sharding",
    "NaiveDispatch": "capture.worker.pcp_mask", "PcpPaddingMask": "capture.worker.pcp_mask",
    "RecordedStep": "capture.worker.recorder", "StepRecorder": "capture.worker.recorder",
    "restore_rows": "capture.worker.restore",
    "RouteSender": "capture.sender.route_sender", "SenderConfig": "capture.sender.config",
    "RequestIndex": "capture.sender.row_chunk",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'capture' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
