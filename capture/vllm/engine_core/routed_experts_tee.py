"""Runs in vLLM's engine core: tee the routed experts vLLM's own aux-output connector commits to the sink.

Used when the user turns on vLLM's `enable_return_routed_experts` (the workers then bind nothing, `Source.VLLM_OUTPUT`).
`patch_connector` wraps the scheduler connector: `take_output` -> `RoutedExpertsTee.committed` notes each request's
rows (no copy, no I/O), `build_connector_meta` (once per step) -> `flush` sends them to this engine core's sink as one
`StepFrame` of the MoE layers only and of one weight version, and `request_finished` -> a finish after the request's
rows (preemption is none). The tee starts once per engine core, before its scheduler holds a request, and asks its
workers which model layers are MoE layers (`moe_layers_rpc`); `EngineCore.shutdown` flushes and closes the sink.

Design: docs/design/vllm_engine_core.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from capture.vllm.config import PluginConfig, capture_source
from capture.vllm.engine_core import weight_version
from capture.vllm.engine_core.request_end import finish_status
from capture.vllm.kv_connectors import is_prefill_only
from capture.vllm.log import info, log
from capture.vllm.patching import is_patched, patch
from capture.vllm.sink.handoff import start_sink
from replay_format import NO_TOKEN, RunShape, Source
from replay_format.request_notes import Reference
from replay_format.step_frame import Ended, StepFrame

_TEE = "_routing_replay_tee"  # on the AuxOutputSchedulerConnector instance: its RoutedExpertsTee
_STARTED = "_routing_replay_tee_started"  # on the EngineCore instance: `_start` ran to its end (a tee or none needed)


def moe_layer_ids(model: Any) -> list[int]:
    """The `layer_id` of every module vLLM's `bind_routed_experts_capturer` binds (its rows' layer index), sorted."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    ids = {int(m.layer_id) for m in model.modules() if isinstance(m, (RoutedExpertsCaptureSource, MoERunner))}
    return sorted(ids)


def moe_layers_rpc(worker: Any) -> list[int]:
    """For `collective_rpc`: this worker's MoE layer ids (`moe_layer_ids` of its runner's model)."""
    return moe_layer_ids(worker.model_runner.model)


def tee_shape(vllm_config: Any, moe_layers: list[int]) -> RunShape:
    """The run shape of the teed rows: vLLM's own counts (`_get_routed_experts_shape`) and the workers' MoE layers."""
    model_config = vllm_config.model_config
    return RunShape(len(moe_layers), int(model_config.get_num_experts_per_tok()), int(model_config.get_num_experts()),
                    tuple(moe_layers), int(model_config.get_total_num_hidden_layers()))


class FrameSink(Protocol):
    """Where the tee's frames go: `capture.vllm.sink.handoff.StepHandoff` (or a test's reader)."""

    def step(self, frame: StepFrame) -> None: ...

    def finish(self, ended: list[Ended]) -> None: ...

    def references(self, references: list[Reference]) -> None: ...

    def close(self, timeout: float = 30.0, wait: bool = True) -> bool: ...


@dataclass(frozen=True)
class _Noted:
    """Rows of one request noted since the last flush: vLLM's rows [n, layers, K] at `positions`, their token ids."""

    request_id: str
    positions: np.ndarray  # int32 [n]
    rows: np.ndarray
    tokens: np.ndarray  # int32 [n]


class RoutedExpertsTee:
    """The committed rows of one engine core, noted per step and handed to its sink (module docstring).

    `version` says the engine core's weight version now (a label, None: unknown); without it rows go as unknown.
    `decoded_elsewhere(request)`: True for a request that ends here only to be decoded on another engine (P/D
    disaggregation, `capture.vllm.kv_connectors.is_prefill_only`), whose finish is the decode engine's.
    """

    def __init__(self, shape: RunShape, sink: FrameSink, version: Callable[[], str | None] | None = None,
                 decoded_elsewhere: Callable[[Any], bool] | None = None) -> None:
        self.shape = shape
        self.sink = sink
        self.version = version
        self.decoded_elsewhere = decoded_elsewhere or (lambda request: False)
        self._layers = np.asarray(shape.moe_layers, np.intp)
        self._noted: list[_Noted] = []  # since the last flush
        self._noted_version: str | None = None  # the weight version of every row noted
        self._referenced: dict[str, list[tuple[int, int]]] = {}  # request -> position ranges sent as references
        self.rows = 0  # rows handed to the sink so far

    def references(self, references: list[Reference]) -> None:
        """The engine core's prefix-cache hits of a step (`engine_core/prefix_hits.py`): they go to the sink as
        references to the requests that computed them, and vLLM's rows read back for those positions are not sent,
        so each hit row keeps the weight version its source computed it with (the service mirrors the source's)."""
        for ref in references:
            self._referenced.setdefault(ref.request_id, []).append((int(ref.start), int(ref.end)))
        self.sink.references(references)

    def committed(self, request_id: str, token_start: int, rows: np.ndarray, all_token_ids: Any) -> None:
        """vLLM committed `rows` of `request_id` at positions `token_start ..` (what `take_output` returned)."""
        n = len(rows)
        if n == 0:
            return
        label = self.version() if self.version is not None else None
        if label != self._noted_version:
            self.flush()  # a frame is one version
            self._noted_version = label
        positions = np.arange(token_start, token_start + n, dtype=np.int32)
        tokens = np.full(n, NO_TOKEN, np.int32)
        known = np.asarray(all_token_ids[token_start : token_start + n], np.int32)  # position p ran token p
        tokens[: len(known)] = known
        keep = np.ones(n, np.bool_)
        for start, end in self._referenced.get(request_id, ()):
            keep &= (positions < start) | (positions >= end)
        if keep.all():
            self._noted.append(_Noted(request_id, positions, rows, tokens))
        elif keep.any():
            self._noted.append(_Noted(request_id, positions[keep], rows[keep], tokens[keep]))

    def flush(self) -> None:
        """Hand the rows noted so far to the sink as one step frame."""
        if not self._noted:
            return
        noted, self._noted = self._noted, []
        counts = [len(n.rows) for n in noted]
        experts = np.concatenate([n.rows for n in noted])[:, self._layers].astype(self.shape.dtype)
        frame = StepFrame(
            req_ids=[n.request_id for n in noted],
            query_start_loc=np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
            positions=np.concatenate([n.positions for n in noted]),
            token_ids=np.concatenate([n.tokens for n in noted]),
            experts=experts,
            flags=np.zeros(len(experts), np.uint16),
            weight_version=self._noted_version,
        )
        self.sink.step(frame)
        self.rows += len(experts)

    def finished(self, request: Any) -> None:
        """vLLM's request ended: its finish goes after every row noted for it (none for a request decoded on another
        engine)."""
        self._referenced.pop(request.request_id, None)
        if self.decoded_elsewhere(request):
            self.flush()
            return
        self.flush()
        self.sink.finish([Ended(request.request_id, int(request.num_tokens), finish_status(request.status))])

    def close(self, timeout: float = 30.0) -> None:
        """Flush, then close the sink without waiting for it (it sends or spills on its own)."""
        self.flush()
        self.sink.close(timeout, wait=False)


def attach(connector: Any, tee: RoutedExpertsTee) -> None:
    """Tee what `connector` (vLLM's `AuxOutputSchedulerConnector`) commits from now on."""
    connector.__dict__[_TEE] = tee


def tee_of(connector: Any) -> RoutedExpertsTee | None:
    """The tee attached to `connector` (vLLM's `AuxOutputSchedulerConnector`; None: none, or no connector)."""
    return None if connector is None else connector.__dict__.get(_TEE)


def _start(engine_core: Any, config: PluginConfig) -> None:
    """Once `engine_core` is built: attach a tee to the scheduler's connector when vLLM's output is on."""
    scheduler = getattr(engine_core, "scheduler", None)
    connector = getattr(scheduler, "aux_output_connector", None)
    vllm_config: Any = getattr(scheduler, "vllm_config", None)
    if connector is None or capture_source(vllm_config) is not Source.VLLM_OUTPUT:
        return
    replies = engine_core.model_executor.collective_rpc(moe_layers_rpc)
    moe_layers = next((r for r in replies if r), None)
    if not moe_layers:
        raise RuntimeError("routing-replay: no worker reported a MoE layer bound to vLLM's routed-experts capturer")
    shape = tee_shape(vllm_config, list(moe_layers))
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    sink = start_sink(config, shape, f"vllm-tee-dp{dp_rank}", Source.VLLM_OUTPUT)
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    tee = RoutedExpertsTee(shape, sink, lambda: weight_version.current(scheduler).label,
                           lambda request: is_prefill_only(request, kv_config, config.pd_role))
    attach(connector, tee)
    info("routing-replay: vLLM's enable_return_routed_experts is on: teeing the rows its aux-output connector "
         "commits (%d MoE layers %s of %d, top-%d) -> %s run %r; the plugin's router capture is off (engine core "
         "dp=%d, pid %d)", shape.num_moe_layers, list(shape.moe_layers), shape.num_hidden_layers, shape.top_k,
         config.url, config.run_id, dp_rank, os.getpid())


def _start_once(engine_core: Any, config: PluginConfig) -> None:
    """`_start` for `engine_core` unless it ran there already (docs/design/vllm_engine_core.md, "When the tee starts").

    A `_start` that raised runs again at the next call (in an engine-core process vLLM stops at the first).
    """
    if engine_core.__dict__.get(_STARTED):
        return
    _start(engine_core, config)
    engine_core.__dict__[_STARTED] = True


def patch_connector() -> None:
    """Wrap `AuxOutputSchedulerConnector.take_output`, `request_finished`, `build_connector_meta` (idempotent).

    None of the wrappers raises into the scheduler: a tee error is logged and vLLM's own output goes on.
    """
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector as Connector

    if is_patched(Connector.take_output):
        return
    orig_take, orig_finished = Connector.take_output, Connector.request_finished
    orig_meta = Connector.build_connector_meta

    def take_output(self, request, output):
        rows = orig_take(self, request, output)
        tee = tee_of(self)
        if tee is not None and rows is not None:
            try:
                tee.committed(request.request_id, output[request.request_id].token_start, rows, request.all_token_ids)
            except Exception:  # any error: never break vLLM's output for the tee
                log.exception("routing-replay: failed to tee the routed experts of %s", request.request_id)
        return rows

    def request_finished(self, request):
        out = orig_finished(self, request)
        tee = tee_of(self)
        if tee is not None and request.is_finished():  # vLLM calls this on preemption too
            try:
                tee.finished(request)
            except Exception:  # any error: as above
                log.exception("routing-replay: failed to tee the finish of %s", request.request_id)
        return out

    def build_connector_meta(self, *a, **kw):
        tee = tee_of(self)
        if tee is not None:
            try:
                tee.flush()
            except Exception:  # any error: as above
                log.exception("routing-replay: failed to hand teed routed experts to the sink")
        return orig_meta(self, *a, **kw)

    patch(Connector, "take_output", take_output)
    patch(Connector, "request_finished", request_finished)
    patch(Connector, "build_connector_meta", build_connector_meta)


def patch_tee(config: PluginConfig) -> None:
    """In the engine core: start a tee when vLLM's routed-experts output is on, at the end of `EngineCore.__init__`
    or, for the engine core whose own `__init__` loaded the plugin, at its first `add_request`; close it at
    `shutdown` (idempotent; nothing on a vLLM without the aux-output connector)."""
    import importlib.util

    if importlib.util.find_spec("vllm.distributed.aux_output_connector") is None:
        return  # a vLLM without the connector: `enable_return_routed_experts` does not exist there
    # (what the tee hooks was checked by `register`: `capture.vllm.hook_points`, Part.TEE)
    from vllm.v1.engine.core import EngineCore

    if is_patched(EngineCore.__init__):
        return
    patch_connector()
    orig_init, orig_add, orig_shutdown = EngineCore.__init__, EngineCore.add_request, EngineCore.shutdown

    def __init__(self, *a, **kw):
        orig_init(self, *a, **kw)
        _start_once(self, config)

    def add_request(self, *a, **kw):
        _start_once(self, config)  # an engine core built before the plugin was loaded: before its first request
        return orig_add(self, *a, **kw)

    def shutdown(self, *a, **kw):
        connector = getattr(getattr(self, "scheduler", None), "aux_output_connector", None)
        tee = tee_of(connector)
        if tee is not None:
            try:
                tee.close()
            except Exception:  # any error: vLLM's shutdown goes on
                log.exception("routing-replay: failed to close the routed-experts tee")
        return orig_shutdown(self, *a, **kw)

    patch(EngineCore, "__init__", __init__)
    patch(EngineCore, "add_request", add_request)
    patch(EngineCore, "shutdown", shutdown)
