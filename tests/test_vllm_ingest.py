"""Engine-output ingestion through the client: vLLM `routed_experts` arrays and SGLang base64 payloads."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from replay_service.client import ReplayClient
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
            assert c.request("vllm-out", rid)["status"] == "finished"


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
