"""PCP under Model Runner V2: each rank's DualChunkSwap rows go back to the global batch order (vLLM 0.34, gloo).

The driver (this file run with `.venv-vllm`'s Python and vLLM 0.34 on PYTHONPATH, `VLLM_TARGET_DEVICE=cpu`) forks
one gloo world per case (`tests/support/gloo_fork.py`). Every rank builds vLLM 0.34's own `PCPManager` (device
cpu) and its own `InputBuffers`, and runs three scheduler steps through the plugin's V2 hooks
(`runner_v2.patch_v2_runner`) on vLLM's `GPUModelRunner` class, whose four hooked methods are first replaced by
stand-ins doing what vLLM's do around the hook points: `prepare_inputs` builds the step's global `InputBatch` and
hands it to the manager's real `partition_batch` (`vllm/v1/worker/gpu/model_runner.py:1662`), which returns this
rank's batch; `execute_model` runs the MoE layers on that batch in vLLM's forward context (`is_padding` as
`model_runner.py:2146` sets it), each layer gathering its (token id, position) rows over the PCP gloo group as
`MoERunner._maybe_dispatch` does (`dist.all_gather`, rank-major; not with all2all kernels), then routing them with
a deterministic router of token id, position and layer that marks padding rows -1 as vLLM's routers do
(vLLM's own `get_moe_padding_mask`, `VLLM_MOE_SKIP_PADDING=1`) and calling the plugin as `BaseRouter.capture_fn`.
Nothing on the engine side restores anything: which rows each rank holds, the padding and the restore index are
vLLM's.

Checked here, per case (PCP 2 and 4, uneven prompt lengths, partial prefill chunks, decodes replicated on every
rank or sharded to one, short prefills replicated under DCP, all2all kernels, TP, DP): the frame the sending rank
(PCP 0 / TP 0 of each DP rank, and only it) hands over names the global batch's requests, query_start_loc,
positions and token ids; every rank's recorded experts equal the router applied directly to the global batch,
for every row, with no row flagged; the router's padding mask (seed 000) has P x N entries in rank-major
gathered order and marks exactly the gathered padding (N without the gather); the steps really had padding,
uneven ranks and replicated requests; a graph-safe capture asked for on an engine without CUDA graphs records
through the eager recorder. Also: the start-up refusals (a PCPManager without `_hidden_restore_idx`, the graph-safe
recorder under PCP) and that the plugin leaves the mask to vLLM 0.34. One subprocess for every case (~25-35 s).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.stand_ins import KeptHandoff  # noqa: E402

RELEASE = "0.34.0"
E, K, LAYERS, MAX_TOKENS, MAX_REQS = 64, 4, 2, 128, 8


@dataclass(frozen=True)
class Case:
    dp: int = 1
    pcp: int = 2
    tp: int = 1
    a2a: bool = False  # expert parallelism with all2all kernels: the router sees only this rank's rows
    shard_decodes: bool = False  # pcp_shard_decode_requests: a decode runs on one rank, else on every rank
    dcp: int = 1  # DCP > 1 replicates prefills too short for 2 x PCP chunks
    asked: str = "eager"  # the capture mode asked for (graph_safe: on an engine without CUDA graphs)

    @property
    def world(self) -> int:
        return self.dp * self.pcp * self.tp


CASES = {
    "pcp2": Case(),
    "pcp4": Case(pcp=4),
    "pcp2-a2a": Case(a2a=True),
    "pcp4-a2a": Case(pcp=4, a2a=True),
    "pcp4-shard-decodes": Case(pcp=4, shard_decodes=True),
    "pcp2-dcp2": Case(dcp=2),
    "pcp2-tp2": Case(tp=2),
    "dp2-pcp2": Case(dp=2),
    "dp2-pcp2-tp2-a2a": Case(dp=2, tp=2, a2a=True),
    "pcp4-graph-safe-asked": Case(pcp=4, asked="graph_safe"),
}


@dataclass(frozen=True)
class Req:
    """One request's part of a step: scheduled tokens from `computed` on; a prefill while below `prompt`."""

    rid: str
    prompt: int
    computed: int
    scheduled: int


def steps_of(d: int) -> list[list[Req]]:
    """DP rank d's three steps: uneven prefills (C's in two chunks), then a mix with decodes, then decodes only."""
    a, c = 29 + 3 * d, 20 + d
    ids = [f"{x}{d}-0000abcd" for x in "abcd"]
    return [
        [Req(ids[0], a, 0, a), Req(ids[1], 5, 0, 5), Req(ids[2], c, 0, 12)],
        [Req(ids[0], a, a, 1), Req(ids[1], 5, 5, 1), Req(ids[2], c, 12, c - 12), Req(ids[3], 3, 0, 3)],
        [Req(ids[0], a, a + 1, 1), Req(ids[1], 5, 6, 1), Req(ids[2], c, c, 1), Req(ids[3], 3, 3, 1)],
    ]


def token_of(rid: str, positions: np.ndarray) -> np.ndarray:
    """The token at each position of a request (>= 1: a padding row's 0 is no request's token)."""
    return 1 + (sum(map(ord, rid)) * 131 + positions.astype(np.int64) * 17) % 5000


def route(tokens: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
    """The router: K distinct experts of E, a function of token id, position and layer ([n, K] int64)."""
    h = (np.asarray(tokens, np.int64) * 7 + np.asarray(positions, np.int64) * 3 + layer * 11) % E
    return (h[:, None] + 13 * np.arange(K)[None, :]) % E


# ---- the driver: each forked rank -------------------------------------------------------------------------------


def _global_batch(buffers, step: list[Req]):
    """The step's global `InputBatch`, as V2's `prepare_inputs` lays it out, in the runner's persistent buffers."""
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    r = len(step)
    lens = np.array([q.scheduled for q in step], np.int32)
    n = int(lens.sum())
    qsl = np.zeros(r + 1, np.int32)
    np.cumsum(lens, out=qsl[1:])
    pos = np.concatenate([np.arange(q.computed, q.computed + q.scheduled) for q in step])
    tok = np.concatenate([token_of(q.rid, np.arange(q.computed, q.computed + q.scheduled)) for q in step])
    computed = np.array([q.computed for q in step], np.int32)
    prompt = np.array([q.prompt for q in step], np.int32)
    done = np.minimum(computed, prompt)
    prefilling = done < prompt
    buffers.positions[:n] = torch.from_numpy(pos)
    buffers.input_ids[:n] = torch.from_numpy(tok.astype(np.int32))
    buffers.query_start_loc[: r + 1] = torch.from_numpy(qsl)
    buffers.seq_lens[:r] = torch.from_numpy(computed + lens)
    buffers.is_padding[:n] = False
    slots = np.arange(r, dtype=np.int32)[::-1].copy()  # request-state slots: not the batch order
    return InputBatch(
        req_ids=[q.rid for q in step], num_reqs=r, num_reqs_after_padding=r,
        idx_mapping=torch.from_numpy(slots.astype(np.int64)), idx_mapping_np=slots,
        expanded_idx_mapping=torch.from_numpy(slots.astype(np.int64)),
        expanded_local_pos=torch.zeros(r, dtype=torch.int32),
        num_scheduled_tokens=lens, num_tokens=n, num_tokens_after_padding=n, num_draft_tokens=0,
        num_draft_tokens_per_req=None, query_start_loc=buffers.query_start_loc[: r + 1], query_start_loc_np=qsl,
        seq_lens=buffers.seq_lens[:r], seq_lens_cpu_upper_bound=torch.from_numpy(computed + lens),
        dcp_local_seq_lens=None, num_computed_tokens_np=computed, prefill_len_np=prompt,
        num_computed_prefill_tokens_np=done, is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()),
        decode_graph_eligible=not bool(prefilling.any()), input_ids=buffers.input_ids[:n],
        positions=buffers.positions[:n], is_padding=buffers.is_padding[:n],
        logits_indices=torch.from_numpy(qsl[1:] - 1), cu_num_logits=torch.arange(r + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(r + 1, dtype=np.int32), has_structured_output_reqs=False, prompt_lens=None)


def _moe_layer(layer: int, case: Case):
    """A stand-in for vLLM's `MoERunner`: the config flags the plugin reads, and the router's capture callback."""
    cfg = SimpleNamespace(pcp_size=case.pcp, dp_size=case.dp, is_sequence_parallel=False,
                          moe_parallel_config=SimpleNamespace(use_all2all_kernels=case.a2a))
    return SimpleNamespace(moe_config=cfg, do_naive_dispatch_combine=False, layer_id=layer,
                           layer_name=f"model.layers.{layer}.mlp", capture_fn=None)


def _padding_mask_reader():
    """vLLM's own read of the router's padding mask (`get_moe_padding_mask`, 0.34)."""
    from vllm.forward_context import get_forward_context

    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import get_moe_padding_mask
    except ImportError:  # vLLM 0.33 has no shared helper: its routers read the mask so
        # (0.33: vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py:757)
        def get_moe_padding_mask(num_tokens: int):
            return get_forward_context().is_padding[:num_tokens]
    return get_moe_padding_mask


class _Rank:
    """One forked rank of a case: vLLM's PCPManager and GPUModelRunner class with stand-ins for the four methods
    the plugin hooks (module docstring), the MoE layers, and the plugin's V2 hooks on them."""

    def __init__(self, name: str) -> None:
        import torch

        from capture.vllm.worker.forward_sharding import Parallel
        from tests.support.gloo import groups

        self.case = case = CASES[name]
        g = self.g = groups(case.dp, case.pcp, case.tp)
        self.par = Parallel(case.tp, g.tp_rank, case.pcp, g.pcp_rank, case.dp, g.dp_rank, g.tp_group, g.pcp_group,
                            g.dp_group)
        self.cpu = torch.device("cpu")
        self.layers = [_moe_layer(layer, case) for layer in range(LAYERS)]
        self.hooks = None
        self.mode = None
        self.router_calls: list[dict] = []  # per layer call: the rows routed and the forward context's mask
        self.local: list[dict] = []  # per step: this rank's batch as vLLM's partition_batch made it
        self.closed: list[dict] = []  # per step: the experts and flags the recorder closed it with

    def install_engine(self) -> None:
        """The stand-ins on vLLM's classes, as the methods the plugin wraps (so the plugin patches them next)."""
        import torch
        import torch.distributed as dist
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import ForwardContext, get_forward_context, override_forward_context
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.v1.worker.gpu import model_runner as v2
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        rank, case, padding_mask = self, self.case, _padding_mask_reader()

        def load_model(self, *a, **kw):
            return None

        def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras):
            input_batch = _global_batch(self.input_buffers, scheduler_output)
            if self.pcp_manager is not None:  # as model_runner.py:1662
                input_batch = self.pcp_manager.partition_batch(input_batch, batch_desc)
            return input_batch

        def execute_model(self, scheduler_output, *a, **kw):
            desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=None)
            local = self.prepare_inputs(scheduler_output, None, desc, 0)
            rank.local.append({"req_ids": list(local.req_ids), "num_tokens": int(local.num_tokens),
                               "rows": int(local.num_tokens_after_padding)})
            with override_forward_context(ForwardContext({}, {}, {}, is_padding=local.is_padding)):
                for moe in rank.layers:
                    x = torch.stack([local.input_ids.long(), local.positions.long()], dim=1)
                    if not case.a2a:  # MoERunner._maybe_dispatch: get_pcp_group().all_gather(x, dim=0)
                        parts = [torch.empty_like(x) for _ in range(case.pcp)]
                        dist.all_gather(parts, x, group=rank.g.pcp_group)
                        x = torch.cat(parts)
                    MoERunner._apply_quant_method(moe, x, None, None)
            return None

        def sample_tokens(self, grammar_output):
            return None

        def router(self, hidden_states, router_logits, shared_experts_input, *a, **kw):
            """Where vLLM's router runs (`_apply_quant_method`): route, mark padding -1, call the capture."""
            ids = torch.from_numpy(route(hidden_states[:, 0].numpy(), hidden_states[:, 1].numpy(), self.layer_id))
            pad = padding_mask(hidden_states.shape[0])
            assert pad is not None  # VLLM_MOE_SKIP_PADDING=1
            rank.router_calls.append({"rows": int(hidden_states.shape[0]),
                                      "mask": get_forward_context().is_padding.numpy().copy()})
            self.capture_fn(ids.masked_fill(pad[:, None], -1).to(torch.int32))
            return None, None

        for fn in (load_model, prepare_inputs, execute_model, sample_tokens):
            setattr(v2.GPUModelRunner, fn.__name__, fn)
        MoERunner._apply_quant_method = router

    def start(self, runner) -> None:
        """What `WorkerCapture.startup` does once the routers are bound: the recorder of the asked mode, the
        step hooks (a hand-off only where `Parallel.sends`), the PCP mask decision."""
        from types import SimpleNamespace

        from capture.vllm.config import CaptureMode, PluginConfig
        from capture.vllm.worker import runner as plugin_runner
        from capture.vllm.worker.binder import BoundLayer
        from capture.vllm.worker.forward_sharding import pcp_padding_mask
        from capture.vllm.worker.frame_buffer import StepFrameBuffer
        from capture.vllm.worker.recorder_choice import choose_recorder
        from capture.vllm.worker.step_hooks import StepHooks
        from capture.vllm.worker.worker_capture import WorkerCapture

        shape, par = _shape(), self.par
        bound = [BoundLayer(moe.layer_id, moe, None) for moe in self.layers]
        no_graphs = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=None))
        ordinals = {b.layer_id: b.layer_id for b in bound}
        choice = choose_recorder(CaptureMode(self.case.asked), no_graphs, self.cpu, bound, ordinals, shape,
                                 MAX_TOKENS + 64, par)
        self.mode = str(choice.mode)
        hooks = self.hooks = StepHooks(
            choice.recorder, par, ordinals, frame=StepFrameBuffer(shape), graph=choice.graph,
            handoff=KeptHandoff() if par.sends else None, pcp_masks=pcp_padding_mask(par),
            moe_ordinal_by_runner={id(moe): moe.layer_id for moe in self.layers})
        for moe in self.layers:  # the router's capture_fn (capture/vllm/worker/binder.py chains on_topk into it)
            moe.capture_fn = lambda ids, moe=moe: hooks.on_topk(moe, ids)
        closes = choice.recorder.end_step_into

        def end_step_into(experts):  # keeps what the step closed with, on every rank (only a sender hands it on)
            flags = closes(experts)
            self.closed.append({"experts": experts.copy(), "flags": None if flags is None else flags.copy()})
            return flags

        choice.recorder.end_step_into = end_step_into
        if hooks.pcp_masks is not None:  # what runner._start does then
            plugin_runner._CURRENT = WorkerCapture(PluginConfig("http://unused", "pcp-v2", None, None))
            plugin_runner._CURRENT.hooks = hooks
            plugin_runner.patch_apply_quant_method()

    def runner(self):
        """vLLM's GPUModelRunner, its hooks patched, with this rank's PCPManager and input buffers (no __init__:
        the stand-ins read only what is set here); loaded, which starts the capture."""
        from types import SimpleNamespace

        from vllm.v1.worker.gpu import model_runner as v2
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.pcp_manager import PCPManager

        from capture.vllm.worker import runner_v2

        case = self.case
        assert runner_v2.patch_v2_runner(lambda: self.hooks, self.start)
        runner = object.__new__(v2.GPUModelRunner)
        runner.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=case.pcp),
                                             speculative_config=None)
        runner.pcp_manager = PCPManager(case.pcp, self.g.pcp_rank, self.cpu, shard_decode_requests=case.shard_decodes,
                                        max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS, dcp_world_size=case.dcp,
                                        moe_gathers_tokens=not case.a2a)
        runner.input_buffers = InputBuffers(MAX_REQS, MAX_TOKENS, self.cpu)
        runner.load_model()
        return runner

    def gather_counts(self) -> None:
        """The last step's real rows of every PCP rank (from each rank's own batch): the gathered padding's truth."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([self.local[-1]["num_tokens"]])
        counts = [torch.zeros(1, dtype=mine.dtype) for _ in range(self.case.pcp)]
        dist.all_gather(counts, mine, group=self.g.pcp_group)
        self.local[-1]["counts"] = [int(c) for c in counts]


def run_case(name: str) -> dict:
    """One rank of case `name`: three steps through the plugin's V2 hooks over vLLM's PCPManager; what it saw."""
    from capture.vllm.worker import runner_v2

    rank = _Rank(name)
    rank.install_engine()
    runner = rank.runner()
    globals_ = []
    for i, step in enumerate(steps_of(rank.g.dp_rank)):
        runner_v2.HOST_COPY = runner_v2.HostCopy.DEFERRED if i == 1 else runner_v2.HostCopy.IMMEDIATE
        runner.execute_model(step)
        runner.sample_tokens(None)
        spans = [np.arange(q.computed, q.computed + q.scheduled) for q in step]
        globals_.append({"req_ids": [q.rid for q in step], "positions": np.concatenate(spans),
                         "tokens": np.concatenate([token_of(q.rid, span) for q, span in zip(step, spans)])})
        rank.gather_counts()
    hooks = rank.hooks
    return {"place": (rank.g.dp_rank, rank.g.pcp_rank, rank.g.tp_rank), "sends": rank.par.sends,
            "frames": hooks.handoff.frames if hooks.handoff is not None else None, "globals": globals_,
            "closed": rank.closed, "router": rank.router_calls, "local": rank.local, "ignored": hooks.ignored_captures,
            "plugin_mask": hooks.pcp_masks is not None, "mode": rank.mode}


def startup_checks() -> dict:
    """The start-up refusals and the mask decision, in the driver (after every fork)."""
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from capture.vllm.worker import runner_v2
    from capture.vllm.worker.forward_sharding import pcp_mask_fixed_upstream
    from capture.vllm.worker.startup_checks import StartupError

    out: dict = {"mask_fixed_upstream": pcp_mask_fixed_upstream()}
    vcfg = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=2), speculative_config=None)
    manager = PCPManager(2, 0, torch.device("cpu"), shard_decode_requests=False, max_num_reqs=4, max_num_tokens=16)

    def refusal(check: str, *args) -> str | None:
        """The StartupError's message; None when the check passes; what else happened, said as such."""
        try:
            getattr(runner_v2, check)(*args)
        except StartupError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - e.g. an older plugin without the check: the test says what
            return f"not a refusal: {type(e).__name__}: {e}"
        return None

    out["v2_config"] = refusal("check_v2_config", vcfg)
    out["manager_ok"] = refusal("check_v2_pcp", SimpleNamespace(vllm_config=vcfg, pcp_manager=manager))
    out["class_ok"] = refusal("check_v2_pcp", SimpleNamespace(vllm_config=vcfg, pcp_manager=None))
    del manager._hidden_restore_idx  # a vLLM that renamed it
    out["renamed"] = refusal("check_v2_pcp", SimpleNamespace(vllm_config=vcfg, pcp_manager=manager))
    graph_safe_hooks = SimpleNamespace(graph=object())  # what StepHooks holds when the graph-safe capture was chosen
    out["graph_safe"] = refusal("check_v2_graph_pcp", SimpleNamespace(vllm_config=vcfg), graph_safe_hooks)
    return out


def drive(out_path: str) -> None:
    """Every case in its own forked gloo world, then the start-up checks; pickled to `out_path`."""
    import vllm.forward_context  # noqa: F401 - imported once here, before the forks
    import vllm.model_executor.layers.fused_moe.runner.moe_runner  # noqa: F401
    import vllm.v1.worker.gpu.model_runner  # noqa: F401
    import vllm.v1.worker.gpu.pcp_manager  # noqa: F401

    import capture.vllm.worker.runner  # noqa: F401
    from tests.support.gloo_fork import run_forked

    results: dict = {"cases": {}}
    for name, case in CASES.items():
        try:
            results["cases"][name] = {"ranks": run_forked(case.world, run_case, name)}
        except (AssertionError, TimeoutError) as e:
            results["cases"][name] = {"error": str(e)}
    results["startup"] = startup_checks()
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


# ---- the tests (main environment) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    from tests.support.vllm_releases import release_env, run_script

    out = tmp_path_factory.mktemp("pcp_v2") / "driven.pkl"
    env = release_env(RELEASE, VLLM_TARGET_DEVICE="cpu", VLLM_MOE_SKIP_PADDING="1")
    proc = run_script(RELEASE, Path(__file__), str(out), env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def _read_frames(frames: list[bytes]):
    from replay_format.step_frame import LENGTH, ConfigFrame, FrameReader, pack

    reader = FrameReader()
    reader.read(pack(ConfigFrame(_shape(), {}))[LENGTH.size:])
    return [reader.read(frame[LENGTH.size:]) for frame in frames]


def _shape():
    from replay_format import RunShape

    return RunShape(LAYERS, K, E, tuple(range(LAYERS)))


def _ranks(driven, name: str) -> list[dict]:
    case = driven["cases"][name]
    assert "error" not in case, case.get("error")
    return case["ranks"]


def _expected(glob: dict) -> np.ndarray:
    """The router applied directly to the global batch: [n, LAYERS, K]."""
    return np.stack([route(glob["tokens"], glob["positions"], layer) for layer in range(LAYERS)], axis=1)


@pytest.mark.parametrize("name", CASES)
def test_every_ranks_rows_are_restored_to_the_global_batch(driven, name):
    for rank in _ranks(driven, name):
        assert rank["ignored"] == 0
        assert len(rank["closed"]) == len(rank["globals"]) == 3
        for glob, closed in zip(rank["globals"], rank["closed"]):
            assert closed["flags"] is None, f"{rank['place']}: rows flagged {closed['flags']}"
            got = np.sort(closed["experts"].astype(np.int64), axis=-1)
            assert np.array_equal(got, np.sort(_expected(glob), axis=-1)), rank["place"]


@pytest.mark.parametrize("name", CASES)
def test_only_pcp0_tp0_sends_the_global_batchs_frame(driven, name):
    case = CASES[name]
    senders = [r for r in _ranks(driven, name) if r["frames"] is not None]
    assert sorted(r["place"] for r in senders) == [(d, 0, 0) for d in range(case.dp)]
    assert all(r["sends"] == (r["frames"] is not None) for r in _ranks(driven, name))
    for rank in senders:
        frames = _read_frames(rank["frames"])
        assert len(frames) == 3
        for frame, glob in zip(frames, rank["globals"]):
            assert frame.req_ids == glob["req_ids"]
            lens = [int(b - a) for a, b in zip(frame.query_start_loc[:-1], frame.query_start_loc[1:])]
            assert sum(lens) == len(glob["positions"])
            assert frame.positions.tolist() == glob["positions"].tolist()
            assert frame.token_ids.tolist() == glob["tokens"].tolist()
            assert np.array_equal(np.sort(frame.experts.astype(np.int64), -1), np.sort(_expected(glob), -1))


@pytest.mark.parametrize("name", CASES)
def test_router_mask_is_rank_major_over_the_gathered_rows(driven, name):
    """Seed 000: P x N entries in the gathered order, True exactly on each rank's padding (N entries, all2all)."""
    case = CASES[name]
    for rank in _ranks(driven, name):
        assert not rank["plugin_mask"]  # vLLM 0.34 expands the mask itself: the plugin installs none
        calls = iter(rank["router"])
        for local in rank["local"]:
            n, counts = local["rows"], local["counts"]
            truth = np.concatenate([np.arange(n) >= c for c in counts])
            if case.a2a:
                truth = truth[rank["place"][1] * n : (rank["place"][1] + 1) * n]
            for _ in range(LAYERS):
                call = next(calls)
                assert call["rows"] == len(truth) == call["mask"].shape[0]
                assert call["mask"].tolist() == truth.tolist()


@pytest.mark.parametrize("name", CASES)
def test_the_steps_had_padding_uneven_ranks_and_replicated_requests(driven, name):
    """What makes the cases above mean something, as vLLM's partition made it."""
    case = CASES[name]
    for rank in _ranks(driven, name):
        counts = [local["counts"] for local in rank["local"]]
        assert any(len(set(c)) > 1 for c in counts)  # uneven ranks: padding rows in the gather
        on_every_rank = set.intersection(*(set(r["local"][1]["req_ids"]) for r in _ranks(driven, name)
                                           if r["place"][0] == rank["place"][0]))
        if case.shard_decodes:
            assert not any(rid.startswith(("a", "b")) for rid in on_every_rank)  # each decode on one rank
        else:  # the decodes run whole on every rank (replicated_requests); the index reads one copy
            assert any(rid.startswith(("a", "b")) for rid in on_every_rank)


@pytest.mark.parametrize("name", CASES)
def test_the_eager_recorder_restores_pcp_rows(driven, name):
    """Asked for graph-safe capture on an engine without CUDA graphs, PCP layers fall back to the eager recorder
    (`recorder_choice`; with CUDA graphs it is refused, `test_startup_refusals_and_mask`)."""
    assert {rank["mode"] for rank in _ranks(driven, name)} == {"eager"}


def test_short_prefill_is_replicated_under_dcp(driven):
    ranks = [r for r in _ranks(driven, "pcp2-dcp2") if r["place"][0] == 0]
    first = [set(r["local"][1]["req_ids"]) for r in ranks]
    assert "d0-0000abcd" in set.intersection(*first)  # 3 tokens, fewer than 2 x PCP chunks: every rank runs it
    local = [r["local"][1] for r in ranks]
    assert all(x["num_tokens"] >= 3 for x in local)


def test_startup_refusals_and_mask(driven):
    s = driven["startup"]
    assert s["v2_config"] is None  # PCP on V2 is not refused
    assert s["manager_ok"] is None and s["class_ok"] is None  # vLLM 0.34's manager, built or not yet
    assert "refusing to start" in (s["renamed"] or "") and "_hidden_restore_idx" in s["renamed"]
    assert "refusing to start" in (s["graph_safe"] or "") and "--enforce-eager" in s["graph_safe"]
    assert s["mask_fixed_upstream"]  # vLLM 0.34's PCPManager expands the router's mask: the plugin adds none


if __name__ == "__main__":
    drive(sys.argv[1])
