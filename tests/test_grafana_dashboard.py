"""deploy/grafana's dashboard against a running service: every query names metrics the service exports, and runs.

A service of two workers on a PostgreSQL index (so its STALE feed runs) with the demo run, written to, read from,
refused and compared against; then Debian's Prometheus scrapes it, and each panel's query is asked of it. Grafana
itself is not run here: no registry is reachable and Debian has no package of it (docs/guides/health.md).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from replay_client import ReplayClient, ReplayError
from tests.support.data import batch_bytes, routes
from tests.support.prometheus import PrometheusServer, binary
from tests.support.service import ServiceProcess, calls

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "routing-replay.json"
METRIC = re.compile(r"\breplay_[a-z0-9_]+\b")
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", re.M)


def queries() -> list[str]:
    """Every panel's every query, in order."""
    doc = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in doc["panels"] for target in panel["targets"]]


def test_the_dashboard_is_provisioned_where_grafana_runs():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "routing-replay" and len(doc["panels"]) >= 10
    assert len({panel["id"] for panel in doc["panels"]}) == len(doc["panels"])
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["replay-grafana"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/routing-replay.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://replay-prometheus:9090"


@pytest.fixture(scope="module")
def busy_service(tmp_path_factory, postgres):
    """Two workers on a PostgreSQL index, the demo run, and some of everything the dashboard plots."""
    env = {"REPLAY_INDEX_URL": postgres.new_database(), "REPLAY_STALE_FEED_INTERVAL_S": "0.2"}
    with ServiceProcess(tmp_path_factory.mktemp("grafana") / "data", demo=True, workers=2, env=env) as service:
        with ReplayClient(service.url) as client:
            rng = np.random.default_rng(4)
            for seq in range(3):
                client.ingest(batch_bytes("dash", "w", seq, ["r"] * 6, np.arange(6) + 6 * seq, routes(rng, 6)))
            zero = routes(rng, 4)
            zero[1] = 0  # a row never written: flagged ZERO
            assert client.ingest(batch_bytes("dash", "w", 3, ["z"] * 4, np.arange(4), zero)).flagged == {"ZERO": 1}
            client.get_route("demo", "clean-00")
            client.megatron_batch([("demo", "clean-00")])
            route = client.get_route("demo", "clean-01")
            client.compare("demo", ["clean-01"] * len(route.positions), route.positions, route.experts, step=1)
            with pytest.raises(ReplayError):
                client.get_route("demo", "no-such-request")
            padded = np.concatenate([routes(rng, 2).astype(np.int32), np.full((1, 48, 8), -1, np.int32)])
            client.upload_route("dash", "pad", padded, num_experts=128)  # a padding row dropped
        time.sleep(1.0)  # a round or more of the STALE feed
        yield service


def test_every_query_names_metrics_the_service_exports(busy_service):
    exposition = calls.get(f"{busy_service.url}/metrics").text
    exported = set(_SERIES.findall(exposition))
    named = {name for query in queries() for name in METRIC.findall(query)}
    assert named, "no query names a metric"
    missing = sorted(named - exported)
    assert not missing, f"the dashboard queries metrics the service does not export: {missing}"


def test_every_query_runs_in_prometheus(busy_service):
    if binary("prometheus") is None:
        pytest.fail("Debian's prometheus is not installed (scripts/env.sh test installs it)")
    server = PrometheusServer([f"127.0.0.1:{busy_service.port}"], scrape_interval_s=0.5).start()
    try:
        deadline = time.monotonic() + 30  # a hang guard: two scrapes, then rates have two points
        while time.monotonic() < deadline and not server.query("replay_rows_ingested_total"):
            time.sleep(0.25)
        time.sleep(1.5)
        answered = {query: server.query(query) for query in queries()}  # a query Prometheus refuses raises
    finally:
        server.stop()
    assert answered["sum(rate(replay_rows_ingested_total[5m]))"], "the ingest panel plots nothing"
    assert any(answered[q] for q in answered if "replay_data_disk_bytes" in q)
