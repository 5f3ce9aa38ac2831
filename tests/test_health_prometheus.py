"""Run health on /metrics and the shipped alert rules, down to a real Prometheus server.

- The rules (deploy/prometheus/alerts.yml) pass `promtool check rules`, their unit tests (alerts_test.yml: series
  fed by hand) pass `promtool test rules`, the example config passes `promtool check config`, and every metric a
  rule names is one the service exports.
- The collector (replay_service/health/exporter.py) in process: the cap keeps the newest runs, every run is
  counted by verdict, and a failing index read answers a scrape all the same (the error counter, no per-run series).
- A real service with a clean run, a run with a planted ZERO row and a drifting run, scraped every second by
  Debian's Prometheus with the shipped rules: Prometheus' own API shows the ZERO alert (and the failing verdict)
  firing for the faulty run, the router-mismatch alert pending for the drifting one, and never an alert for the
  clean run.
- 1,000 runs in one store: the series /metrics exports stay bounded by REPLAY_METRICS_MAX_RUNS; the count and the
  scrape time are printed (not asserted on: shared machines).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replay_client.client import ReplayClient
from replay_service.health.exporter import EXPORTED_FLAGS, SERIES_PER_RUN, RunHealthCollector
from replay_service.health.recent import RecentRun
from replay_service.health.verdict import Level
from replay_service.metrics import ServiceMetrics
from replay_service.settings import ServiceSettings
from tests.conftest import REQUIRE_ALL
from tests.support.data import batch_bytes, routes, store_requests
from tests.support.prometheus import PrometheusServer, binary, promtool
from tests.support.service import ServiceProcess, calls

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = DEPLOY / "alerts.yml"
DEADLINE_S = 90.0  # how long Prometheus may take to scrape, evaluate and fire (it takes a few seconds)

needs_promtool = pytest.mark.skipif(
    binary("promtool") is None and not REQUIRE_ALL,
    reason="promtool is not installed (Debian's prometheus package: `bash scripts/env.sh test` installs it)")
needs_prometheus = pytest.mark.skipif(
    binary("prometheus") is None and not REQUIRE_ALL,
    reason="prometheus is not installed (Debian's prometheus package: `bash scripts/env.sh test` installs it)")


# ---- the rule files ---------------------------------------------------------------------------------------------

@needs_promtool
def test_the_rules_pass_promtool_check():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_the_rules_unit_tests_pass():
    done = promtool("test", "rules", "alerts_test.yml", cwd=DEPLOY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_the_example_config_passes_promtool_check(tmp_path):
    # its scrape job sends a bearer token from a file (a tokens-file service): promtool wants the file to exist
    config = yaml.safe_load((DEPLOY / "prometheus.example.yml").read_text())
    config["rule_files"] = [str(RULES)]
    for job in config["scrape_configs"]:
        if "authorization" in job:
            token = tmp_path / "token"
            token.write_text("t0ken\n")
            job["authorization"]["credentials_file"] = str(token)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    done = promtool("check", "config", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def _collector(read, settings: ServiceSettings | None = None, store: object = None,
               clock=time.time) -> RunHealthCollector:
    """A collector on a stand-in store and index read (`read(store, window_s, now)`)."""
    return RunHealthCollector(lambda: store, settings or ServiceSettings(), read=read, clock=clock)  # type: ignore[arg-type, return-value]


def _exported_names() -> set[str]:
    """Every sample name the service's registry can answer with (the run-health families included)."""
    metrics = ServiceMetrics()
    metrics.registry.register(_collector(lambda *_, **__: []))
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [])
        names.update(family.name + s for s in suffixes)
    return names


def test_every_metric_a_rule_names_is_exported():
    exported = _exported_names()
    rules = yaml.safe_load(RULES.read_text())["groups"]
    assert [g["name"] for g in rules] == ["routing-replay"]
    named = set()
    for rule in rules[0]["rules"]:
        named.update(re.findall(r"\breplay_[a-z_]+\b", rule["expr"]))
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
    assert named and named <= exported, named - exported
    # one alert per corruption kind and GAP, each on its own flag
    by_flag = {m for rule in rules[0]["rules"] for m in re.findall(r'flag="([A-Z_]+)"', rule["expr"])}
    assert by_flag == {"ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "GAP"}


# ---- the collector in process -------------------------------------------------------------------------------------

def _run(run_id: str, verdict: Level, last_write: float | None, zero: int = 0,
         mismatch: float | None = None) -> RecentRun:
    flagged = dict.fromkeys(EXPORTED_FLAGS, 0) | {"ZERO": zero}
    return RecentRun(run_id=run_id, verdict=verdict, rows=100, flagged=flagged, open_requests=1,
                     router_mismatch=mismatch, last_write=last_write)


def _scrape(registry: CollectorRegistry) -> dict[str, list]:
    """Samples by family name, as a scraper reads the registry's exposition."""
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _registry(collector: RunHealthCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_the_cap_keeps_the_newest_runs_and_counts_every_run():
    runs = [_run("a", Level.OK, 10.0), _run("b", Level.FAIL, 30.0, zero=2), _run("c", Level.WARN, 20.0, mismatch=0.07),
            _run("d", Level.FAIL, None)]
    seen: dict[str, object] = {}

    def read(store, window_s, now, judged=None):
        seen.update(store=store, window_s=window_s, now=now, judged=judged)
        return runs

    settings = ServiceSettings(metrics_max_runs=2, health_window_s=600.0)
    families = _scrape(_registry(_collector(read, settings, store="the store", clock=lambda: 1234.0)))
    assert seen == {"store": "the store", "window_s": 600.0, "now": 1234.0, "judged": 2}
    verdicts = {s.labels["run"]: s.value for s in families["replay_run_verdict"]}
    assert verdicts == {"b": 2.0, "c": 1.0}  # the two written last
    zero = {s.labels["run"]: s.value for s in families["replay_run_recent_flagged_rows"] if s.labels["flag"] == "ZERO"}
    assert zero == {"b": 2.0, "c": 0.0}
    assert len(families["replay_run_recent_flagged_rows"]) == 2 * len(EXPORTED_FLAGS)
    assert {s.labels["run"]: s.value for s in families["replay_run_router_mismatch"]} == {"c": 0.07}
    assert {s.labels["run"]: s.value for s in families["replay_run_open_requests"]} == {"b": 1.0, "c": 1.0}
    assert {s.labels["run"]: s.value for s in families["replay_run_recent_rows"]} == {"b": 100.0, "c": 100.0}
    assert {s.labels["verdict"]: s.value for s in families["replay_runs"]} == {"ok": 1.0, "warn": 1.0, "fail": 2.0}
    assert families["replay_runs_not_exported"][0].value == 2.0
    assert families["replay_health_scrape_errors"][0].value == 0.0


def test_a_cap_of_0_exports_only_the_counts():
    runs = [_run("a", Level.FAIL, 1.0, zero=1)]
    families = _scrape(_registry(_collector(lambda *_, **__: runs, ServiceSettings(metrics_max_runs=0))))
    assert not [s for name, samples in families.items() if name.startswith("replay_run_") for s in samples]
    assert families["replay_runs_not_exported"][0].value == 1.0
    assert {s.labels["verdict"]: s.value for s in families["replay_runs"]} == {"ok": 0.0, "warn": 0.0, "fail": 1.0}


def test_a_failed_read_answers_the_scrape_with_the_error_counter():
    calls = []

    def flaky(store, window_s, now, judged=None):
        calls.append(now)
        if len(calls) <= 2:
            raise OSError("index unreachable")
        return [_run("a", Level.OK, 1.0)]

    registry = _registry(_collector(flaky))
    for errors in (1.0, 2.0):
        families = _scrape(registry)
        assert families["replay_health_scrape_errors"][0].value == errors
        assert "replay_run_verdict" not in families and "replay_runs" not in families
    families = _scrape(registry)  # the index back: the counter keeps its count, the runs are back
    assert families["replay_health_scrape_errors"][0].value == 2.0
    assert [s.labels["run"] for s in families["replay_run_verdict"]] == ["a"]


def test_a_bad_record_is_a_read_error_not_a_failed_scrape():
    bad = RecentRun(run_id="a", verdict=7, rows=1, flagged={}, open_requests=0, router_mismatch=None,  # type: ignore[arg-type]
                    last_write=1.0)
    families = _scrape(_registry(_collector(lambda *_, **__: [_run("b", Level.OK, 2.0), bad])))
    assert families["replay_health_scrape_errors"][0].value == 1.0
    assert "replay_run_verdict" not in families  # nothing half-built: no run of that read is exported


def test_the_names_are_known_to_the_registry():
    metrics = ServiceMetrics()
    metrics.registry.register(_collector(lambda *_, **__: []))
    with pytest.raises(ValueError, match="replay_run_verdict"):  # registered twice: `describe` told the names
        metrics.registry.register(_collector(lambda *_, **__: []))


# ---- a real Prometheus scraping a real service ------------------------------------------------------------------

@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A service with a clean, a faulty (one ZERO row) and a drifting run, and Prometheus scraping it every second."""
    root = tmp_path_factory.mktemp("prom")
    env = {"REPLAY_FSYNC": "0", "REPLAY_HEALTH_WINDOW_S": "3600"}
    with ServiceProcess(root / "data", env=env) as service:
        client = ReplayClient(service.url)
        store_requests(client, "clean", {"c0": 120, "c1": 80}, seed=1)
        store_requests(client, "faulty", {"f0": 120, "f1": 80}, seed=2, flagged={"f1": [17]})
        full = store_requests(client, "drifting", {"d0": 120}, seed=3)
        trainer = full["d0"].copy()
        trainer[:, :10] = routes(np.random.default_rng(4), len(trainer))[:, :10]  # 10 of 48 layers routed anew
        comparison = client.compare("drifting", ["d0"] * len(trainer), np.arange(len(trainer)), trainer, step=1)
        prometheus = PrometheusServer([f"127.0.0.1:{service.port}"], rule_files=[RULES])
        with prometheus:
            yield service, prometheus, comparison
        client.close()


def _wait_for(what: str, prometheus: PrometheusServer, found) -> object:
    """Poll until `found()` answers something truthy (no timing asserted: a generous deadline, then fail)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        answer = found()
        if answer:
            return answer
        if time.monotonic() > deadline:
            targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in prometheus.targets()]
            pytest.fail(f"{what} not seen in {DEADLINE_S}s; targets {targets}; alerts {prometheus.alerts()}; "
                        f"log: {prometheus.log()}")
        time.sleep(0.5)


@pytest.mark.slow
@needs_prometheus
def test_the_planted_zero_row_fires_its_alert_and_the_clean_run_none(scraped):
    service, prometheus, _ = scraped

    def zero_alert():
        return [a for a in prometheus.alerts() if a["labels"]["alertname"] == "ReplayRunZeroRows"
                and a["state"] == "firing"]

    firing = _wait_for("ReplayRunZeroRows firing", prometheus, zero_alert)
    assert isinstance(firing, list) and len(firing) == 1
    alert = firing[0]
    assert alert["labels"]["run"] == "faulty" and alert["labels"]["flag"] == "ZERO"
    assert alert["labels"]["severity"] == "critical" and float(alert["value"]) == 1.0
    assert "/v1/runs/faulty/health" in alert["annotations"]["description"]
    assert alert["annotations"]["summary"].startswith("Run faulty: 1 ZERO rows")
    # the verdict alert too, once its own evaluation has seen the series
    _wait_for("ReplayRunFailing firing for faulty", prometheus, lambda: [
        a for a in prometheus.alerts() if a["labels"]["alertname"] == "ReplayRunFailing"
        and a["labels"]["run"] == "faulty" and a["state"] == "firing"])

    # Prometheus holds the clean run's series (so "no alert" is a judgement, not a missing scrape) ...
    clean = {r["metric"]["flag"]: float(r["value"][1])
             for r in prometheus.query('replay_run_recent_flagged_rows{run="clean"}')}
    assert clean == dict.fromkeys(EXPORTED_FLAGS, 0.0)
    assert [float(r["value"][1]) for r in prometheus.query('replay_run_verdict{run="clean"}')] == [0.0]
    # ... and never had an alert for it, pending or firing, since the server started
    assert prometheus.query('max_over_time(ALERTS{run="clean"}[10m])') == []
    assert [a for a in prometheus.alerts() if a["labels"].get("run") == "clean"] == []
    # and no per-run alert for anything but the faulty and drifting runs; no scrape error, no damaged segment
    assert {a["labels"].get("run") for a in prometheus.alerts()} <= {"faulty", "drifting"}
    assert [float(r["value"][1]) for r in prometheus.query("replay_health_scrape_errors_total")] == [0.0]
    # the figures agree with the service's own health answer over the same window
    report = calls.get(f"{service.url}/v1/runs/faulty/health", params={"window_s": 3600}).json()
    assert report["verdict"] == "fail" and "ZERO" in {f["check"] for f in report["failed"]}
    assert report["checks"]["ZERO"]["count"] == 1
    assert calls.get(f"{service.url}/v1/runs/clean/health", params={"window_s": 3600}).json()["verdict"] == "ok"


@pytest.mark.slow
@needs_prometheus
def test_router_mismatch_is_scraped_and_its_alert_waits_out_its_for(scraped):
    _, prometheus, comparison = scraped
    assert comparison["router_mismatch"] > 0.05

    def pending():
        return [a for a in prometheus.alerts() if a["labels"]["alertname"] == "ReplayRunRouterMismatch"]

    alerts = _wait_for("ReplayRunRouterMismatch pending", prometheus, pending)
    assert isinstance(alerts, list)
    assert [(a["labels"]["run"], a["state"]) for a in alerts] == [("drifting", "pending")]  # `for: 5m`
    value = prometheus.query('replay_run_router_mismatch{run="drifting"}')
    assert [float(r["value"][1]) for r in value] == pytest.approx([comparison["router_mismatch"]])
    assert prometheus.query('replay_run_router_mismatch{run="clean"}') == []  # absent without a comparison
    assert [float(r["value"][1]) for r in prometheus.query('replay_run_verdict{run="drifting"}')] == [1.0]


# ---- cardinality under 1,000 runs -------------------------------------------------------------------------------

RUNS = 1000
SCRAPES = 5


def _series(text: str) -> dict[str, int]:
    """Samples per family name in an exposition."""
    return {f.name: len(f.samples) for f in text_string_to_metric_families(text)}


@pytest.mark.slow
def test_series_stay_bounded_under_1000_runs(tmp_path):
    rng = np.random.default_rng(7)
    rows = routes(rng, 8)
    faulty = set(range(0, RUNS, 10))  # every tenth run holds one ZERO row: it fails
    with ServiceProcess(tmp_path / "data", env={"REPLAY_FSYNC": "0"}) as service, httpx.Client() as http:
        client = ReplayClient(service.url)
        for i in range(RUNS):
            experts = rows.copy()
            if i in faulty:
                experts[3] = 0
            client.ingest(batch_bytes(f"run-{i:04d}", "w", 0, ["r"] * 8, np.arange(8), experts))
        times, texts = [], []
        for _ in range(SCRAPES):
            started = time.perf_counter()
            answer = http.get(f"{service.url}/metrics")
            times.append(time.perf_counter() - started)
            assert answer.status_code == 200
            texts.append(answer.text)
        client.close()
    cap = ServiceSettings().metrics_max_runs
    families = {f.name: f.samples for f in text_string_to_metric_families(texts[-1])}
    per_run = [s for samples in families.values() for s in samples if "run" in s.labels]
    others = sum(len(samples) for samples in families.values()) - len(per_run)
    # the newest `cap` runs have series, none of the others; every run is counted by verdict
    assert {s.labels["run"] for s in per_run} == {f"run-{i:04d}" for i in range(RUNS - cap, RUNS)}
    assert len(per_run) <= cap * SERIES_PER_RUN
    assert families["replay_runs_not_exported"][0].value == RUNS - cap
    by_verdict = {s.labels["verdict"]: s.value for s in families["replay_runs"]}
    assert by_verdict == {"ok": RUNS - len(faulty), "warn": 0, "fail": len(faulty)}
    exported_zero = {s.labels["run"] for s in families["replay_run_recent_flagged_rows"]
                     if s.labels["flag"] == "ZERO" and s.value == 1}
    assert exported_zero == {f"run-{i:04d}" for i in faulty if i >= RUNS - cap}
    assert others < 1000  # the service's own families: by route template and status, not by run
    times.sort()
    print(f"\n/metrics with {RUNS} runs (cap {cap}): {len(per_run) + others} series ({len(per_run)} per-run, "
          f"{others} others), {len(texts[-1])} bytes; scrape {times[len(times) // 2] * 1000:.1f} ms median of "
          f"{SCRAPES} (min {times[0] * 1000:.1f}, max {times[-1] * 1000:.1f})")
