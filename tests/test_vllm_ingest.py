"""Engine-output ingestion through the client: vLLM `routed_experts` arrays and SGLang base64 payloads.

Also the plugin's side of the model-layer axis: the run's `num_hidden_layers` comes from vLLM's own
`ModelConfig.get_total_num_hidden_layers()` (what sizes vLLM's `routed_experts`), read from a real
vLLM config of a Qwen3-MoE with dense layers.
"""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from replay_client.client import ReplayClient
from tests.support.service import ServiceProcess


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("ingest") / "data") as proc:
        yield proc


def _route(rng, n, layers, k, e):
    # distinct ids per (row, layer), as a router's top-k
    return np.argsort(rng.random((n, layers, e)), axis=-1)[..., :k].astype(np.int32)


def test_vllm_routed_experts_land_equal(svc):
    rng = np.random.default_rng(0)
    with ReplayClient(svc.url) as c:
        for rid, n in (("a", 5), ("b", 40), ("c", 1)):
            moe = _route(rng, n, 3, 2, 16)
            full = np.zeros((n, 4, 2), np.int32)  # vLLM carries every model layer; layer 0 dense (zeros)
            full[:, 1:] = moe
            c.upload_vllm_output("vllm-out", rid, full, num_experts=16, moe_layers=[1, 2, 3])
            route = c.get_route("vllm-out", rid, strict=True)
            assert route.positions.tolist() == list(range(n))
            np.testing.assert_array_equal(route.experts, moe)
            assert route.experts.dtype == np.uint8 and not route.flags.any()
            assert c.request("vllm-out", rid).status == "finished"
            np.testing.assert_array_equal(c.get_route("vllm-out", rid, layer_axis="model").experts, full)


def test_sglang_base64_lands_equal(svc):
    rng = np.random.default_rng(1)
    with ReplayClient(svc.url) as c:
        for rid, n in (("s1", 7), ("s2", 33)):
            ids = _route(rng, n, 2, 4, 300)  # > 256 experts: stored uint16
            b64 = base64.b64encode(ids.astype(np.int32).tobytes()).decode()
            tokens = rng.integers(0, 1000, n + 1).tolist()
            c.upload_sglang_output("sgl-out", rid, b64, num_layers=2, top_k=4, num_experts=300, token_ids=tokens)
            route = c.get_route("sgl-out", rid, strict=True)
            np.testing.assert_array_equal(route.experts, ids)
            assert route.experts.dtype == np.uint16
            assert route.token_ids.tolist() == tokens[:n]


def test_vllm_turns_from_routed_experts_prompt_start_land_at_their_positions(svc):
    """Turn 2 of a conversation: vLLM returns rows from `routed_experts_prompt_start` = turn 1's T - 1."""
    rng = np.random.default_rng(2)
    full = np.zeros((30, 4, 2), np.int32)
    full[:, 1:] = _route(rng, 30, 3, 2, 16)
    with ReplayClient(svc.url) as c:
        c.upload_vllm_output("vllm-turns", "chat", full[:19], num_experts=16, moe_layers=[1, 2, 3])  # T1 = 20
        c.upload_vllm_output("vllm-turns", "chat", full[19:], start=19)  # T2 = 31
        assert c.request("vllm-turns", "chat").num_tokens == 31
        np.testing.assert_array_equal(c.get_route("vllm-turns", "chat", strict=True, layer_axis="model").experts, full)


def _qwen3_moe_config(path: str, num_layers: int, dense: list[int]) -> str:
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_experts=8, num_experts_per_tok=2, mlp_only_layers=dense,
                   max_position_embeddings=256).save_pretrained(path)
    return path


def test_the_plugin_takes_the_model_layer_count_from_vllm(tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    from capture.vllm.worker.startup_checks import model_num_hidden_layers

    # Layers 0 and 3 dense (Qwen3-MoE `mlp_only_layers`): MoE layers (1, 2) of a 4-layer model, whose
    # routed_experts vLLM returns as (rows, 4, K); max(moe_layers) + 1 would say 3.
    config = ModelConfig(model=_qwen3_moe_config(str(tmp_path), 4, [0, 3]), dtype="float32", skip_tokenizer_init=True)
    assert model_num_hidden_layers(SimpleNamespace(model_config=config), (1, 2)) == 4
    # Without vLLM's method, the HF text config's count; one that cannot hold the layer ids is not used.
    hf_only = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=6)))
    assert model_num_hidden_layers(hf_only, (1, 5)) == 6
    assert model_num_hidden_layers(hf_only, (1, 6)) == 0  # e.g. an MTP layer numbered past the decoder layers
    assert model_num_hidden_layers(None, (0, 1)) == 0


def test_vllm_answers_built_by_vllms_own_classes_are_what_the_fast_tests_build(svc):
    """tests/test_vllm_responses.py restates vLLM's serving code; here vLLM's own protocol classes and
    `numpy2base64` build the same answers, which are equal to the restated ones and stored the same way."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.utils.serial_utils import numpy2base64

    from tests.test_vllm_responses import SHAPE, capture, chat_response, completion_response

    rng = np.random.default_rng(9)
    prompt, outs = rng.integers(3, 500, 12).tolist(), [rng.integers(3, 500, 6).tolist() for _ in range(2)]
    arrays = [capture(SHAPE, rng, prompt, o) for o in outs]
    usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=12, total_tokens=len(prompt) + 12)
    theirs = CompletionResponse(id="cmpl-own", created=0, model="m", usage=usage, choices=[
        CompletionResponseChoice(index=i, text="...", finish_reason="length", prompt_token_ids=prompt, token_ids=o,
                                 routed_experts=numpy2base64(a)) for i, (o, a) in enumerate(zip(outs, arrays))])
    ours = completion_response("own", [prompt], [outs], [arrays], True)
    fields = ("index", "prompt_token_ids", "token_ids", "routed_experts")
    dumped = theirs.model_dump(mode="json")
    assert [{k: c[k] for k in fields} for c in dumped["choices"]] == [{k: c[k] for k in fields}
                                                                       for c in ours["choices"]]
    assert {k: dumped["usage"][k] for k in ours["usage"]} == ours["usage"]
    chat = ChatCompletionResponse(id="chatcmpl-own", created=0, model="m", usage=usage, prompt_token_ids=prompt,
                                  choices=[ChatCompletionResponseChoice(
                                      index=i, message=ChatMessage(role="assistant", content="..."),
                                      finish_reason="length", token_ids=o, routed_experts=numpy2base64(a))
                                      for i, (o, a) in enumerate(zip(outs, arrays))])
    mine = chat_response("own", prompt, outs, arrays, True)
    assert [c["routed_experts"] for c in chat.model_dump(mode="json")["choices"]] == [
        c["routed_experts"] for c in mine["choices"]]
    with ReplayClient(svc.url) as c:
        c.upload_vllm_response("vllm-own", dumped, n=2, num_experts=SHAPE.num_experts, moe_layers=SHAPE.moe_layers)
        c.upload_vllm_response("vllm-own", chat.model_dump(mode="json"))
        for i, arr in enumerate(arrays):
            for rid in (f"{i}_cmpl-own-0", f"{i}_chatcmpl-own"):
                route = c.get_route("vllm-own", rid, strict=True, layer_axis="model")
                assert np.array_equal(route.experts, arr) and route.token_ids.tolist() == (prompt + outs[i])[:-1]
