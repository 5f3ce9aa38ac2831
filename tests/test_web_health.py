"""The run page's health view in a real headless Chromium against a real service (issue 24, "Pictures").

A run of 30 requests ingested in 30 batches (each in its own ingest-time bucket: the service runs with
REPLAY_HEALTH_BUCKET_S=0.1 and the batches are sent more than a bucket apart), its rows in 10 weight versions,
expert load drifting onto a few experts, three planted faults (a ZERO row, an OUT_OF_RANGE id, a GAP of ten
positions), and 200 comparisons posted at training steps 0..199 whose mismatch grows. The test reads the plotted
points back from the page (window.__healthPlots: each uPlot instance's own data) and checks them against
/agreement and /health/series exactly, and the verdict shown against /health. Screenshots go to the pytest tmp
directory and to /tmp/health_shots/.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.weight_versions import WeightVersions
from tests.support.browser import browser, goto_hash, new_page, require_browser, set_hash
from tests.support.data import QWEN3_SHAPE
from tests.support.service import ServiceProcess, calls

RUN, CLEAN_RUN = "web-health", "web-health-clean"
N, BATCHES, STEPS, BUCKET_S = 200, 30, 200, 0.1
ZERO_REQ, ZERO_POS = "r05", 17
OOR_REQ, OOR_POS = "r12", 44
GAP_REQ, GAP_START, GAP_END = "r20", 90, 100
COMPARED, COMPARED_ROWS = "r00", 64
INGEST_FLAGS = ["ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "CONFLICT"]
SHOTS = Path("/tmp/health_shots")
L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts


def drifting_routes(rng: np.random.Generator, n: int, skew: float) -> np.ndarray:
    """`(n, L, K)` distinct ids per layer; `skew` > 0 draws experts 0..7 more often (a load imbalance)."""
    weights = np.ones(E)
    weights[:8] += skew
    keys = np.log(weights) + rng.gumbel(size=(n, L, E))  # Gumbel top-k: a weighted draw without replacement
    return np.argpartition(-keys, K, axis=-1)[..., :K].astype(np.uint8)


def upload(client: ReplayClient, run: str, batch: int, request: str, experts: np.ndarray, positions: np.ndarray,
           version: str | None) -> None:
    """One row batch of one request through the client (its rows all of `version`, or unversioned)."""
    wv = None if version is None else WeightVersions.single(version, len(positions))
    body = encode_stream(build_rows(RowsMeta(run, "w", batch, QWEN3_SHAPE), [request] * len(positions), positions,
                                    experts, weight_versions=wv))
    client.ingest(body)


def trainer_view(stored: np.ndarray, step: int) -> np.ndarray:
    """The trainer's top-k at a step: more (token, layer) sets differ as training goes on (up to ~12%)."""
    cell = np.arange(COMPARED_ROWS)[:, None] * L + np.arange(L)[None, :]
    differs = (cell * 7919) % 1600 < step + 1
    out = stored.copy()
    out[differs] = np.roll(stored, -1, axis=1)[differs]  # another layer's set: a different top-k
    return out


@pytest.fixture(scope="module")
def health_web(tmp_path_factory):
    require_browser()  # skip before starting anything when there is no browser
    out = tmp_path_factory.mktemp("web-health")
    env = {"REPLAY_HEALTH_BUCKET_S": str(BUCKET_S)}
    with ServiceProcess(out / "data", env=env) as svc, ReplayClient(svc.url) as client:
        rng = np.random.default_rng(24)
        stored = {}
        for i in range(BATCHES):
            req = f"r{i:02d}"
            experts = drifting_routes(rng, N, skew=3.0 * i / BATCHES)
            positions = np.arange(N)
            if req == ZERO_REQ:
                experts[ZERO_POS] = 0  # a never-written row
            if req == OOR_REQ:
                experts[OOR_POS, 0, 0] = 255  # -1 cast to uint8
            if req == GAP_REQ:
                positions = np.r_[0:GAP_START, GAP_END:N]  # ten positions never sent
            stored[req] = experts
            if i:
                time.sleep(BUCKET_S * 1.2)  # the next batch lands in a later ingest-time bucket
            upload(client, RUN, i, req, experts[positions], positions, version=str(i // 3))
            client.finish(RUN, req, N + 1)
        for step in range(STEPS):
            client.compare(RUN, [COMPARED] * COMPARED_ROWS, np.arange(COMPARED_ROWS),
                           trainer_view(stored[COMPARED][:COMPARED_ROWS], step), step=step,
                           weight_version=str(step // 20))
        # a clean run without comparisons or weight versions
        upload(client, CLEAN_RUN, 0, "c0", drifting_routes(rng, N, 0.0), np.arange(N), version=None)
        client.finish(CLEAN_RUN, "c0", N + 1)
        with browser() as b:
            yield {"url": svc.url, "browser": b, "out": out}
    print(f"\nhealth-view screenshots: {out} (and {SHOTS})")


@pytest.fixture
def page(health_web):
    page, watch = new_page(health_web["browser"], health_web["url"], width=1440, height=1000)
    yield page, watch
    assert watch.foreign_urls() == [], "the page fetched something from elsewhere"
    assert not [e for e in watch.errors if "pageerror" in e], watch.errors
    assert watch.dialogs == []
    page.context.close()


def api(web, path: str) -> dict:
    """A read of the service's HTTP API, as JSON."""
    r = calls.get(web["url"] + path, timeout=60)
    r.raise_for_status()
    return r.json()


def shot(page, web, name: str, full: bool = True) -> None:
    """A screenshot in the test's tmp dir, copied to /tmp/health_shots/ for review."""
    path = web["out"] / f"{name}.png"
    page.screenshot(path=str(path), full_page=full)
    SHOTS.mkdir(exist_ok=True)
    shutil.copy(path, SHOTS / path.name)


def plotted(page) -> dict:
    """What each health plot draws: its series labels and the uPlot instance's data (x first)."""
    return page.evaluate("() => JSON.parse(JSON.stringify(window.__healthPlots || {}))")


def open_health(page, web, run: str) -> None:
    """The run page's health tab, once every plot card has settled (a plot, or what it says instead)."""
    goto_hash(page, web["url"], f"/runs/{run}?tab=health")
    page.wait_for_function("() => ['agreement', 'flags', 'imbalance', 'versions'].every(k =>"
                           " document.querySelector('#plot-' + k).dataset.state !== 'loading')")


def test_health_view_plots_what_the_api_answers(health_web, page):
    page, _ = page
    web = health_web
    open_health(page, web, RUN)
    health = api(web, f"/v1/runs/{RUN}/health")
    series = api(web, f"/v1/runs/{RUN}/health/series")
    points = api(web, f"/v1/runs/{RUN}/agreement")["points"]
    drawn = plotted(page)
    assert sorted(drawn) == ["agreement", "flags", "imbalance", "versions"]
    for name in drawn:
        assert page.locator(f"#plot-{name}").get_attribute("data-state") == "plot"
        assert page.locator(f"#plot-{name} canvas").count() >= 1
    shot(page, web, "health-view")

    # agreement over training steps: every posted step, in step order, with the API's figures
    assert [p["step"] for p in points] == list(range(STEPS))
    agreement = drawn["agreement"]
    assert agreement["labels"] == ["router mismatch", "1 − Jaccard", "tokens differing"]
    x, router, one_minus_j, tokens = agreement["data"]
    assert x == [p["step"] for p in points]
    assert router == [p["router_mismatch"] for p in points]
    assert one_minus_j == [1 - p["jaccard"] for p in points]
    assert tokens == [p["token_mismatch"] for p in points]
    assert router[-1] > router[0] and max(router) < 0.2  # the planted drift, drawn

    # flag rates over ingest time: one point per bucket, rate = flagged[kind] / rows
    ingest = series["ingest"]
    assert len(ingest) == BATCHES  # each batch its own bucket
    flags = drawn["flags"]
    assert flags["labels"] == INGEST_FLAGS
    assert flags["data"][0] == [b["t"] for b in ingest]
    for i, kind in enumerate(INGEST_FLAGS, start=1):
        assert flags["data"][i] == [b["flagged"][kind] / b["rows"] for b in ingest], kind
    zero_at = [i for i, v in enumerate(flags["data"][1]) if v]
    oor_at = [i for i, v in enumerate(flags["data"][3]) if v]
    assert zero_at == [int(ZERO_REQ[1:])] and oor_at == [int(OOR_REQ[1:])]  # the planted rows' buckets

    # expert-load imbalance over time and per weight version
    imbalance = drawn["imbalance"]
    assert imbalance["labels"] == ["mean over layers", "worst layer"]
    assert imbalance["data"] == [[b["t"] for b in ingest], [b["imbalance"] for b in ingest],
                                 [b["imbalance_max"] for b in ingest]]
    assert imbalance["data"][1][-1] > imbalance["data"][1][0]  # the drift onto experts 0..7
    versions = drawn["versions"]
    assert versions["xLabels"] == [v["version"] for v in series["versions"]] == [str(v) for v in range(10)]
    assert versions["data"] == [list(range(10)), [v["imbalance"] for v in series["versions"]],
                                [v["imbalance_max"] for v in series["versions"]]]

    # the verdict shown is the API's, with what failed and where
    assert health["verdict"] == "fail"
    assert page.get_attribute("#health-verdict", "data-verdict") == health["verdict"]
    assert page.inner_text("#verdict-level") == health["verdict"].upper()
    page.wait_for_function("() => document.querySelector('#health-badge').dataset.verdict !== 'loading'")
    assert page.get_attribute("#health-badge", "data-verdict") == health["verdict"]
    findings = health["failed"] + health["warned"]
    shown = page.eval_on_selector_all("li.finding", "fs => fs.map(f => [f.dataset.check, f.dataset.level])")
    assert shown == [[f["check"], f["level"]] for f in findings]
    failed = {f["check"] for f in health["failed"]}
    assert {"ZERO", "OUT_OF_RANGE", "GAP"} <= failed
    for f in findings:
        links = page.eval_on_selector_all(f"li.finding[data-check='{f['check']}'] a.finding-request",
                                          "as => as.map(a => a.getAttribute('href'))")
        expected = []
        for q in f["requests"]:
            where = "" if q["first_position"] is None else f"?pos={q['first_position']}"
            expected.append(f"#/runs/{RUN}/requests/{quote(q['request_id'], safe='')}{where}")
        assert links == expected, f["check"]
    where = {f["check"]: [(q["request_id"], q["first_position"]) for q in f["requests"]] for f in health["failed"]}
    assert where["ZERO"] == [(ZERO_REQ, ZERO_POS)] and where["OUT_OF_RANGE"] == [(OOR_REQ, OOR_POS)]
    assert where["GAP"] == [(GAP_REQ, GAP_START)]
    checks = dict(page.eval_on_selector_all(".chip.check", "cs => cs.map(c => [c.dataset.check, c.dataset.level])"))
    assert checks == {name: c["level"] for name, c in health["checks"].items()}
    page.locator("#health-verdict").screenshot(path=str(web["out"] / "health-verdict.png"))
    shutil.copy(web["out"] / "health-verdict.png", SHOTS / "health-verdict.png")

    # a finding's request link opens the request at its first flagged position
    page.click(f"li.finding[data-check='ZERO'] a.finding-request[data-request='{ZERO_REQ}']")
    page.wait_for_function(f"() => document.querySelector('#row-detail') && "
                           f"document.querySelector('#row-detail').dataset.pos === '{ZERO_POS}'")
    page.wait_for_function("() => document.querySelector('#row-detail').innerText.includes('ZERO')")


def test_health_plots_follow_a_resize(health_web, page):
    page, _ = page
    open_health(page, health_web, RUN)
    page.set_viewport_size({"width": 900, "height": 1000})  # one column of plots
    page.wait_for_function("""() => { const c = document.querySelector('#plot-agreement .plot');
      const w = c.querySelector('.u-wrap');
      return c.clientWidth < 900 && Math.abs(w.offsetWidth - c.clientWidth) <= 2; }""")
    shot(page, health_web, "health-view-narrow")


def test_a_clean_run_without_comparisons_says_so(health_web, page):
    page, _ = page
    open_health(page, health_web, CLEAN_RUN)
    health = api(health_web, f"/v1/runs/{CLEAN_RUN}/health")
    assert health["verdict"] == "ok" and page.get_attribute("#health-verdict", "data-verdict") == "ok"
    assert page.locator("li.finding").count() == 0
    assert "every check is within its limits" in page.inner_text("#health-verdict")
    assert api(health_web, f"/v1/runs/{CLEAN_RUN}/agreement")["points"] == []
    assert page.get_attribute("#plot-agreement", "data-state") == "empty"
    assert "No comparisons posted with a training step" in page.inner_text("#plot-agreement")
    assert api(health_web, f"/v1/runs/{CLEAN_RUN}/health/series")["versions"] == []
    assert page.get_attribute("#plot-versions", "data-state") == "empty"
    assert "No rows carry a weight version" in page.inner_text("#plot-versions")
    drawn = plotted(page)
    assert sorted(drawn) == ["flags", "imbalance"]
    ingest = api(health_web, f"/v1/runs/{CLEAN_RUN}/health/series")["ingest"]
    assert drawn["flags"]["data"][0] == [b["t"] for b in ingest]
    assert all(v == 0 for s in drawn["flags"]["data"][1:] for v in s)
    shot(page, health_web, "health-view-clean")


def test_an_older_service_without_the_endpoints(health_web, page):
    """A service from before issue 24 answers 404 for the three reads: the page says so and keeps working.

    The 404s are answered in the browser (this checkout's service has the endpoints); everything else is the
    real service's answer."""
    page, _ = page

    def not_found(route):
        route.fulfill(status=404, content_type="application/json", body='{"detail": "Not Found"}')

    for pattern in ("health", "health/series", "agreement"):
        page.route(f"**/v1/runs/{RUN}/{pattern}", not_found)
    open_health(page, health_web, RUN)
    assert page.get_attribute("#health-verdict", "data-verdict") == "none"
    assert "no health endpoint" in page.inner_text("#health-verdict")
    for name in ("agreement", "flags", "imbalance", "versions"):
        assert page.get_attribute(f"#plot-{name}", "data-state") == "missing"
        assert "older release" in page.inner_text(f"#plot-{name}")
    assert plotted(page) == {}
    assert page.get_attribute("#health-badge", "data-verdict") == "none"
    shot(page, health_web, "health-view-older-service")
    set_hash(page, f"/runs/{RUN}")  # the rest of the run page is unaffected
    page.wait_for_selector("tbody tr[data-request]")
    assert page.locator("tbody tr[data-request]").count() == BATCHES
