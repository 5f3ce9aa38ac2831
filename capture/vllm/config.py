"""Plugin settings, read from the environment of every vLLM process (and the sink's token variable).

`ROUTING_REPLAY_URL` (the service's base URL; unset: the plugin does nothing), `ROUTING_REPLAY_RUN_ID` (the run
routes are stored under; required with the URL), `ROUTING_REPLAY_TOKEN` (optional bearer token),
`ROUTING_REPLAY_SPILL_DIR` (unsent batches; default `./replay-spill/<run_id>`), `ROUTING_REPLAY_VERBOSE` (`1`: a log
line per captured step), `ROUTING_REPLAY_CAPTURE_MODE` (`auto`: `graph_safe` on CUDA, `eager` elsewhere; `eager`;
`graph_safe`), `ROUTING_REPLAY_PD_ROLE` (`auto`: vLLM's P/D protocol says which requests are prefill-only;
`prefill`: every request that ends on this engine is decoded on another). A wrong value raises `PluginConfigError`.

Design: docs/design/vllm_plugin.md.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where it is used: `register()` reads this module in every vLLM process, off or on
    from replay_format import Source

ENV_URL = "ROUTING_REPLAY_URL"
ENV_RUN = "ROUTING_REPLAY_RUN_ID"
ENV_TOKEN = "ROUTING_REPLAY_TOKEN"
ENV_SPILL = "ROUTING_REPLAY_SPILL_DIR"
ENV_VERBOSE = "ROUTING_REPLAY_VERBOSE"
ENV_CAPTURE_MODE = "ROUTING_REPLAY_CAPTURE_MODE"
ENV_PD_ROLE = "ROUTING_REPLAY_PD_ROLE"
# Set by the worker for its sink process only: the token stays off the command line, where `ps` shows it.
ENV_SINK_TOKEN = "ROUTING_REPLAY_SINK_TOKEN"


class PluginConfigError(RuntimeError):
    """The URL is set but the rest of the settings are wrong."""


class CaptureMode(enum.StrEnum):
    """How the worker records the router's ids (docs/vllm_notes.md: what runs where)."""

    AUTO = "auto"  # GRAPH_SAFE on a CUDA device, EAGER elsewhere
    EAGER = "eager"  # `capture.worker.recorder.StepRecorder`: Python per router call; needs --enforce-eager on GPU
    GRAPH_SAFE = "graph_safe"  # `capture.worker.graph_recorder`: fixed-shape device writes, CUDA graphs allowed

    def resolve(self, device_type: str) -> CaptureMode:
        """EAGER or GRAPH_SAFE for a worker whose model runs on `device_type` ("cuda", "cpu", ...)."""
        if self is CaptureMode.AUTO:
            return CaptureMode.GRAPH_SAFE if device_type == "cuda" else CaptureMode.EAGER
        return self


class PdRole(enum.StrEnum):
    """This engine's part in prefill/decode disaggregation (`capture.vllm.kv_connectors.is_prefill_only`)."""

    AUTO = "auto"  # per request: vLLM's kv_transfer_params["do_remote_decode"], or kv_role="kv_producer"
    PREFILL = "prefill"  # every request that ends here is decoded on another engine (no finish is sent from here)


def _choice(env, name: str, kind: type[enum.StrEnum], default: enum.StrEnum):
    value = (env.get(name) or default.value).strip().lower()
    if value not in {m.value for m in kind}:
        raise PluginConfigError(f"routing-replay: {name}={value!r}; one of {', '.join(m.value for m in kind)}")
    return kind(value)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's settings (the variables in the module docstring)."""

    url: str
    run_id: str
    token: str | None
    spill_dir: Path
    verbose: bool = False
    capture_mode: CaptureMode = CaptureMode.AUTO
    pd_role: PdRole = PdRole.AUTO

    @classmethod
    def from_env(cls, env=None) -> PluginConfig | None:
        """None when the plugin is off (no URL); PluginConfigError when the URL is set but the rest is wrong."""
        env = os.environ if env is None else env
        url = (env.get(ENV_URL) or "").strip()
        if not url:
            return None
        run_id = (env.get(ENV_RUN) or "").strip()
        if not run_id:
            raise PluginConfigError(
                f"routing-replay: {ENV_URL} is set but {ENV_RUN} is not; set the run id routes go to")
        from replay_format import ID_RULE, valid_id

        if not valid_id(run_id):
            raise PluginConfigError(f"routing-replay: {ENV_RUN}={run_id!r} is not a valid id ({ID_RULE})")
        spill = env.get(ENV_SPILL) or os.path.join("replay-spill", run_id)
        return cls(
            url=url.rstrip("/"),
            run_id=run_id,
            token=(env.get(ENV_TOKEN) or None),
            spill_dir=Path(spill),
            verbose=_truthy(env.get(ENV_VERBOSE)),
            capture_mode=_choice(env, ENV_CAPTURE_MODE, CaptureMode, CaptureMode.AUTO),
            pd_role=_choice(env, ENV_PD_ROLE, PdRole, PdRole.AUTO),
        )


def capture_source(vllm_config: Any) -> Source:
    """Who captures this engine's rows, as they are stamped (`replay_format.Source`).

    `Source.VLLM_OUTPUT` when the user turned on vLLM's own routed-experts output: its aux-output
    connector captures, the engine core tees what it commits (`engine_core/routed_experts_tee.py`) and
    the workers bind nothing. Else `Source.VLLM_PLUGIN`: the plugin's router callbacks in each worker.
    """
    from replay_format import Source

    aux = getattr(vllm_config, "aux_output_config", None)
    return Source.VLLM_OUTPUT if bool(getattr(aux, "enable_return_routed_experts", False)) else Source.VLLM_PLUGIN
