"""Rollout-vs-training agreement on constructed routes with known mismatch, stored and read back."""

from __future__ import annotations

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_client.trainer import compare_body
from replay_format import RunShape
from tests.support.data import QWEN3_SHAPE, store_requests

L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts
LENGTHS = {"c-a": 401, "c-b": 201}  # 400 and 200 rows


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "cmp", LENGTHS, seed=21, flagged={"c-b": [50]})
    return client, full


def _swap_one(row: np.ndarray) -> None:
    """Replace one id of a top-k set by an expert not in it (Jaccard 7/9 for K=8)."""
    unused = np.setdiff1d(np.arange(E), row)
    row[3] = unused[0]


def test_a_route_against_itself_agrees_fully(stored):
    client, full = stored
    ids = ["c-a"] * 400
    # a permuted top-k order is the same set
    result = client.compare("cmp", ids, np.arange(400), full["c-a"][:, :, ::-1], label="self")
    assert result["router_mismatch"] == 0 and result["token_mismatch"] == 0 and result["jaccard"] == 1.0
    assert result["tokens"] == 400 and result["missing_rows"] == 0 and result["label"] == "self"
    assert result["worst_layers"] == [] and result["worst_tokens"] == []


def test_one_layer_of_every_tenth_token_gives_the_exact_figures(stored):
    client, full = stored
    trainer = full["c-a"].copy()
    layer_of = {}
    for t in range(0, 400, 10):
        layer = (t // 10) % L
        _swap_one(trainer[t, layer])
        layer_of[t] = layer
    _swap_one(trainer[120, 9])  # token 120: layer 12 (as planned) and layer 9 differ
    result = client.compare("cmp", ["c-a"] * 400, np.arange(400), trainer, label="tenth")
    differing = 40 + 1  # 40 tokens x 1 layer, plus a second layer on token 120
    assert result["router_mismatch"] == pytest.approx(differing / (400 * L), abs=1e-15)
    assert result["token_mismatch"] == pytest.approx(40 / 400, abs=1e-15)
    assert result["jaccard"] == pytest.approx(1 - differing * (1 - 7 / 9) / (400 * L), abs=1e-12)
    per_layer = {p["layer"]: p for p in result["per_layer"]}
    assert len(per_layer) == L and per_layer[0]["model_layer"] == 0
    counts = np.zeros(L)
    for layer in layer_of.values():
        counts[layer] += 1
    counts[9] += 1
    for layer in range(L):
        assert per_layer[layer]["router_mismatch"] == pytest.approx(counts[layer] / 400, abs=1e-15)
    assert result["worst_layers"][0] == 9 and len(result["worst_layers"]) == 10
    worst = result["worst_tokens"]
    assert worst[0] == {"request_id": "c-a", "position": 120, "layers_differing": 2,
                        "jaccard": pytest.approx(1 - 2 * (2 / 9) / L)}
    assert len(worst) == 20 and all(w["layers_differing"] == 1 for w in worst[1:])

    # stored: listed newest first, readable by id, per-position bits for the web view
    listed = client.compares("cmp")
    assert listed[0]["compare_id"] == result["compare_id"] and listed[1]["label"] == "self"
    assert client.compare_result("cmp", result["compare_id"]) == result
    detail = client.compare_request("cmp", result["compare_id"], "c-a", start=118, end=122)
    assert detail["positions"] == [118, 119, 120, 121] and detail["num_moe_layers"] == L
    row = [0] * L
    row[12] = row[9] = 1
    assert detail["mismatch"] == [[0] * L, [0] * L, row, [0] * L]


def test_rows_without_a_clean_recording_are_counted_and_left_out(stored):
    client, full = stored
    extra = np.concatenate([full["c-b"], full["c-b"][:1]])  # position 200: the last token, never recorded
    result = client.compare("cmp", ["c-b"] * 201, np.arange(201), extra)
    # position 50 was recorded as a ZERO row (flagged): not comparable either
    assert result["missing_rows"] == 2 and result["tokens"] == 199 and result["router_mismatch"] == 0


def test_bad_compare_bodies_are_named(stored, shared_service):
    client, full = stored
    http = client.http
    arrow = {"content-type": "application/vnd.apache.arrow.stream"}
    r = http.post("/v1/runs/cmp/compare", content=b"not arrow", headers=arrow)
    assert r.status_code == 400 and "Arrow" in r.json()["detail"]
    other = RunShape(num_moe_layers=4, top_k=8, num_experts=128)
    body = compare_body("cmp", other, ["c-a"], [0], np.zeros((1, 4, 8), np.uint8) + np.arange(8, dtype=np.uint8))
    r = http.post("/v1/runs/cmp/compare", content=body, headers=arrow)
    assert r.status_code == 409 and "4 layers" in r.json()["detail"]
    body = compare_body("cmp", QWEN3_SHAPE, ["c-a", "c-a"], [3, 3], full["c-a"][:2])
    r = http.post("/v1/runs/cmp/compare", content=body, headers=arrow)
    assert r.status_code == 422 and "position 3 appears twice" in r.json()["detail"]
    r = http.post("/v1/runs/nope/compare", content=body, headers=arrow)
    assert r.status_code == 404
    assert http.get("/v1/runs/cmp/compares/nope").status_code == 404
    assert "not found" in http.get("/v1/runs/cmp/compares/nope/requests/c-a").json()["detail"]


def test_demo_run_carries_a_comparison(tmp_path):
    from tests.support.service import ServiceProcess

    with ServiceProcess(tmp_path / "demo", demo=True, env={"REPLAY_FSYNC": "false"}) as proc:
        client = ReplayClient(proc.url)
        compares = client.compares("demo")
        assert len(compares) == 1 and compares[0]["compare_id"] == "demo-r3"
        c = compares[0]
        assert 0.03 < c["router_mismatch"] < 0.15 and c["token_mismatch"] > 0.9 and c["worst_layers"]
        w = c["worst_tokens"][0]
        detail = client.compare_request("demo", "demo-r3", w["request_id"], start=w["position"], end=w["position"] + 1)
        assert sum(detail["mismatch"][0]) == w["layers_differing"]
