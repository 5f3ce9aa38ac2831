"""The plugin's engine-core half and vLLM's R3 tee against vLLM's real engine core: a script run in a vLLM 0.33/0.34
environment by `tests/test_vllm_engine_core_releases.py` (`tests/support/vllm_releases.py`).

`python tests/support/engine_core_driver.py URL OUT_DIR` patches vLLM as the plugin does in an engine core
(`patch_scheduler`, the tee's `patch_connector`) and runs the scenarios below on vLLM's engine core with a stand-in
worker (`engine_core_stand_in.py`), once per capture route: `plugin` (vLLM's R3 off: the plugin's worker hooks capture
the rows and get the engine core's `SchedulerNotes`; their sink streams to run `ec-<version>-plugin-*`) and `tee`
(vLLM's `enable_return_routed_experts` on: the tee streams what vLLM's `AuxOutputSchedulerConnector` hands the user).
It checks what the engine core shows (the notes against the scheduler's own hits, frees and labels) and exits
non-zero naming the first failure; else it writes OUT_DIR/result.json and OUT_DIR/rows.npz: per route and user
request id, what the service must hold (`expected_rows`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from engine_core_stand_in import (  # noqa: E402
    LAYERS,
    MOE_LAYERS,
    STOP,
    TOP_K,
    StandInWorker,
    build_engine_core,
    build_scheduler,
    engine_config,
    save_model_dir,
)

NUM_BLOCKS = 20  # KV blocks of 4 tokens: three 32-token requests do not fit together (preemption)
NEW_WEIGHTS = ("rl-step-1", "rl-step-2")  # the labels of the two weight updates


class Failed(AssertionError):
    """What the engine core showed differs from what the scenario expects."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


@dataclass
class Submitted:
    """A request as the user gave it, the engine core's id for it, and what the plugin route must reference."""

    user: str
    internal: str
    request: Any  # vllm.v1.request.Request
    prefill_only: bool = False
    references: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, source user id)


@dataclass
class Returned:
    """What the engine core returned for one request (`EngineCoreOutput`s), as the front end collects it."""

    tokens: list[int] = field(default_factory=list)
    routed_experts: list[tuple[np.ndarray, str]] = field(default_factory=list)  # (rows, the output's weight_version)
    kv_transfer_params: dict | None = None


class Session:
    """One engine core (vLLM's) with its stand-in worker and the capture of one route, and what it returned."""

    def __init__(self, model_dir: str, route: str, url: str, run: str, spill: Path,
                 kv_transfer: dict | None = None) -> None:
        from capture.vllm.config import PluginConfig

        self.route, self.run = route, run
        self.vllm_config = engine_config(model_dir, aux=route == "tee", num_blocks=NUM_BLOCKS, kv_transfer=kv_transfer)
        self.producer = bool(kv_transfer and kv_transfer.get("kv_role") == "kv_producer")  # every request: P/D prefill
        self.scheduler = build_scheduler(self.vllm_config, NUM_BLOCKS)
        self.config = PluginConfig(url=url, run_id=run, token=None, spill_dir=spill)
        self.worker = StandInWorker(self.scheduler, aux=route == "tee")
        self.sink: Any = None
        if route == "plugin":
            self.worker.hooks = self._plugin_hooks()
        else:
            self._attach_tee()
        self.core = build_engine_core(self.vllm_config, self.scheduler, self.worker)
        self.block_hasher = request_block_hasher(self.vllm_config)
        self.submitted: dict[str, Submitted] = {}  # by internal id
        self.returned: dict[str, Returned] = {}
        self.labels: list[str | None] = []  # each EngineCoreOutputs' weight_version, in order
        self.updates: list[str] = []  # the weight versions set, in order
        self.preempted: set[str] = set()

    def _plugin_hooks(self):
        """The worker hooks `WorkerCapture.startup` builds (`capture/vllm/worker/worker_capture.py`), on a real sink."""
        from capture.vllm.sink.handoff import start_sink
        from capture.vllm.worker.forward_sharding import Parallel
        from capture.vllm.worker.frame_buffer import StepFrameBuffer
        from capture.vllm.worker.step_hooks import StepHooks
        from capture.worker.recorder import StepRecorder
        from replay_format import RunShape, Source

        shape = RunShape(len(MOE_LAYERS), TOP_K, 8, MOE_LAYERS, LAYERS)
        self.sink = start_sink(self.config, shape, "vllm-dp0", Source.VLLM_PLUGIN)
        hooks = StepHooks(StepRecorder(shape, max_tokens=256), Parallel(), {layer: i for i, layer in
                                                                           enumerate(MOE_LAYERS)},
                          frame=StepFrameBuffer(shape), handoff=self.sink)
        hooks.local_layers = dict.fromkeys(range(len(MOE_LAYERS)), True)  # one rank: each router sees the batch
        hooks.moe_ordinal_by_runner = {id(r): i for i, r in enumerate(self.worker.routers)}  # as startup() notes
        return hooks

    def _attach_tee(self) -> None:
        """The tee `routed_experts_tee._start` attaches, on a real sink (its MoE layers as the workers report)."""
        from capture.vllm.engine_core import routed_experts_tee as tee_mod
        from capture.vllm.engine_core import weight_version
        from capture.vllm.kv_connectors import is_prefill_only
        from capture.vllm.sink.handoff import start_sink
        from replay_format import Source

        connector = self.scheduler.aux_output_connector
        check(connector is not None, "vLLM built no AuxOutputSchedulerConnector with enable_return_routed_experts on")
        shape = tee_mod.tee_shape(self.vllm_config, list(MOE_LAYERS))
        self.sink = start_sink(self.config, shape, "vllm-tee-dp0", Source.VLLM_OUTPUT)
        scheduler = self.scheduler
        kv_config = self.vllm_config.kv_transfer_config
        self.tee = tee_mod.RoutedExpertsTee(shape, self.sink, lambda: weight_version.current(scheduler).label,
                                            lambda request: is_prefill_only(request, kv_config, self.config.pd_role))
        tee_mod.attach(connector, self.tee)

    # ---- the user's side -------------------------------------------------------------------------------------

    def submit(self, user: str, prompt: list[int], max_tokens: int, n: int = 1, stop_after: int | None = None,
               kv_transfer_params: dict | None = None) -> list[Submitted]:
        """Add a request as vLLM's front end does: its internal id (`InputProcessor.assign_request_id`), `n > 1` as
        child requests (`ParentRequest.get_child_info`), the engine core's block hasher."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.engine.parallel_sampling import ParentRequest
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[STOP], ignore_eos=True, extra_args=extra)
        front = _FrontEndRequest(user, params)
        InputProcessor.assign_request_id(front)  # vllm/v1/engine/input_processor.py: "{user}-{8 random}"
        children = [(front.request_id, params)] if n == 1 else \
            [ParentRequest(front).get_child_info(i) for i in range(n)]
        out = []
        for i, (internal, child_params) in enumerate(children):
            request = Request(internal, list(prompt), child_params, None, block_hasher=self.block_hasher)
            self.core.add_request(request)
            remote = bool(kv_transfer_params and kv_transfer_params.get("do_remote_decode"))
            sub = Submitted(user if n == 1 else f"{i}_{user}", internal, request, prefill_only=remote or self.producer)
            if stop_after is not None:
                self.worker.stops[internal] = stop_after
            if remote:  # NixlConnector keeps its blocks until the decode engine has read them
                self.worker.sending.add(internal)
            self.submitted[internal] = sub
            out.append(sub)
        return out

    def abort(self, sub: Submitted) -> None:
        """The user's abort, as the engine core handles it between steps (`EngineCore.abort_requests`)."""
        self.core.abort_requests([sub.internal])

    # ---- the engine core's loop -------------------------------------------------------------------------------

    def step(self) -> None:
        """One turn of `EngineCoreProc._process_engine_step`: `step_fn`, its outputs to the front end."""
        outputs, _ = self.core.step_fn()
        for client_outputs in (outputs or {}).values():
            self.labels.append(client_outputs.weight_version)
            for out in client_outputs.outputs:
                got = self.returned.setdefault(out.request_id, Returned())
                got.tokens += list(out.new_token_ids)
                if out.routed_experts is not None:
                    got.routed_experts.append((np.array(out.routed_experts), client_outputs.weight_version))
                if out.kv_transfer_params is not None:
                    got.kv_transfer_params = out.kv_transfer_params
        self.preempted |= {s.internal for s in self.submitted.values() if s.request.num_preemptions > 0}

    def run_until(self, done, limit: int = 400) -> None:
        """Step while the engine has work and `done()` is False (the busy loop, `EngineCoreProc.run_busy_loop`)."""
        for _ in range(limit):
            if done() or not self.core.has_work():
                return
            self.step()
        raise Failed(f"{self.route}: the engine was still busy after {limit} steps")

    def run_until_idle(self) -> None:
        self.run_until(lambda: False)

    def outputs_of(self, sub: Submitted) -> int:
        return len(self.returned.get(sub.internal, Returned()).tokens)

    def update_weights(self, label: str, clear_cache: bool) -> None:
        """An RL weight update as `AsyncLLM` drives it: `pause_generation(mode="keep", clear_cache)` (the pause
        completes once the in-flight steps are done: the idle callbacks, `EngineCoreProc._process_input_queue`), new
        weights in the workers, `set_weight_version`, `resume_scheduler`."""
        future = self.core.pause_generation(mode="keep", clear_cache=clear_cache)
        self.run_until(lambda: False)  # PAUSED_ALL: no new step, the batch queue drains
        self.core._notify_idle_state_callbacks()
        check(future is None or future.done(), f"{self.route}: the pause did not complete once idle")
        self.worker.weights = label  # e.g. collective_rpc("reload_weights")
        self.core.set_weight_version(label)
        self.updates.append(label)
        self.core.resume_scheduler()

    def finished(self, check_engine=None) -> Session:
        """The engine core's shutdown once its scenarios ran: the scheduler's (its finish journal), then the tee's or
        the worker's sink is closed without waiting (as at a process's exit; the caller waits for it); then the checks
        of what the engine core showed (`check_engine`, if any, and the notes)."""
        self.scheduler.shutdown()
        if self.route == "tee":
            self.tee.flush()
        check(self.sink.close(60.0, wait=False), f"{self.route}: frames were still waiting for the sink at close")
        if check_engine is not None:
            check_engine()
        check_notes(self)
        return self


def request_block_hasher(vllm_config):
    """The engine core's block hasher (vllm/v1/engine/core.py, 0.34: lines 236-246; `init_none_hash` once per engine
    core: its seed may be random)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(vllm_config.cache_config.block_size, hash_fn)


class _FrontEndRequest:
    """The fields of an `EngineCoreRequest` that vLLM's id assignment and `ParentRequest` read."""

    def __init__(self, request_id: str, params) -> None:
        self.request_id, self.external_req_id, self.params, self.sampling_params = request_id, None, params, params


# ---- scenarios ---------------------------------------------------------------------------------------------------


def tokens(first: int, count: int) -> list[int]:
    """`count` prompt tokens from `first` on (disjoint ranges: no two scenarios share a block by accident)."""
    return list(range(first, first + count))


def prefix_hits(s: Session) -> None:
    """A prompt whose first 3 blocks another request computed: the engine reuses them (a reference to it)."""
    shared = tokens(600, 12)
    (a,) = s.submit("sys-a", shared + [700, 701, 702], max_tokens=3)
    s.run_until_idle()
    (b,) = s.submit("sys-b", shared + [710, 711], max_tokens=3)
    s.run_until_idle()
    b.references.append((0, 12, a.user))


def parallel_sampling(s: Session) -> None:
    """`n = 3` in one step: the first child computes the prompt's full blocks, the others hit them at once."""
    children = s.submit("grp", tokens(720, 10), max_tokens=3, n=3)
    s.run_until_idle()
    for child in children[1:]:
        child.references.append((0, 8, children[0].user))


def stop_and_abort(s: Session) -> None:
    """One request stops on a token (under async scheduling its next step is already running), one is aborted."""
    s.submit("stp", tokens(740, 6), max_tokens=10, stop_after=2)
    (abt,) = s.submit("abt", tokens(750, 7), max_tokens=20)
    s.run_until(lambda: s.outputs_of(abt) >= 3)
    s.abort(abt)
    s.run_until_idle()


def preemption(s: Session) -> list[Submitted]:
    """Three 32-token requests on 19 usable blocks: the scheduler preempts one and resumes it later."""
    subs = [s.submit(f"pre-{i}", tokens(800 + 20 * i, 16), max_tokens=16)[0] for i in range(3)]
    s.run_until_idle()
    return subs


def weight_update(s: Session) -> list[Submitted]:
    """Two requests mid-generation when the weights change under `pause(mode="keep")`, the prefix cache cleared:
    vLLM recomputes them from position 0 under the new weights."""
    subs = [s.submit("wv-a", tokens(900, 9), max_tokens=8)[0], s.submit("wv-b", tokens(920, 11), max_tokens=8)[0]]
    s.run_until(lambda: all(s.outputs_of(x) >= 3 for x in subs))
    s.update_weights(NEW_WEIGHTS[0], clear_cache=True)
    s.run_until_idle()
    return subs


def weight_update_kv_kept(s: Session) -> None:
    """A weight update that keeps the KV cache (`clear_cache=False`): the request in flight goes on from its KV, and a
    request after the update reuses blocks the old weights computed (a reference to their computation)."""
    (a,) = s.submit("kv-a", tokens(940, 10), max_tokens=8)
    s.run_until(lambda: s.outputs_of(a) >= 3)
    s.update_weights(NEW_WEIGHTS[1], clear_cache=False)
    (b,) = s.submit("kv-b", tokens(940, 8) + [990, 991, 992], max_tokens=3)
    s.run_until_idle()
    b.references.append((0, 8, a.user))


def offload(s: Session) -> None:
    """ExampleConnector as an offload tier of this engine: a prompt's blocks are evicted from the device, and the
    same prompt later loads them back from the connector's storage (`allocate_slots(num_external_computed_tokens)`):
    a reference to the request that computed them."""
    prompt = tokens(1000, 18)  # ExampleConnector keys a prompt by its first align(len - 1) tokens: 16 here
    (a,) = s.submit("off-a", prompt, max_tokens=2)
    s.run_until_idle()
    for i in range(2):  # 15 blocks each of the 19: the least recently used, off-a's, are evicted
        s.submit(f"fill-{i}", tokens(1100 + 70 * i, 60), max_tokens=1)
        s.run_until_idle()
    (b,) = s.submit("off-b", prompt, max_tokens=2)
    s.run_until_idle()
    check(16 in s.worker.loaded, f"{s.route}: ExampleConnector loaded nothing back for off-b: {s.worker.loaded}")
    b.references.append((0, 16, a.user))


def prefill_decode(s: Session) -> None:
    """A P/D prefill request (`max_tokens=1`, as the proxy sends it): by vLLM's P/D protocol
    (`kv_transfer_params.do_remote_decode`, NixlConnector) beside a request decoded here, or on a `kv_producer`
    engine (ExampleConnector: vLLM refuses its R3 with the P/D connectors of that protocol)."""
    params = None if s.producer else {"do_remote_decode": True, "do_remote_prefill": False}
    s.submit("pd-pre", tokens(960, 9), max_tokens=1, kv_transfer_params=params)
    if not s.producer:
        s.submit("pd-local", tokens(980, 6), max_tokens=4)
    s.run_until_idle()


# ---- what the engine core showed ----------------------------------------------------------------------------------


def check_engine(s: Session, pre: list[Submitted], wv: list[Submitted]) -> None:
    """The scenarios did what they are for, by vLLM's own account."""
    check(bool(s.preempted & {x.internal for x in pre}), f"{s.route}: no preemption under {NUM_BLOCKS} blocks")
    check(set(s.labels) == {"default", *NEW_WEIGHTS} and s.labels[0] == "default",
          f"{s.route}: vLLM's output weight versions {sorted(set(map(str, s.labels)))}")
    restarts = [(rid, at) for rid, at in s.worker.started if rid in {x.internal for x in wv}]
    check(len(restarts) >= 4 and all(at == 0 for _, at in restarts),
          f"{s.route}: the cleared cache should recompute the in-flight requests from 0: {restarts}")


def check_notes(s: Session) -> None:
    """The `SchedulerNotes` each step carried against the scheduler: hits, frees and the weight version."""
    by_internal = s.submitted
    refs = {(by_internal[r.request_id].user, r.start, r.end, by_internal[r.source_request_id].user)
            for notes in s.worker.notes if notes is not None for r in notes.prefix_hits}
    expected = {(x.user, a, b, src) for x in by_internal.values() for a, b, src in x.references}
    check(refs == expected, f"{s.route}: prefix references {sorted(refs)}, expected {sorted(expected)}")
    first_starts: dict[str, int] = {}
    for rid, at in s.worker.started:  # a request's later starts are resumes (self-hits are no reference)
        first_starts.setdefault(rid, at)
    hits = {by_internal[rid].user: at for rid, at in first_starts.items() if at > 0}
    check({u: b for u, a, b, _ in expected} == hits, f"{s.route}: vLLM's prefix hits {hits}")
    ended = {rid: e for notes in s.worker.notes if notes is not None for rid, e in notes.finished.items()}
    for internal, sub in by_internal.items():
        request, note = sub.request, ended.get(internal)
        check(note is not None, f"{s.route}: no finish note for {sub.user}")
        status = "aborted" if "ABORTED" in request.status.name else "finished"
        check((note.num_tokens, str(note.status), note.remote_decode) == (request.num_tokens, status,
                                                                          sub.prefill_only),
              f"{s.route}: {sub.user} noted {note}, vLLM: {request.num_tokens} tokens, {request.status.name}")
    versions = [(i, n.weight_version.label) for i, n in enumerate(s.worker.notes)
                if n is not None and n.weight_version is not None]
    check([label for _, label in versions] == ["default", *s.updates] and versions[0][0] == 0,
          f"{s.route}: weight versions announced {versions}")


# ---- what the service must hold ---------------------------------------------------------------------------------


def expected_rows(s: Session, rows: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per user id: the rows the service must serve (into `rows`: `<route>/<user>/first`, and `/latest` on the plugin
    route), their weight versions, the tokens, how the request ended and the references the plugin route sends."""
    out = {}
    for internal, sub in s.submitted.items():
        request, returned = sub.request, s.returned.get(internal, Returned())
        check(list(request.prompt_token_ids) + returned.tokens == list(request.all_token_ids),
              f"{s.route}: {sub.user}: the outputs returned are not the request's tokens")
        entry = {"internal": internal, "tokens": list(request.all_token_ids), "num_tokens": request.num_tokens,
                 "status": "aborted" if "ABORTED" in request.status.name else "finished",
                 "prefill_only": sub.prefill_only, "references": sub.references,
                 "ends_at": request.num_prompt_tokens if sub.prefill_only else request.num_tokens - 1}
        key = f"{s.route}/{sub.user}"
        if s.route == "tee":
            rows[key + "/first"], entry["versions"], entry["vllm_stamps"] = tee_rows(s, sub, returned)
        else:
            rows[key + "/first"], rows[key + "/latest"], entry["versions"], entry["recomputed"] = plugin_rows(s, sub)
        out[sub.user] = entry
    return out


def tee_rows(s: Session, sub: Submitted, returned: Returned) -> tuple[np.ndarray, list[str], list[str]]:
    """vLLM's R3 route: what the engine core returned to the user (`EngineCoreOutput.routed_experts`), checked equal
    to what the stand-in worker fed vLLM's connector; the weights that computed each row, and vLLM's own stamp on the
    output that carried it (`EngineCoreOutputs.weight_version`)."""
    got = np.concatenate([r for r, _ in returned.routed_experts])
    stamps = [label for r, label in returned.routed_experts for _ in range(len(r))]
    fed = s.worker.aux.emitted[sub.internal]
    check(len(got) == (sub.request.num_prompt_tokens if sub.prefill_only else sub.request.num_tokens - 1)
          and got.tobytes() == np.stack([row for row, _ in fed[: len(got)]]).tobytes(),
          f"tee: {sub.user}: vLLM returned other rows than were fed")
    return got, [label for _, label in fed[: len(got)]], stamps


def computations(s: Session, internal: str) -> tuple[dict[int, list[tuple[np.ndarray, str]]], int]:
    """What the stand-in model computed for a request: per position its computations (row, weights), in order."""
    done: dict[int, list[tuple[np.ndarray, str]]] = {}
    for start, rows, label in s.worker.computed.get(internal, []):
        for i, row in enumerate(rows):
            done.setdefault(start + i, []).append((row, label))
    return done, max(done, default=-1) + 1


def plugin_rows(s: Session, sub: Submitted) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """The plugin route: each position's first and latest computation by the request itself, or, inside a reference,
    the source's, up to the last position it computed (an abort or a stop can land while the next step runs); the
    first computations' weight versions; how many positions were computed under two weights."""
    done, end = computations(s, sub.internal)
    by_user = {x.user: x for x in s.submitted.values()}
    for a, b, src in sub.references:
        source, _ = computations(s, by_user[src].internal)
        for p in range(a, b):
            check(p not in done, f"plugin: {sub.user} computed position {p} of its prefix-cache hit")
            done[p] = source[p]
    missing = [p for p in range(end) if p not in done]
    check(not missing, f"plugin: {sub.user}: positions {missing[:5]} were neither computed nor referenced")
    recomputed = sum(len({label for _, label in done[p]}) > 1 for p in range(end))
    return (np.stack([done[p][0][0] for p in range(end)]), np.stack([done[p][-1][0] for p in range(end)]),
            [done[p][0][1] for p in range(end)], recomputed)


def main_engine(model_dir: str, route: str, url: str, run: str, spill: Path) -> Session:
    """The engine of most scenarios (no KV connector), run and checked."""
    s = Session(model_dir, route, url, run, spill / route)
    prefix_hits(s)
    parallel_sampling(s)
    stop_and_abort(s)
    pre = preemption(s)
    wv = weight_update(s)
    weight_update_kv_kept(s)
    return s.finished(lambda: check_engine(s, pre, wv))


def offload_engine(model_dir: str, route: str, url: str, run: str, spill: Path) -> Session:
    """An engine with ExampleConnector as its offload tier (both roles), run and checked."""
    s = Session(model_dir, route, url, run, spill / f"{route}-offload", kv_transfer={
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(spill / f"{route}-offload-kv")}})
    offload(s)
    return s.finished()


def prefill_engine(model_dir: str, route: str, url: str, run: str, spill: Path) -> Session:
    """A P/D prefill engine: NixlConnector (both roles, `do_remote_decode` per request), or for the tee ExampleConnector
    as `kv_producer` (vLLM refuses R3 with NixlConnector: `VllmConfig._verify_aux_output_compatibility`)."""
    connector = {"kv_connector": "NixlConnector", "kv_role": "kv_both"} if route == "plugin" else {
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(spill / f"{route}-pd-kv")}}
    s = Session(model_dir, route, url, run, spill / f"{route}-pd", kv_transfer=connector)
    prefill_decode(s)
    if not s.producer:
        (prefill,) = [x for x in s.submitted.values() if x.prefill_only]
        check(s.returned[prefill.internal].kv_transfer_params is not None,
              f"{route}: NixlConnector returned no kv_transfer_params for the prefill-only request")
    return s.finished()


def run_route(model_dir: str, route: str, url: str, spill: Path, version: str, rows: dict, sinks: list) -> dict:
    """Every scenario on one route, one engine core at a time (as a process holds one: the finish journal is per
    process); their sinks into `sinks`; what the service must hold."""
    run = f"ec-{version}-{route}-{os.urandom(2).hex()}"  # a fresh run on a service that may hold an earlier one
    engines = [start(model_dir, route, url, run, spill) for start in (main_engine, offload_engine, prefill_engine)]
    sinks += [s.sink for s in engines]
    journal = spill / ".finish-notes" / f"{os.getpid()}.jsonl"
    check(not journal.exists(), f"{route}: the finish journal kept undelivered notes: {journal}")
    requests: dict[str, dict] = {}
    for s in engines:
        requests.update(expected_rows(s, rows))
    return {"run": run, "async_scheduling": bool(engines[0].vllm_config.scheduler_config.async_scheduling),
            "requests": requests}


def main(url: str, out: Path) -> None:
    import vllm

    from capture.vllm.engine_core.routed_experts_tee import patch_connector
    from capture.vllm.engine_core.scheduler import patch_scheduler

    t0 = time.monotonic()
    spill = out / "spill"
    # The plugin's settings as vLLM's processes see them: the scheduler patch reads its spill root (finish journal).
    os.environ.update(ROUTING_REPLAY_URL=url, ROUTING_REPLAY_RUN_ID="engine-core", ROUTING_REPLAY_SPILL_DIR=str(spill))
    patch_scheduler()
    patch_connector()
    model_dir = save_model_dir(str(out / "model"))
    rows: dict[str, np.ndarray] = {}
    sinks: list = []
    result = {"vllm": vllm.__version__, "routes": {}}
    for route in ("plugin", "tee"):
        result["routes"][route] = run_route(model_dir, route, url, spill, vllm.__version__, rows, sinks)
    for sink in sinks:  # every row and finish sent (or spilled: then lost_frames says nothing, the service will)
        check(sink.close(60.0, wait=True), "a sink did not finish in 60 s")
    result["seconds"] = round(time.monotonic() - t0, 1)
    np.savez(out / "rows.npz", **rows)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
