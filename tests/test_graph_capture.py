"""The graph-safe capture (capture/worker/graph_recorder.py) under torch.compile(fullgraph=True), on CPU.

A compiled graph with no break is the CPU proxy for CUDA-graph safety: the router callback
must be fixed-shape device work that a graph can hold. The same compiled step is then replayed
with new inputs and fewer real tokens than its padded size, and every real row and stamp is
checked against an eager reference. The device check (scripts/gpu_check.py) runs here with
`--device cpu` so it does not rot; on a GPU it captures the same router into a CUDAGraph.
"""

from __future__ import annotations

import importlib.util
import operator
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from capture.vllm.config import CaptureMode, PluginConfig, PluginConfigError
from capture.vllm.worker.forward_sharding import Parallel
from capture.vllm.worker.graph_capture import GraphSharding, dp_block, graph_refusal, graph_sharding
from capture.worker.graph_recorder import GraphStepRecorder
from capture.worker.recorder import StepRecorder
from replay_format import Flag, RunShape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, K, E, PADDED = 4, 4, 64, 16


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dynamo looks the traced code's module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: more threads only contend on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _compiled(model, rec: GraphStepRecorder, backend: str, skip: int = -1):
    """`model`'s step with the recorder's write inside, compiled whole; returns (step, graphs compiled)."""
    graphs: list = []
    inner = torch._dynamo.lookup_backend(backend) if backend != "fx" else None

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward if inner is None else inner(gm, example_inputs)

    def step(x, invalid):
        return model(x, invalid, rec.write, skip)

    return torch.compile(step, fullgraph=True, dynamic=False, backend=counting), graphs


def _inputs(rng, n: int, bad_real: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A padded batch: n real rows, then padding whose ids are made invalid (they must never be read)."""
    x = torch.from_numpy(rng.standard_normal((PADDED, gpu_check.HIDDEN)).astype(np.float32))
    bad = np.zeros(PADDED, np.bool_)
    bad[list(bad_real)] = True
    bad[n:] = True
    return x, torch.from_numpy(bad), bad[:n]


def test_callback_compiles_whole_with_no_graph_break():
    torch._dynamo.reset()
    model = gpu_check.ToyRouter(L, E, K)
    rec = GraphStepRecorder(RunShape(L, K, E), max_tokens=64)
    x, invalid, _ = _inputs(np.random.default_rng(0), PADDED)

    def step(x, invalid):
        return model(x, invalid, rec.write)

    with torch.no_grad():
        explained = torch._dynamo.explain(step)(x, invalid)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    # The writes are in the graph (two buffer writes per layer), not left to Python around it.
    writes = [node.args[0].name for node in explained.graphs[0].graph.nodes if node.target is operator.setitem]
    assert writes == ["l_rec_ids", "l_rec_stamps"] * L, explained.graphs[0].code


@pytest.mark.parametrize("backend", ["fx", "aot_eager"])
def test_same_compiled_step_replayed_records_every_real_row_and_stamp(backend):
    """One compilation, many steps: new inputs, 1..PADDED real rows, invalid rows; equal to an eager reference."""
    torch._dynamo.reset()
    model = gpu_check.ToyRouter(L, E, K, seed=1)
    rec = GraphStepRecorder(RunShape(L, K, E), max_tokens=64)
    step, graphs = _compiled(model, rec, backend)
    rng = np.random.default_rng(1)
    for n, bad_real in ((PADDED, ()), (5, (2,)), (1, ()), (11, (0, 10)), (PADDED, (PADDED - 1,)), (3, ())):
        x, invalid, bad = _inputs(rng, n, bad_real)
        stamp = rec.begin_step()
        with torch.no_grad():
            step(x, invalid)
        rec.start_close(n)
        experts = np.zeros((n, L, K), np.uint8)
        flags = rec.end_step_into(experts)
        ref = gpu_check.reference(model, x)[:n]
        want_flags = np.where(bad, int(Flag.STALE), 0).astype(np.uint16)
        if bad.any():
            assert flags is not None and np.array_equal(flags, want_flags)
        else:
            assert flags is None  # every real row clean although every padded row held invalid ids
        assert np.array_equal(experts[~bad], ref[~bad])
        assert (experts[bad] == 255).all()  # the sentinel, never a cast of -1
        stamps = rec._host_stamps[:n].numpy()
        assert (stamps[~bad] == stamp).all() and (stamps[bad] == -stamp).all()
    assert len(graphs) == 1  # the same compiled step every time: no recompilation for a new real count


def test_a_layer_that_did_not_run_reads_stale():
    torch._dynamo.reset()
    model = gpu_check.ToyRouter(L, E, K, seed=2)
    rec = GraphStepRecorder(RunShape(L, K, E), max_tokens=64)
    full, _ = _compiled(model, rec, "fx")
    partial, _ = _compiled(model, rec, "fx", skip=2)
    rng = np.random.default_rng(2)
    with torch.no_grad():
        for run, n in ((full, 9), (partial, 7), (full, 4)):
            x, invalid, _bad = _inputs(rng, n)
            rec.begin_step()
            run(x, invalid)
            out = rec.end_step([""] * n, np.arange(n))  # the close starts here when start_close was not called
            ref = gpu_check.reference(model, x, skip=2 if run is partial else -1)[:n]
            if run is partial:  # layer 2's rows are the full step's before it: stamped then, STALE now
                assert out.stale_rows == n and (out.flags == Flag.STALE).all() and out.invalid_rows == 0
                assert np.array_equal(out.experts[:, [0, 1, 3]], ref[:, [0, 1, 3]])
            else:
                assert out.stale_rows == 0 and np.array_equal(out.experts, ref)


def test_rows_and_flags_equal_the_eager_recorder():
    """The frame/sink path is unchanged: what the graph recorder closes equals what StepRecorder closes."""
    shape = RunShape(L, K, 300)  # uint16 ids
    graph, eager = GraphStepRecorder(shape, max_tokens=32), StepRecorder(shape, max_tokens=32)
    rng = np.random.default_rng(3)
    for n, layers in ((12, range(L)), (5, (0, 1, 3)), (8, range(L))):
        graph.begin_step(), eager.begin_step()
        for layer in layers:
            rows = torch.from_numpy(rng.integers(0, 300, (PADDED, K)).astype(np.int32))
            if n == 8 and layer == 1:
                rows[3, 0] = 300  # out of range: sentinel + STALE in both
            graph.write(layer, rows)  # the padded rows, as a graph writes them
            eager.record(layer, rows[:n])  # the real rows, as the eager path slices them
        got, want = np.zeros((n, L, K), np.uint16), np.zeros((n, L, K), np.uint16)
        got_flags, want_flags = graph.end_step_into(got), eager.end_step_into(want)
        assert (got_flags is None) == (want_flags is None)
        assert got_flags is None or np.array_equal(got_flags, np.asarray(want_flags))
        layers_written = list(layers)
        assert np.array_equal(got[:, layers_written], want[:, layers_written])


def test_dp_concatenated_rows_restore_with_fixed_shapes():
    """Naive DP dispatch under CUDA graphs: every DP rank padded alike, so this rank's slice is fixed."""
    torch._dynamo.reset()
    rec = GraphStepRecorder(RunShape(1, K, E), max_tokens=64)
    rng = np.random.default_rng(4)
    cases = (
        (Parallel(dp_size=3, dp_rank=1), (8, 8, 8)),  # DP concatenation, uniform padding
        (Parallel(dp_size=2, dp_rank=1, tp_size=2, tp_rank=0), (3, 3, 3, 3)),  # SP pieces, DP-major
    )
    for par, sizes in cases:
        def write(topk, par=par, sizes=sizes):
            rec.write(0, dp_block(topk, sizes, par))

        compiled = torch.compile(write, fullgraph=True, dynamic=False, backend="eager")
        per_dp = len(sizes) // par.dp_size
        start = sum(sizes[: par.dp_rank * per_dp])
        mine = sum(sizes[par.dp_rank * per_dp : (par.dp_rank + 1) * per_dp])
        for n in (mine, 2):
            topk = torch.from_numpy(rng.integers(0, E, (sum(sizes), K)).astype(np.int32))
            rec.begin_step()
            compiled(topk)
            out = rec.end_step([""] * n, np.arange(n))
            assert out.stale_rows == 0 and np.array_equal(out.experts[:, 0], topk[start : start + n].numpy())


def _runner(naive=False, sp=False, a2a=False, pcp=1):
    """The MoE config flags `graph_sharding` reads (vLLM's MoERunner.moe_config / do_naive_dispatch_combine)."""
    cfg = SimpleNamespace(is_sequence_parallel=sp, pcp_size=pcp,
                          moe_parallel_config=SimpleNamespace(use_all2all_kernels=a2a))
    return SimpleNamespace(moe_config=cfg, do_naive_dispatch_combine=naive)


def test_shardings_covered_and_the_refusal_names_the_flag():
    assert graph_sharding(_runner()) == GraphSharding.LOCAL
    assert graph_sharding(_runner(a2a=True)) == GraphSharding.LOCAL  # modular all2all: the router sees its own rows
    assert graph_sharding(_runner(naive=True)) == GraphSharding.DP_CONCAT
    assert graph_sharding(_runner(naive=True, sp=True)) == GraphSharding.DP_CONCAT
    assert graph_sharding(_runner(sp=True, a2a=True)) == GraphSharding.TP_GATHER
    assert graph_sharding(_runner(pcp=2)) == GraphSharding.PCP
    assert graph_refusal({"l0": GraphSharding.LOCAL, "l1": GraphSharding.DP_CONCAT}, "FULL") is None
    refusal = graph_refusal({"l0": GraphSharding.LOCAL, "model.layers.1.mlp": GraphSharding.PCP}, "PIECEWISE")
    assert refusal is not None and "--enforce-eager" in refusal and "pcp" in refusal and "model.layers.1" in refusal


def test_capture_mode_from_env():
    env = {"ROUTING_REPLAY_URL": "http://x", "ROUTING_REPLAY_RUN_ID": "r"}
    modes = [getattr(PluginConfig.from_env({**env, **extra}), "capture_mode", None)
             for extra in ({}, {"ROUTING_REPLAY_CAPTURE_MODE": "graph_safe"}, {"ROUTING_REPLAY_CAPTURE_MODE": "Eager"})]
    assert modes == [CaptureMode.AUTO, CaptureMode.GRAPH_SAFE, CaptureMode.EAGER]
    with pytest.raises(PluginConfigError, match="auto, eager, graph_safe"):
        PluginConfig.from_env({**env, "ROUTING_REPLAY_CAPTURE_MODE": "graphs"})
    assert CaptureMode.AUTO.resolve("cuda") == CaptureMode.GRAPH_SAFE
    assert CaptureMode.AUTO.resolve("cpu") == CaptureMode.EAGER
    assert CaptureMode.GRAPH_SAFE.resolve("cpu") == CaptureMode.GRAPH_SAFE


@pytest.mark.slow  # imports vLLM
def test_cuda_graphs_are_refused_only_for_eager_capture():
    from vllm.config import CUDAGraphMode

    from capture.vllm.worker.startup_checks import StartupError, check_config

    graphs = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
                             parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    check_config(graphs, CaptureMode.AUTO)  # AUTO: graph-safe on a GPU
    with pytest.raises(StartupError, match="CUDA graphs are on.*--enforce-eager"):
        check_config(graphs, CaptureMode.EAGER)

    # The recorder each mode and sharding gets (chosen in startup, after the routers are bound).
    from capture.vllm.worker.binder import BoundLayer
    from capture.vllm.worker.recorder_choice import choose_recorder
    from capture.worker.recorder import StepRecorder as Eager

    def started(mode: CaptureMode, vcfg, *runners):
        bound = [BoundLayer(i, r, None) for i, r in enumerate(runners)]
        return choose_recorder(mode, vcfg, torch.device("cpu"), bound, {i: i for i in range(len(runners))},
                               RunShape(len(runners), K, E), 64, Parallel())

    no_graphs = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE))
    wc = started(CaptureMode.GRAPH_SAFE, graphs, _runner(), _runner(naive=True))
    assert wc.mode == CaptureMode.GRAPH_SAFE and isinstance(wc.recorder, GraphStepRecorder)
    assert wc.graph is not None and wc.graph.shardings == {0: GraphSharding.LOCAL, 1: GraphSharding.DP_CONCAT}
    with pytest.raises(StartupError, match="pcp.*--enforce-eager"):
        started(CaptureMode.GRAPH_SAFE, graphs, _runner(), _runner(pcp=2))
    wc = started(CaptureMode.GRAPH_SAFE, no_graphs, _runner(sp=True, a2a=True))  # eager engine: the eager path
    assert wc.mode == CaptureMode.EAGER and isinstance(wc.recorder, Eager) and wc.graph is None
    assert isinstance(started(CaptureMode.AUTO, no_graphs, _runner()).recorder, Eager)  # CPU default: eager
    with pytest.raises(StartupError, match="--enforce-eager"):  # AUTO on a non-CUDA device with graphs on
        started(CaptureMode.AUTO, graphs, _runner())


def test_device_check_runs_its_cpu_checks_and_fails_a_broken_write(monkeypatch, capsys):
    assert gpu_check.main(["--device", "cpu", "--steps", "14", "--padded", "8,32"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("gpu_check: PASS")
    write = GraphStepRecorder.write

    def loses_a_layer(self, layer_idx, rows):  # a write that misses layer 1: every row must read STALE
        if layer_idx != 1:
            write(self, layer_idx, rows)

    monkeypatch.setattr(GraphStepRecorder, "write", loses_a_layer)
    assert gpu_check.check(64, torch.device("cpu"), 6, (8,))  # failures reported


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_device_check_needs_only_torch_and_numpy():
    """The lent machines have PyTorch but no pyarrow/vLLM: the script must run with them unimportable."""
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['vllm'] = None; "
            "sys.argv = ['gpu_check.py', '--device', 'cpu', '--steps', '6', '--padded', '8']; "
            "import runpy; runpy.run_path('scripts/gpu_check.py', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_check: PASS" in done.stdout


@pytest.mark.slow
def test_vllm_cpu_engine_in_graph_safe_mode_records_transformers_routing(model_dir, shared_service, tmp_path,
                                                                         monkeypatch):
    """A real vllm-cpu engine with ROUTING_REPLAY_CAPTURE_MODE=graph_safe: every stored row equals transformers'
    routing of the same tokens, unflagged (test_vllm_e2e.py checks the eager mode against the same reference; one
    engine here, not two, keeps the suite's time)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (rpc_cost)
    from capture.vllm.worker.runner import rpc_cost
    from replay_client.client import ReplayClient
    from tests.support.vllm_model import prompts
    from tests.test_vllm_e2e import check_against_reference, generate, start_engine, stop_engine, wait_finished

    run_id = "graph-e2e-graph-safe"
    env = {"ROUTING_REPLAY_URL": shared_service.url, "ROUTING_REPLAY_RUN_ID": run_id,
           "ROUTING_REPLAY_SPILL_DIR": str(tmp_path / "spill"), "VLLM_CPU_KVCACHE_SPACE": "1",
           "ROUTING_REPLAY_CAPTURE_MODE": "graph_safe", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    llm = start_engine(model_dir, 1, env, enable_prefix_caching=False)
    try:
        seqs = generate(llm, prompts())
        assert [c["mode"] for c in llm.collective_rpc(rpc_cost)] == ["graph_safe"]
    finally:
        stop_engine(llm)
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, run_id, seqs)
        check_against_reference(client, run_id, model_dir, seqs, summaries)  # rows, positions, tokens, no flags
