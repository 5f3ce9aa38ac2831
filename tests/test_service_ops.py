"""Operations surface, and the demo a newcomer sees first."""

from __future__ import annotations

import numpy as np

from replay_client.client import ReplayClient
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls


def _metric(text: str, name: str) -> float:
    """The value of one exposition line `name value` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_healthz_metrics_docs(shared_service):
    service = shared_service  # counters are read as differences: other modules use the same service
    names = ("replay_rows_ingested_total", 'replay_rows_flagged_total{flag="ZERO"}',
             'replay_http_request_seconds_count{method="POST",route="/v1/ingest",status="200"}')
    before = calls.get(f"{service.url}/metrics").text
    client = ReplayClient(service.url)
    client.ingest(batch_bytes("ops-m", "w", 0, ["a"] * 5, np.arange(5), routes(np.random.default_rng(90), 5)))
    bad = np.zeros((3, 48, 8), np.uint8)
    client.ingest(batch_bytes("ops-m", "w", 1, ["b"] * 3, np.arange(3), bad))
    assert calls.get(f"{service.url}/healthz").json()["status"] == "ok"
    text = calls.get(f"{service.url}/metrics").text
    assert [_metric(text, n) - _metric(before, n) for n in names] == [8.0, 3.0, 2.0]
    assert "replay_bytes_stored_total" in text
    spec = calls.get(f"{service.url}/openapi.json").json()
    for path in ("/v1/ingest", "/v1/runs/{run}/requests/{request}/routes", "/v1/runs/{run}/routes/batch",
                 "/v1/runs/{run}/expert-load", "/v1/runs/{run}/requests/{request}/finish"):
        assert path in spec["paths"]
    assert calls.get(f"{service.url}/docs").status_code == 200


def test_demo_run_has_every_flag_kind(tmp_path):
    with ServiceProcess(tmp_path / "data", demo=True) as proc:
        client = ReplayClient(proc.url)
        run = client.run("demo")
        for flag in ("ZERO", "DUPLICATE", "OUT_OF_RANGE", "STALE", "CONFLICT", "GAP", "PADDING"):
            assert run.flagged[flag] > 0, flag
            assert list(client.requests("demo", flag)), flag
        assert client.get_route("demo", "clean-00", strict=True).clean
        load = client.expert_load("demo")
        assert len(load.counts) == 48 and max(load.imbalance) > 1.5
    # Loading the demo again into the same directory stores nothing twice.
    with ServiceProcess(tmp_path / "data", demo=True, log_path=tmp_path / "again.log") as proc:
        assert ReplayClient(proc.url).run("demo").rows == run.rows
