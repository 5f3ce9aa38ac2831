"""Agreement as a series: a simulated training run of 50 steps, each posting a comparison (with its step and the
weight version it was made against) whose trainer routing drifts further from the recorded one; the run answers
them in step order with the figures each post answered, also when posted out of order; the health report's
agreement is the newest comparison's, and ROUTER_MISMATCH warns once the drift passes its default 5%.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_client.health import RoutingUnhealthy, Verdict
from tests.support.data import QWEN3_SHAPE, store_requests

L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts
ROWS = 100
STEPS = 50
CELLS_PER_STEP = 10  # (token, layer) cells that differ grow by this much each step: 490 of 4800 at step 49


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def drifted(recorded: np.ndarray, step: int) -> np.ndarray:
    """The trainer's top-k at `step`: the recorded one with `CELLS_PER_STEP * step` (token, layer) cells changed
    (one id of each replaced by an expert not in its set), token by token, then layer by layer."""
    trainer = recorded.copy()
    for cell in range(CELLS_PER_STEP * step):
        token, layer = cell % ROWS, cell // ROWS
        row = trainer[token, layer]
        row[0] = np.setdiff1d(np.arange(E), row)[0]
    return trainer


def expected_figures(step: int) -> tuple[float, float]:
    """(router_mismatch, token_mismatch) of `drifted(step)`."""
    cells = CELLS_PER_STEP * step
    return cells / (ROWS * L), min(cells, ROWS) / ROWS


def post(client: ReplayClient, run: str, recorded: np.ndarray, step: int) -> dict:
    return client.compare(run, ["t-0"] * ROWS, np.arange(ROWS), drifted(recorded, step), label=f"step-{step}",
                          step=step, weight_version=str(step // 10))


def as_point(answer: dict) -> dict:
    """What the series must say of a comparison, from the POST's answer."""
    per_layer = {p["layer"]: p for p in answer["per_layer"]}
    worst = [{"layer": o, "model_layer": per_layer[o]["model_layer"],
              "router_mismatch": per_layer[o]["router_mismatch"]} for o in answer["worst_layers"][:3]]
    return {"step": answer["step"], "weight_version": answer["weight_version"], "compare_id": answer["compare_id"],
            "created_at": answer["created_at"], "label": answer["label"], "tokens": answer["tokens"],
            "router_mismatch": answer["router_mismatch"], "token_mismatch": answer["token_mismatch"],
            "jaccard": answer["jaccard"], "worst_layers": worst}


@pytest.fixture(scope="module")
def training_run(client):
    recorded = store_requests(client, "series", {"t-0": ROWS + 1}, seed=2431)["t-0"]
    answers = [post(client, "series", recorded, step) for step in range(STEPS)]
    return recorded, answers


def test_the_posts_carry_step_and_weight_version_and_drift_grows(training_run):
    _, answers = training_run
    for step, answer in enumerate(answers):
        router, token = expected_figures(step)
        assert answer["step"] == step and answer["weight_version"] == str(step // 10)
        assert answer["router_mismatch"] == pytest.approx(router, abs=1e-15)
        assert answer["token_mismatch"] == pytest.approx(token, abs=1e-15)
        assert answer["tokens"] == ROWS and answer["missing_rows"] == 0
    mismatch = [a["router_mismatch"] for a in answers]
    assert mismatch == sorted(mismatch) and mismatch[0] == 0 and mismatch[-1] > 0.05


def test_the_series_comes_back_in_step_order_with_the_posted_figures(client, training_run):
    _, answers = training_run
    points = client.agreement_series("series")
    assert [p["step"] for p in points] == list(range(STEPS))
    assert points == [as_point(a) for a in answers]
    raw = client.http.get("/v1/runs/series/agreement").json()
    assert raw["run_id"] == "series" and raw["points"] == points
    # a stored comparison keeps its step and version too
    assert client.compare_result("series", answers[17]["compare_id"]) == answers[17]


def test_posted_out_of_order_the_series_is_still_in_step_order(client):
    recorded = store_requests(client, "series-shuffled", {"t-0": ROWS + 1}, seed=2432)["t-0"]
    order = np.random.default_rng(3).permutation(STEPS).tolist()
    answers = {step: post(client, "series-shuffled", recorded, step) for step in order}
    # comparisons without a step are not points; the same step posted again is a second point, after the first
    client.compare("series-shuffled", ["t-0"] * ROWS, np.arange(ROWS), recorded, label="no step")
    again = post(client, "series-shuffled", recorded, 7)
    points = client.agreement_series("series-shuffled")
    assert [p["step"] for p in points] == [*range(8), 7, *range(8, STEPS)]
    assert points == [as_point(answers[s]) for s in range(8)] + [as_point(again)] + \
        [as_point(answers[s]) for s in range(8, STEPS)]
    assert len(client.compares("series-shuffled")) == STEPS + 2  # every comparison is still stored
    # the report judges the comparison of the highest step, not the last one posted
    agreement = client.run_health("series-shuffled").agreement
    assert agreement is not None and agreement.compare_id == answers[STEPS - 1]["compare_id"]


def test_the_health_report_carries_the_newest_comparison(client, training_run):
    _, answers = training_run
    newest = answers[-1]
    report = client.run_health("series")
    assert report.agreement is not None
    assert report.agreement.compare_id == newest["compare_id"] and report.agreement.step == STEPS - 1
    assert report.agreement.weight_version == str((STEPS - 1) // 10)
    assert report.agreement.router_mismatch == newest["router_mismatch"]
    assert report.agreement.token_mismatch == newest["token_mismatch"]
    assert report.agreement.jaccard == newest["jaccard"]
    assert list(report.agreement.worst_layers) == newest["worst_layers"][: len(report.agreement.worst_layers)]
    # 490 of 4800 cells differ: over ROUTER_MISMATCH's default warn limit of 0.05 (miles' gate), and no fail limit
    assert report.verdict is Verdict.WARN and report.failed == ()
    finding = report.finding("ROUTER_MISMATCH")
    assert finding is not None and finding.level is Verdict.WARN and finding.compare_id == newest["compare_id"]
    assert finding.value == newest["router_mismatch"] and finding.limit == 0.05 and finding.requests == ()
    metrics = client.check_batch("series", ["t-0"])  # a warning passes the default gate
    assert metrics["r3/router_mismatch"] == newest["router_mismatch"] and metrics["r3/verdict"] == 1
    assert metrics["r3/token_mismatch"] == newest["token_mismatch"] and metrics["r3/jaccard"] == newest["jaccard"]
    # miles' gate: stop the run once the drift passes 5%
    with pytest.raises(RoutingUnhealthy) as drift:
        client.check_batch("series", ["t-0"], fail_on="warn")
    assert drift.value.checks == ["ROUTER_MISMATCH"]
    worst = ", ".join(f"model layer {layer['model_layer']} at {layer['router_mismatch']:.1%}"
                      for layer in (newest["per_layer"][i] for i in newest["worst_layers"][:3]))
    assert str(drift.value) == ("run 'series' batch warns on routing health: ROUTER_MISMATCH 0.1021 (limit 0.05) in "
                                f"comparison {newest['compare_id']!r}: {worst}")
