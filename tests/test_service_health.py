"""Run health through a real server: a clean run and batch answer `ok`; runs with one planted fault kind each
answer `fail` naming exactly that check (with FALLBACK: a flagged or missing row is one a trainer slice fills),
its requests and their first positions; a training batch naming an open request and one the run does not hold
fails OPEN and MISSING; per-run thresholds change the verdict and DELETE restores it; the client's gate raises
on a faulty batch and hands back the flat metrics of a clean one; `window_s` leaves out older requests.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from replay_client import ReplayClient, ReplayError
from replay_client.health import CHECKS, HealthReport, RoutingUnhealthy, Verdict
from replay_format import Flag
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes

L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts
N = 100  # rows of most requests (finished with N + 1 tokens)
MINUS_ONE = 255  # -1 written into a uint8 id column

# The metric names of a batch report (docs/health.md); every one present when the batch has versioned rows and
# the run has a comparison.
BATCH_METRICS = {
    "r3/verdict", "r3/requests", "r3/rows_expected", "r3/flagged_frac", "r3/zero_frac", "r3/stale_frac",
    "r3/out_of_range_frac", "r3/duplicate_frac", "r3/conflict_frac", "r3/gap_frac", "r3/fallback_frac",
    "r3/unresolved_refs", "r3/open_requests", "r3/missing_requests", "r3/recomputed_frac", "r3/version_stale_frac",
    "r3/version_max_lag", "r3/router_mismatch", "r3/token_mismatch", "r3/jaccard",
}


@pytest.fixture(scope="module")
def client(shared_service):
    # the session's service, on the backends the contract suite chooses (tests/test_contract_scaleout.py runs this
    # module on PostgreSQL+S3); the runs here are this module's own (h-...)
    with ReplayClient(shared_service.url) as c:
        yield c


def _ingest(client: ReplayClient, run: str, parts: list[tuple[str, np.ndarray, np.ndarray]], seq: int = 0,
            flags: dict[str, np.ndarray] | None = None) -> None:
    """One raw row batch of `run`: (request, positions, experts) parts, random token ids, writer flags by request."""
    rng = np.random.default_rng(seq + 24000)
    ids = [rid for rid, pos, _ in parts for _ in range(len(pos))]
    fl = np.concatenate([(flags or {}).get(rid, np.zeros(len(pos), np.uint16)) for rid, pos, _ in parts])
    answer = client.ingest(batch_bytes(run, "w", seq, ids, np.concatenate([p for _, p, _ in parts]),
                                       np.concatenate([x for _, _, x in parts]),
                                       token_ids=rng.integers(0, 150000, len(ids)), flags=fl))
    assert answer.stored


def _whole(rid: str, rows: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    return rid, np.arange(len(rows)), rows


@pytest.fixture(scope="module")
def planted(client):
    rng = np.random.default_rng(2424)  # (the STALE table spans runs: rows of a seed another module uses are copies)

    # clean: engine-output uploads with weight versions ("6" then "7"), and a comparison that agrees fully
    clean = {f"c-{i}": routes(rng, N) for i in range(3)}
    for rid, version in zip(clean, ("6", "7", "7")):
        client.upload_route("h-clean", rid, clean[rid], num_experts=E, weight_version=version)
    compared = client.compare("h-clean", ["c-0"] * N, np.arange(N), clean["c-0"], step=0, weight_version="7")

    # a capture skipped for some steps: whole rows never written (all 0)
    zero = {rid: routes(rng, N) for rid in ("z-a", "z-b", "z-ok")}
    zero["z-a"][[17, 18, 40]] = 0
    zero["z-b"][5] = 0
    _ingest(client, "h-zero", [_whole(rid, r) for rid, r in zero.items()])

    # one MoE layer never written at some steps: its top-k all 0 (a repeated id)
    layer = {rid: routes(rng, N) for rid in ("l-a", "l-ok")}
    layer["l-a"][[30, 31], 7] = 0
    _ingest(client, "h-layer", [_whole(rid, r) for rid, r in layer.items()])

    # stale: a writer's "not written this step" stamp, and one row copied at three positions (SGLang #36404)
    stale = {rid: routes(rng, N) for rid in ("s-src", "s-copy", "s-writer")}
    stale["s-copy"][60:63] = stale["s-src"][5]
    stamp = np.zeros(N, np.uint16)
    stamp[70] = Flag.STALE
    _ingest(client, "h-stale", [_whole(rid, r) for rid, r in stale.items()], flags={"s-writer": stamp})

    # gaps: ten positions never sent, and a request finished with more tokens than rows sent
    hole, short, fine = routes(rng, 2 * N), routes(rng, 60), routes(rng, N)
    keep = np.r_[0:90, 100:2 * N]
    _ingest(client, "h-gap", [("g-hole", keep, hole[keep]), _whole("g-short", short), _whole("g-ok", fine)])

    # -1 padding sent as rows: a padded tail (miles pads with -1) and a whole request of -1 (NeMo-RL #3837)
    padded = np.concatenate([routes(rng, N), np.full((4, L, K), MINUS_ONE, np.uint8)])
    _ingest(client, "h-pad", [_whole("p-tail", padded), _whole("p-all", np.full((50, L, K), MINUS_ONE, np.uint8)),
                              _whole("p-ok", routes(rng, N))])

    # a training batch needing fallback: a request finished whole, one finished with ten rows never sent, one
    # still open, and (in the batch) one the run never held
    holed = routes(rng, N)
    kept = np.r_[0:50, 60:N]
    _ingest(client, "h-batch", [_whole("b-done", routes(rng, N)), ("b-hole", kept, holed[kept]),
                                _whole("b-open", routes(rng, 60))])

    ends = {"h-zero": dict.fromkeys(zero, N + 1), "h-layer": dict.fromkeys(layer, N + 1),
            "h-stale": dict.fromkeys(stale, N + 1), "h-gap": {"g-hole": 2 * N + 1, "g-short": N + 1, "g-ok": N + 1},
            "h-pad": {"p-tail": N + 5, "p-all": 51, "p-ok": N + 1}, "h-batch": {"b-done": N + 1, "b-hole": N + 1}}
    for run, lengths in ends.items():
        for rid, tokens in lengths.items():
            client.finish(run, rid, tokens)
    return {"compared": compared}


def at(request_id: str, first: int | None, count: int) -> dict:
    return {"request_id": request_id, "first_position": first, "count": count}


# run -> (requests, rows expected, {check: findings' requests}); FALLBACK names every flagged or missing row.
EXPECTED = {
    "h-zero": (("z-a", "z-b", "z-ok"), 3 * N, {
        "ZERO": [at("z-a", 17, 3), at("z-b", 5, 1)],
        "FALLBACK": [at("z-a", 17, 3), at("z-b", 5, 1)]}),
    "h-layer": (("l-a", "l-ok"), 2 * N, {
        "DUPLICATE": [at("l-a", 30, 2)],
        "FALLBACK": [at("l-a", 30, 2)]}),
    "h-stale": (("s-copy", "s-src", "s-writer"), 3 * N, {
        "STALE": [at("s-copy", 60, 3), at("s-writer", 70, 1)],
        "FALLBACK": [at("s-copy", 60, 3), at("s-writer", 70, 1)]}),
    "h-gap": (("g-hole", "g-ok", "g-short"), 4 * N, {
        "GAP": [at("g-hole", 90, 10), at("g-short", 60, 40)],
        "FALLBACK": [at("g-hole", 90, 10), at("g-short", 60, 40)]}),
    "h-pad": (("p-all", "p-ok", "p-tail"), 2 * N + 4 + 50, {
        "OUT_OF_RANGE": [at("p-all", 0, 50), at("p-tail", N, 4)],
        "FALLBACK": [at("p-all", 0, 50), at("p-tail", N, 4)]}),
}


def _health(client: ReplayClient, run: str, how: str, requests=None) -> dict:
    """The raw JSON answer: GET (the run) or POST (a batch of `requests`)."""
    if how == "GET":
        response = client.http.get(f"/v1/runs/{run}/health")
    else:
        response = client.http.post(f"/v1/runs/{run}/health", json={"requests": list(requests)})
    assert response.status_code == 200, response.text
    return response.json()


def _assert_checks_shape(doc: dict) -> None:
    assert set(doc["checks"]) == set(CHECKS)
    for name, check in doc["checks"].items():
        assert check["level"] in ("ok", "warn", "fail"), name
    levels = {c["level"] for c in doc["checks"].values()}
    assert doc["verdict"] == ("fail" if "fail" in levels else "warn" if "warn" in levels else "ok")
    assert [f["check"] for f in doc["failed"]] == [c for c in CHECKS if doc["checks"][c]["level"] == "fail"]
    assert [f["check"] for f in doc["warned"]] == [c for c in CHECKS if doc["checks"][c]["level"] == "warn"]


@pytest.mark.parametrize("how", ["GET", "POST"])
def test_a_clean_run_and_batch_answer_ok(client, planted, how):
    doc = _health(client, "h-clean", how, ["c-0", "c-1", "c-2"])
    _assert_checks_shape(doc)
    assert doc["verdict"] == "ok" and doc["failed"] == [] and doc["warned"] == []
    assert doc["scope"] == ("run" if how == "GET" else "batch") and doc["run_id"] == "h-clean"
    assert (doc["requests"], doc["requests_open"], doc["rows_expected"], doc["rows"]) == (3, 0, 3 * N, 3 * N)
    assert all(doc["checks"][c]["count"] == 0 for c in CHECKS if c not in ("STALENESS", "ROUTER_MISMATCH",
                                                                            "TOKEN_MISMATCH"))
    assert doc["weight_versions"]["rows"] == {"6": N, "7": 2 * N} and doc["weight_versions"]["unversioned"] == 0
    assert doc["agreement"]["compare_id"] == planted["compared"]["compare_id"]
    assert doc["agreement"]["router_mismatch"] == 0 and doc["agreement"]["step"] == 0
    assert doc["metrics"]["r3/verdict"] == 0 and doc["metrics"]["r3/fallback_frac"] == 0


@pytest.mark.parametrize("how", ["GET", "POST"])
@pytest.mark.parametrize("run", sorted(EXPECTED))
def test_a_planted_fault_fails_naming_its_check_requests_and_first_positions(client, planted, run, how):
    requests, expected_rows, findings = EXPECTED[run]
    doc = _health(client, run, how, requests)
    _assert_checks_shape(doc)
    assert doc["verdict"] == "fail" and doc["warned"] == []
    assert [f["check"] for f in doc["failed"]] == [c for c in CHECKS if c in findings]
    assert doc["requests"] == len(requests) and doc["rows_expected"] == expected_rows
    for finding in doc["failed"]:
        named = findings[finding["check"]]
        count = sum(r["count"] for r in named)
        assert finding["requests"] == named, finding["check"]
        assert finding["level"] == "fail" and finding["limit"] == 0.0
        assert finding["count"] == count and finding["value"] == pytest.approx(count / expected_rows)
        assert doc["checks"][finding["check"]]["count"] == count
    fallback = sum(r["count"] for r in findings["FALLBACK"])
    assert doc["rows"] == expected_rows - sum(r["count"] for r in findings.get("GAP", []))
    assert doc["metrics"]["r3/verdict"] == 2
    assert doc["metrics"]["r3/fallback_frac"] == pytest.approx(fallback / expected_rows)
    gap = sum(r["count"] for r in findings.get("GAP", []))  # fallback rows are the flagged ones and the gap
    assert doc["metrics"]["r3/flagged_frac"] == pytest.approx((fallback - gap) / expected_rows)
    for check, metric in (("ZERO", "r3/zero_frac"), ("STALE", "r3/stale_frac"), ("GAP", "r3/gap_frac"),
                          ("OUT_OF_RANGE", "r3/out_of_range_frac"), ("DUPLICATE", "r3/duplicate_frac")):
        want = sum(r["count"] for r in findings.get(check, [])) / expected_rows
        assert doc["metrics"][metric] == pytest.approx(want), metric


def test_a_clean_part_of_a_faulty_run_is_an_ok_batch(client, planted):
    for run, ids in (("h-zero", ["z-ok"]), ("h-stale", ["s-src"]), ("h-gap", ["g-ok"]), ("h-pad", ["p-ok"])):
        assert client.batch_health(run, ids).verdict is Verdict.OK, run


def test_a_batch_needing_fallback_fails_naming_gap_open_and_missing(client, planted):
    # the run: its GAP, and not its open request (OPEN is judged for a training batch only: a live run always has
    # requests being written)
    run = _health(client, "h-batch", "GET")
    assert [f["check"] for f in run["failed"]] == ["GAP", "FALLBACK"] and run["requests_open"] == 1
    assert run["checks"]["OPEN"]["level"] == "ok" and "r3/missing_requests" not in run["metrics"]

    doc = _health(client, "h-batch", "POST", ["b-done", "b-hole", "b-open", "b-none"])
    _assert_checks_shape(doc)
    assert doc["verdict"] == "fail" and doc["scope"] == "batch" and doc["warned"] == []
    failed = {f["check"]: f for f in doc["failed"]}
    assert list(failed) == ["GAP", "FALLBACK", "OPEN", "MISSING"]
    assert failed["GAP"]["requests"] == failed["FALLBACK"]["requests"] == [at("b-hole", 50, 10)]
    assert failed["OPEN"]["requests"] == [at("b-open", None, None)]
    assert failed["MISSING"]["requests"] == [at("b-none", None, None)]
    assert (failed["OPEN"]["count"], failed["MISSING"]["count"]) == (1, 1)
    assert failed["OPEN"]["value"] == failed["MISSING"]["value"] == pytest.approx(1 / 4)
    assert doc["requests"] == 4 and doc["requests_open"] == 1
    assert doc["metrics"]["r3/open_requests"] == 1 and doc["metrics"]["r3/missing_requests"] == 1
    # without them, the batch is ok
    assert _health(client, "h-batch", "POST", ["b-done"])["verdict"] == "ok"


def test_thresholds_overridden_per_run_change_the_verdict_and_delete_restores(client, planted):
    defaults = client.health_thresholds("h-zero")
    assert defaults["run_id"] == "h-zero" and defaults["overridden"] == []
    assert set(defaults["thresholds"]) == set(CHECKS)
    for check in ("ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "GAP", "FALLBACK", "UNRESOLVED", "OPEN", "MISSING"):
        assert defaults["thresholds"][check]["fail"] == 0.0, check
    assert defaults["thresholds"]["CONFLICT"] == {"warn": 0.0, "fail": None}
    assert defaults["thresholds"]["ROUTER_MISMATCH"] == {"warn": 0.05, "fail": None}
    for check in ("RECOMPUTED", "STALENESS", "TOKEN_MISMATCH"):
        assert defaults["thresholds"][check] == {"warn": None, "fail": None}, check

    try:
        _override_and_restore(client, defaults)
    finally:
        client.reset_health_thresholds("h-zero")


def _override_and_restore(client: ReplayClient, defaults: dict) -> None:
    # 4 ZERO rows in 300: over a warn limit of 0, under a fail limit of 0.5
    loose = {"ZERO": {"warn": 0.0, "fail": 0.5}, "FALLBACK": {"warn": 0.0, "fail": 0.5}}
    answer = client.set_health_thresholds("h-zero", loose)
    assert answer["thresholds"]["ZERO"] == loose["ZERO"] and answer["thresholds"]["FALLBACK"] == loose["FALLBACK"]
    assert sorted(answer["overridden"]) == ["FALLBACK", "ZERO"]
    assert answer["thresholds"]["STALE"] == defaults["thresholds"]["STALE"]  # merged over the defaults
    assert client.health_thresholds("h-zero") == answer
    report = client.run_health("h-zero")
    assert report.verdict is Verdict.WARN and report.failed == ()
    assert [f.check for f in report.warned] == ["ZERO", "FALLBACK"]
    assert report.warned[0].limit == 0.0 and report.warned[0].request_ids == ["z-a", "z-b"]
    assert report.checks["ZERO"].fail == 0.5
    batch = client.batch_health("h-zero", ["z-a", "z-b", "z-ok"])
    assert batch.verdict is Verdict.WARN and batch.metrics["r3/verdict"] == 1
    # only this run: another faulty run still fails on the defaults
    assert client.run_health("h-stale").verdict is Verdict.FAIL

    # no limit at all: ok
    client.set_health_thresholds("h-zero", {"ZERO": {"warn": None, "fail": None},
                                            "FALLBACK": {"warn": None, "fail": None}})
    assert client.run_health("h-zero").verdict is Verdict.OK

    restored = client.reset_health_thresholds("h-zero")
    assert restored == defaults
    assert client.run_health("h-zero").verdict is Verdict.FAIL


def test_an_unknown_check_in_thresholds_is_a_422_naming_it(client, planted):
    with pytest.raises(ReplayError) as refused:
        client.set_health_thresholds("h-zero", {"ZERO": {"warn": 0.0, "fail": 0.5}, "NOT_A_CHECK": {"warn": 0.1,
                                                                                                      "fail": 0.2}})
    assert refused.value.status == 422 and "NOT_A_CHECK" in refused.value.detail
    assert client.health_thresholds("h-zero")["overridden"] == []  # nothing applied


def test_the_gate_raises_on_a_faulty_batch_naming_checks_and_requests(client, planted):
    with pytest.raises(RoutingUnhealthy) as unhealthy:
        client.check_batch("h-zero", ["z-a", "z-b", "z-ok"])
    err = unhealthy.value
    assert err.report.verdict is Verdict.FAIL and err.report.scope == "batch"
    assert err.checks == ["ZERO", "FALLBACK"]
    message = str(err)
    assert message.startswith("run 'h-zero' batch fails routing health: ZERO 4 rows (1.33%, limit 0) in 'z-a' "
                              "from position 17, 'z-b' from position 5; FALLBACK 4 rows"), message

    # the sequences handed to megatron_batch work as well; OPEN and MISSING name their requests
    with pytest.raises(RoutingUnhealthy) as fallback:
        client.check_batch("h-batch", [("h-batch", "b-done"), ("h-batch", "b-open"), ("h-batch", "b-none")])
    assert fallback.value.checks == ["OPEN", "MISSING"]
    assert str(fallback.value) == ("run 'h-batch' batch fails routing health: OPEN 1 requests (33.33%, limit 0) in "
                                   "'b-open'; MISSING 1 requests (33.33%, limit 0) in 'b-none'")
    with pytest.raises(ValueError, match="run 'other'"):
        client.check_batch("h-batch", [("other", "b-done")])


def test_the_gate_hands_back_the_metrics_of_a_clean_batch(client, planted):
    metrics = client.check_batch("h-clean", ["c-0", "c-1", "c-2"], weight_version="7")
    assert set(metrics) == BATCH_METRICS
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["r3/verdict"] == 0 and metrics["r3/requests"] == 3 and metrics["r3/rows_expected"] == 3 * N
    for name in ("r3/flagged_frac", "r3/zero_frac", "r3/stale_frac", "r3/out_of_range_frac", "r3/duplicate_frac",
                 "r3/conflict_frac", "r3/gap_frac", "r3/fallback_frac", "r3/unresolved_refs", "r3/open_requests",
                 "r3/missing_requests", "r3/recomputed_frac", "r3/router_mismatch", "r3/token_mismatch"):
        assert metrics[name] == 0, name
    # a third of the rows are of version 6, one behind the trainer's 7 (no default limit: still ok)
    assert metrics["r3/version_stale_frac"] == pytest.approx(1 / 3) and metrics["r3/version_max_lag"] == 1
    assert metrics["r3/jaccard"] == 1

    report = client.batch_health("h-clean", ["c-0", "c-1", "c-2"], weight_version="7")
    assert report.ok and report.metrics == metrics
    assert report.weight_versions.current == "7" and report.weight_versions.stale_rows == N
    assert report.weight_versions.max_lag == 1 and report.weight_versions.rows == {"6": N, "7": 2 * N}
    assert report.checks["STALENESS"].count == N and report.checks["STALENESS"].level is Verdict.OK
    assert report.agreement is not None and report.agreement.weight_version == "7"
    # the typed report is the answer, parsed
    raw = client.http.post("/v1/runs/h-clean/health", json={"requests": ["c-0", "c-1", "c-2"],
                                                             "weight_version": "7"}).json()
    assert HealthReport.from_json(raw) == report


def test_the_gate_at_warn(client, planted):
    client.set_health_thresholds("h-layer", {"DUPLICATE": {"warn": 0.0, "fail": None},
                                             "FALLBACK": {"warn": 0.0, "fail": None}})
    try:
        assert client.check_batch("h-layer", ["l-a", "l-ok"])["r3/verdict"] == 1  # warn passes a "fail" gate
        with pytest.raises(RoutingUnhealthy, match=r"warns on routing health: DUPLICATE 2 rows .* 'l-a' from "
                                                   r"position 30"):
            client.check_batch("h-layer", ["l-a", "l-ok"], fail_on="warn")
    finally:
        client.reset_health_thresholds("h-layer")
    with pytest.raises(ValueError, match="fail_on"):
        client.check_batch("h-layer", ["l-ok"], fail_on="ok")


def test_window_s_leaves_out_older_requests(client, planted):
    rng = np.random.default_rng(2405)  # a seed no other module of the shared service uses: no STALE copies
    old = routes(rng, N)
    old[3] = 0
    _ingest(client, "h-window", [_whole("w-old", old)])
    client.finish("h-window", "w-old", N + 1)
    written = time.time()
    time.sleep(1.0)
    cut = time.time() - 0.5  # between the two requests' writes
    _ingest(client, "h-window", [_whole("w-new", routes(rng, N))], seq=1)
    client.finish("h-window", "w-new", N + 1)
    assert cut > written

    whole = client.run_health("h-window")
    assert whole.verdict is Verdict.FAIL and whole.requests == 2
    assert whole.finding("ZERO") is not None and whole.finding("ZERO").request_ids == ["w-old"]
    window = time.time() - cut  # the window reaches back to `cut`
    recent = client.run_health("h-window", window_s=window)
    assert recent.window_s == pytest.approx(window)
    assert recent.verdict is Verdict.OK and recent.requests == 1 and recent.rows_expected == N
