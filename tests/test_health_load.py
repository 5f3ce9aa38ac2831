"""Run health over ingest time and per weight version, through a real server: each bucket's rows and flags are
the ones ingested then, and each imbalance is the one numpy computes from the clean rows' expert counts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_service.health.series import imbalance
from replay_service.store.index import SCHEMA_VERSION
from tests.support.service import ServiceProcess, calls

L, K, E = 4, 4, 16
BUCKET_S = 1.0


def skewed(rng: np.random.Generator, n: int, hot: int) -> np.ndarray:
    """n rows whose first choice is expert `hot` in every layer (a load imbalance), the rest random."""
    scores = rng.random((n, L, E))
    scores[..., hot] += 10
    return np.argsort(-scores, axis=-1)[..., :K].astype(np.uint8)


def load_of(rows: np.ndarray) -> np.ndarray:
    """(L, E) expert counts of rows (n, L, K)."""
    return np.stack([np.bincount(rows[:, layer].ravel(), minlength=E) for layer in range(L)])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("health-load") / "data",
                        env={"REPLAY_HEALTH_BUCKET_S": str(BUCKET_S)}) as svc:
        yield svc


def wait_for_next_bucket() -> None:
    """Sleep into the next ingest-time bucket (the buckets are whole multiples of BUCKET_S since the epoch)."""
    now = time.time()
    time.sleep((now // BUCKET_S + 1) * BUCKET_S - now + 0.05)


def test_buckets_and_versions_count_what_was_ingested(service):
    rng = np.random.default_rng(24)
    client = ReplayClient(service.url)
    sent: list[tuple[int, int, np.ndarray]] = []  # (rows, zero rows, clean rows) per bucket
    by_version: dict[str, list[np.ndarray]] = {"1": [], "2": []}
    for wave, (version, hot, zeros) in enumerate([("1", 0, 0), ("1", 3, 2), ("2", 7, 1)]):
        wait_for_next_bucket()
        rows = skewed(rng, 40, hot)
        rows[:zeros] = 0  # a layer never written: all-zero rows (ZERO, never counted in the load)
        client.upload_route("load", f"req-{wave}", rows, num_experts=E, weight_version=version)
        sent.append((40, zeros, rows[zeros:]))
        by_version[version].append(rows[zeros:])

    series = calls.get(f"{service.url}/v1/runs/load/health/series").raise_for_status().json()
    assert series["bucket_s"] == BUCKET_S
    points = series["ingest"]
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    assert [(p["rows"], p["flagged"]["ZERO"]) for p in points] == [(n, z) for n, z, _ in sent]
    for point, (_, _, clean) in zip(points, sent, strict=True):
        mean, worst = imbalance(load_of(clean))
        assert point["imbalance"] == pytest.approx(mean) and point["imbalance_max"] == pytest.approx(worst)
        assert point["imbalance"] > 2.0  # one hot expert per layer: far from even

    versions = series["versions"]
    assert [v["version"] for v in versions] == ["1", "2"]
    for point in versions:
        clean = np.concatenate(by_version[point["version"]])
        mean, worst = imbalance(load_of(clean))
        assert point["imbalance"] == pytest.approx(mean) and point["imbalance_max"] == pytest.approx(worst)
    assert [v["rows"] for v in versions] == [80, 40]

    # A whole-life report and one over a window that holds only the last wave's request.
    report = calls.get(f"{service.url}/v1/runs/load/health").json()
    assert report["verdict"] == "fail" and report["checks"]["ZERO"]["count"] == 3
    assert report["weight_versions"]["current"] == "2" and report["weight_versions"]["stale_rows"] == 80
    assert report["weight_versions"]["max_lag"] == 1
    time.sleep(1.5)
    client.upload_route("load", "late", skewed(rng, 20, 1), num_experts=E, weight_version="2")
    recent = calls.get(f"{service.url}/v1/runs/load/health", params={"window_s": 1.0}).json()
    assert recent["requests"] == 1 and recent["verdict"] == "ok" and recent["window_s"] == 1.0


def test_a_batch_judged_against_the_version_it_trains(service):
    client = ReplayClient(service.url)
    rng = np.random.default_rng(5)
    client.upload_route("versions", "old", skewed(rng, 10, 0), num_experts=E, weight_version="3")
    client.upload_route("versions", "new", skewed(rng, 10, 0), num_experts=E, weight_version="5")
    batch = calls.post(f"{service.url}/v1/runs/versions/health",
                       json={"requests": ["old", "new"], "weight_version": "6"}).json()
    assert batch["weight_versions"] == {"current": "6", "rows": {"3": 10, "5": 10}, "unversioned": 0,
                                        "stale_rows": 20, "max_lag": 3}
    assert batch["metrics"]["r3/version_stale_frac"] == 1.0 and batch["metrics"]["r3/version_max_lag"] == 3.0
    assert batch["verdict"] == "ok"  # no default limit: asynchronous RL trains on older versions on purpose
    # A run that gates on it sets a limit: then the same batch fails, naming STALENESS.
    calls.put(f"{service.url}/v1/runs/versions/health/thresholds",
              json={"STALENESS": {"fail": 0.5}}).raise_for_status()
    again = calls.post(f"{service.url}/v1/runs/versions/health",
                       json={"requests": ["old", "new"], "weight_version": "6"}).json()
    assert again["verdict"] == "fail" and [f["check"] for f in again["failed"]] == ["STALENESS"]
    assert again["failed"][0]["limit"] == 0.5


def test_an_index_of_schema_6_is_migrated_and_its_requests_are_judged(tmp_path):
    """An index a release before run health left (no requests.last_write nor unclean, no health tables) is brought
    to the current schema on start: its requests count in a whole-life report (their flags from the request
    counters), never in a window (their last write is unknown); new rows are counted in both."""
    import sqlite3

    data = tmp_path / "data"
    rng = np.random.default_rng(6)
    old = skewed(rng, 12, 0)
    old[4] = 0
    with ServiceProcess(data) as svc:
        ReplayClient(svc.url).upload_route("old", "r", old, num_experts=E)
    with sqlite3.connect(data / "index.sqlite") as conn:  # as the release before this one left it
        conn.executescript("""
            DROP INDEX requests_by_write;
            ALTER TABLE requests DROP COLUMN last_write;
            ALTER TABLE requests DROP COLUMN unclean;
            DROP TABLE health_ticks;
            DROP TABLE version_load;
            DROP TABLE health_thresholds;
            PRAGMA user_version = 6;
        """)
    with ServiceProcess(data) as svc:
        report = calls.get(f"{svc.url}/v1/runs/old/health").json()
        assert report["verdict"] == "fail" and [f["check"] for f in report["failed"]] == ["ZERO", "FALLBACK"]
        for finding in report["failed"]:
            assert finding["requests"] == [{"request_id": "r", "count": 1, "first_position": 4}]
        assert calls.get(f"{svc.url}/v1/runs/old/health", params={"window_s": 3600}).json()["requests"] == 0
        assert calls.get(f"{svc.url}/v1/runs/old/health/series").json()["ingest"] == []
        ReplayClient(svc.url).upload_route("old", "s", skewed(rng, 12, 0), num_experts=E)
        recent = calls.get(f"{svc.url}/v1/runs/old/health", params={"window_s": 3600}).json()
        assert recent["requests"] == 1 and recent["verdict"] == "ok"
        assert [p["rows"] for p in calls.get(f"{svc.url}/v1/runs/old/health/series").json()["ingest"]] == [12]
    with sqlite3.connect(data / "index.sqlite") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_deleted_run_takes_its_health_with_it(service):
    """Deleting a run deletes its buckets, per-version loads and threshold overrides: a run started again under
    the same id begins with none of them."""
    client = ReplayClient(service.url)
    rng = np.random.default_rng(8)
    bad = skewed(rng, 10, 0)
    bad[2] = 0
    client.upload_route("again", "a", bad, num_experts=E, weight_version="1")
    calls.put(f"{service.url}/v1/runs/again/health/thresholds", json={"ZERO": {"fail": 0.9}}).raise_for_status()
    calls.delete(f"{service.url}/v1/runs/again").raise_for_status()
    assert calls.get(f"{service.url}/v1/runs/again/health").status_code == 404
    client.upload_route("again", "b", skewed(rng, 10, 0), num_experts=E)
    series = calls.get(f"{service.url}/v1/runs/again/health/series").json()
    assert [(p["rows"], p["flagged"]["ZERO"]) for p in series["ingest"]] == [(10, 0)] and series["versions"] == []
    assert calls.get(f"{service.url}/v1/runs/again/health/thresholds").json()["overridden"] == []
