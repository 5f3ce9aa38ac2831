"""Engine-neutral routing capture: restore one MoE layer's rows, gather the PCP padding mask, record steps, send.

Laid out by the process each part runs in: `capture.worker` (the inference worker; torch), `capture.sender` (no
torch; the vLLM plugin runs it in its sink process) and `capture.vllm` (the vLLM plugin, one package per process).
Exports, each imported on first use (the sink never imports torch): `RowSharding`, `ShardPlan`, `Strategy`,
`NaiveDispatch`, `PcpPaddingMask`, `StepRecorder`, `RecordedStep`, `RouteSender`, `SenderConfig`, `RequestIndex`
and `restore_rows` (one MoE layer's `topk_ids` on this rank -> this DP rank's `[num_tokens, top_k]` rows in
scheduler order, the same on every TP/PCP rank; a row count the sharding cannot produce raises ValueError first).

Design: docs/design/capture.md.
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
