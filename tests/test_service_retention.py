"""Deleting runs, pinning, retention and export (issue 13, item 7), through a real server.

- DELETE /v1/runs/{run} frees its rows and files; a later batch of the same id starts a fresh run.
- Delete while readers stream the same run and a writer writes it: every read is the stored data or a JSON
  404, every ingest 200 or 404, never a 5xx, and no index row outlives its run.
- Retention's size cap deletes the least recently written unpinned run (logged); `gc` does it offline;
  a pinned run stays.
- `export RUN --to FILE.parquet` reads back equal (pandas and pyarrow) to what the API serves.
"""

from __future__ import annotations

import io
import sqlite3
import subprocess
import sys
import threading
import time
import uuid

import httpx
import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format import RunShape
from replay_service.ingest.decode import decode_batch
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

SHAPE = RunShape(num_moe_layers=4, top_k=2, num_experts=16)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_service.ops.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _store(url: str, run: str, requests: int = 4, rows: int = 32, seq: int = 0, seed: int = 1) -> dict:
    """`requests` finished requests of `rows` rows each in one batch; their ids `(rows, L, K)` by request."""
    client = ReplayClient(url)
    rng = np.random.default_rng(seed)
    full = {f"r{i}": routes(rng, rows, SHAPE) for i in range(requests)}
    ids = [rid for rid in full for _ in range(rows)]
    positions = np.tile(np.arange(rows, dtype=np.int32), requests)
    experts = np.concatenate(list(full.values())).reshape(len(ids), -1)
    assert client.ingest(batch_bytes(run, "w", seq, ids, positions, experts, shape=SHAPE)).stored
    for rid in full:
        client.finish(run, rid, rows + 1)
    return full


def _runs(url: str) -> dict[str, dict]:
    return {r["run_id"]: r for r in calls.get(f"{url}/v1/runs", timeout=30).json()["runs"]}


def test_delete_frees_rows_and_files(shared_service):
    url, run, other = shared_service.url, f"del-{uuid.uuid4().hex[:6]}", f"keep-{uuid.uuid4().hex[:6]}"
    _store(url, run)
    kept = _store(url, other, seed=2)
    listed = _runs(url)[run]
    assert listed["bytes"] > 0 and listed["pinned"] is False and listed["last_write"] >= listed["created_at"]
    folder = shared_service.data_dir / "runs" / run
    assert folder.exists()

    answer = calls.delete(f"{url}/v1/runs/{run}", timeout=30)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["run_id"] == run and body["rows"] >= 1 + 4 + 1 and body["bytes"] >= listed["bytes"]
    assert not folder.exists()
    assert calls.get(f"{url}/v1/runs/{run}", timeout=30).status_code == 404
    assert calls.get(f"{url}/v1/runs/{run}/requests/r0/routes?format=npy", timeout=30).status_code == 404
    again = calls.delete(f"{url}/v1/runs/{run}", timeout=30)
    assert again.status_code == 404 and "detail" in again.json()
    assert run not in _runs(url) and other in _runs(url)
    got = np.load(io.BytesIO(calls.get(f"{url}/v1/runs/{other}/requests/r1/routes?format=npy", timeout=30).content))
    assert np.array_equal(got, kept["r1"])

    fresh = _store(url, run, requests=1, rows=5, seed=3)  # seq 0 again: a fresh run, not a duplicate
    summary = calls.get(f"{url}/v1/runs/{run}", timeout=30).json()
    assert summary["requests"] == 1 and summary["rows"] == 5
    got = np.load(io.BytesIO(calls.get(f"{url}/v1/runs/{run}/requests/r0/routes?format=npy", timeout=30).content))
    assert np.array_equal(got, fresh["r0"])


def test_pin(shared_service):
    url, run = shared_service.url, f"pin-{uuid.uuid4().hex[:6]}"
    _store(url, run, requests=1, rows=3)
    assert calls.put(f"{url}/v1/runs/{run}/pin", timeout=30).json()["pinned"] is True
    assert _runs(url)[run]["pinned"] is True
    assert calls.delete(f"{url}/v1/runs/{run}/pin", timeout=30).json()["pinned"] is False
    assert calls.put(f"{url}/v1/runs/nope-{uuid.uuid4().hex[:6]}/pin", timeout=30).status_code == 404


def test_delete_while_reading_and_writing(shared_service):
    url, run = shared_service.url, f"race-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    answers: dict[str, list] = {"read": [], "ingest": []}
    seq = iter(range(1, 1 << 30))
    stored: dict = {}

    def reader() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                rid = f"r{np.random.randint(4)}"
                r = client.get(f"{url}/v1/runs/{run}/requests/{rid}/routes?format=npy")
                ok = None
                if r.status_code == 200:
                    got = np.load(io.BytesIO(r.content))
                    ok = any(np.array_equal(got, full[rid]) for full in list(stored.values()))
                answers["read"].append((r.status_code, ok, r.headers.get("content-type")))
                if r.status_code >= 500:
                    answers.setdefault("errors", []).append(r.text)

    def writer() -> None:
        rng = np.random.default_rng(9)
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                body = batch_bytes(run, "w2", next(seq), ["x"] * 4, np.arange(4, dtype=np.int32),
                                   routes(rng, 4, SHAPE).reshape(4, -1), shape=SHAPE)
                r = client.post(f"{url}/v1/ingest", content=body,
                                headers={"content-type": "application/vnd.apache.arrow.stream"})
                answers["ingest"].append((r.status_code, r.headers.get("content-type")))
                if r.status_code >= 500:
                    answers.setdefault("errors", []).append(r.text)

    for round_ in range(6):
        stored[round_] = _store(url, run, seq=0, seed=round_)
        threads = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=writer)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        assert calls.delete(f"{url}/v1/runs/{run}", timeout=30).status_code == 200
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
        stop.clear()
        calls.delete(f"{url}/v1/runs/{run}", timeout=30)  # a batch written after the delete made a fresh run

    reads, ingests = answers["read"], answers["ingest"]
    assert reads and ingests
    assert {code for code, _, _ in reads} <= {200, 404}, answers.get("errors")
    assert all(ok for code, ok, _ in reads if code == 200)  # never garbage
    assert all(kind == "application/json" for code, _, kind in reads if code == 404)
    assert {code for code, _ in ingests} <= {200, 404}, answers.get("errors")
    print(f"reads: {len(reads)} ({sum(c == 404 for c, _, _ in reads)} 404); ingests: {len(ingests)} "
          f"({sum(c == 404 for c, _ in ingests)} 404)")
    with sqlite3.connect(f"file:{shared_service.data_dir / 'index.sqlite'}?mode=ro", uri=True) as db:
        for table in ("requests", "segments", "spans"):
            orphans = db.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id NOT IN (SELECT run_id FROM runs)")
            assert orphans.fetchone()[0] == 0, table


def test_a_read_that_named_a_deleted_segment_is_a_404_even_after_its_run_is_created_again(tmp_path):
    """The race `test_delete_while_reading_and_writing` once met: a read took a segment's path from the index, the run
    was deleted, a writer's next batch created the run again (the cache's `revive_run`), then the read opened the
    path: the file is gone, which is no damage (it answered 503 "restore it from a backup"); the index no longer names
    it, so RunDeleted (404). A segment the index still names and whose file is gone stays damage."""
    from replay_service.app import open_store
    from replay_service.errors import DamagedSegment, RunDeleted
    from replay_service.ingest.pipeline import IngestPipeline
    from replay_service.settings import ServiceSettings

    store = open_store(ServiceSettings(data_dir=tmp_path / "data"))
    pipeline = IngestPipeline.over(store)
    try:
        def ingest(seq: int) -> None:
            body = batch_bytes("again", "w", seq, ["x"] * 4, np.arange(4, dtype=np.int32),
                               routes(np.random.default_rng(seq), 4, SHAPE).reshape(4, -1), shape=SHAPE)
            pipeline.ingest(decode_batch("", body))

        ingest(0)
        (old,) = store.index.indexed_paths()
        store.delete_run("again")
        ingest(1)  # the run again, a new segment
        with pytest.raises(RunDeleted):
            store.cache.get(old)
        (new,) = store.index.indexed_paths()
        (store.segments.root / new).unlink()
        with pytest.raises(DamagedSegment):
            store.cache.get(new)
    finally:
        store.close()


def _route_read(store) -> None:
    store.read_route("again", "r")


def _trainer_slice(store) -> None:
    from replay_format.trainer_query import MegatronQuery, MissingPolicy, SequenceRef
    from replay_service.trainer.plans import SliceLimits
    from replay_service.trainer.reads import read_slice

    query = MegatronQuery(sequences=(SequenceRef("again", "r", num_tokens=4),), missing=MissingPolicy.ROUTER)
    read_slice(store, query, SliceLimits.of(store.settings))  # (ROUTER: r's flagged rows are no refusal)


def _trajectory(store) -> None:
    from replay_format.weight_versions import RecomputeRule
    from replay_service.trajectory import read_trajectory

    read_trajectory(store, "again", ["r"], RecomputeRule.FIRST, 8)


def _health(store) -> None:
    from replay_service.health.gather import run_health

    run_health(store, "again")  # its DUPLICATE finding reads r's rows for the first one (r holds two kinds)


@pytest.mark.parametrize("read", [_route_read, _trainer_slice, _trajectory, _health],
                         ids=["route", "trainer slice", "trajectory", "health"])
def test_a_read_whose_run_was_deleted_and_created_again_under_it_is_a_404_not_gap_rows(tmp_path, monkeypatch, read):
    """The race `test_delete_while_reading_and_writing` met in a whole-suite run (2026-12-03): a read took a request's
    row, then the run was deleted and a writer's next batch created it again before the read looked the run up for
    its rows; the new run's state was not deleted, the old spans were gone, and the read answered 200 with GAP rows.
    Every read of rows (a route, a trainer's slice, a trajectory, the rows a health finding points into) now checks
    the run it took before the row."""
    from replay_service.app import open_store
    from replay_service.errors import RunDeleted
    from replay_service.ingest.pipeline import IngestPipeline
    from replay_service.settings import ServiceSettings

    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        def ingest(seq: int, request: str) -> None:
            ids = routes(np.random.default_rng(seq), 4, SHAPE).reshape(4, -1)
            ids[1, 1] = ids[1, 0]  # a DUPLICATE row
            ids[2, 0] = SHAPE.num_experts  # an OUT_OF_RANGE row
            body = batch_bytes("again", "w", seq, [request] * 4, np.arange(4, dtype=np.int32), ids, shape=SHAPE)
            pipeline.ingest(decode_batch("", body))

        ingest(0, "r")
        store.finish("again", "r", 5, "finished")
        assert store.read_route("again", "r").num_rows == 4
        read(store)  # reads on the run as it is
        table, method = {_health: (store.health, "kind_requests"),  # the records each read takes in one query
                         _trainer_slice: (store, "requests_to_read")}.get(read, (store, "request_to_read"))
        took_row = getattr(table, method)

        def row_then_deleted_and_created_again(*args, **kwargs):
            row = took_row(*args, **kwargs)
            store.delete_run("again")
            ingest(1, "x")  # the writer's next batch: the run again, without request r
            return row

        monkeypatch.setattr(table, method, row_then_deleted_and_created_again)
        with pytest.raises(RunDeleted):
            read(store)
    finally:
        store.close()


def test_retention_cap_and_gc(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as probe:  # one run's size on disk, to set the cap from
        _store(probe.url, "probe")
        size = _runs(probe.url)["probe"]["bytes"]
    env = {"REPLAY_RETENTION_MAX_BYTES": str(int(size * 2.5)), "REPLAY_RETENTION_INTERVAL_S": "0.1"}
    with ServiceProcess(tmp_path / "data2", env=env) as service:
        _store(service.url, "r1")
        assert calls.put(f"{service.url}/v1/runs/r1/pin", timeout=30).status_code == 200
        _store(service.url, "r2")
        _store(service.url, "r3")
        deadline = time.monotonic() + 30
        while "r2" in _runs(service.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(_runs(service.url)) == {"r1", "r3"}
    assert "deleted run 'r2'" in service.log_path.read_text()
    assert not (tmp_path / "data2" / "runs" / "r2").exists()

    done = _cli("gc", "--data", str(tmp_path / "data2"), "--max-bytes", "1")
    assert done.returncode == 0, done.stderr
    assert "deleted run 'r3'" in done.stdout and "1 runs deleted" in done.stdout
    assert _cli("delete", "r1", "--data", str(tmp_path / "data2")).returncode == 0  # pinned: only by name
    assert _cli("delete", "r1", "--data", str(tmp_path / "data2")).returncode == 1
    with ServiceProcess(tmp_path / "data2") as service:
        assert _runs(service.url) == {}


def test_export_parquet(shared_service, tmp_path):
    pd = pytest.importorskip("pandas")
    import pyarrow.parquet as pq

    url, run = shared_service.url, f"exp-{uuid.uuid4().hex[:6]}"
    full = _store(url, run, requests=3, rows=20)
    ReplayClient(url).finish(run, "gappy", 4, status="aborted")  # 3 GAP rows
    target = tmp_path / "run.parquet"
    done = _cli("export", run, "--to", str(target), "--data", str(shared_service.data_dir))
    assert done.returncode == 0, done.stderr
    table = pq.read_table(target)
    frame = pd.read_parquet(target)
    assert table.num_rows == len(frame) == 3 * 20 + 3
    assert frame.equals(table.to_pandas())
    for rid in [*full, "gappy"]:
        api = calls.get(f"{url}/v1/runs/{run}/requests/{rid}/routes?format=json", timeout=30).json()
        rows = frame[frame["request"] == rid]
        assert rows["position"].tolist() == [r["position"] for r in api["rows"]]
        assert [bool(f) for f in rows["flags"]] == [bool(r["flags"]) for r in api["rows"]]
        experts = np.stack([np.stack(list(e)) for e in rows["experts"]])
        assert np.array_equal(experts, np.asarray([r["experts"] for r in api["rows"]]))
        if rid in full:
            assert np.array_equal(experts, full[rid])
    for module in ("duckdb", "polars"):
        try:
            lib = __import__(module)
        except ImportError:
            continue
        if module == "duckdb":
            assert lib.sql(f"SELECT COUNT(*) FROM '{target}'").fetchone()[0] == len(frame)
        else:
            assert lib.read_parquet(target).height == len(frame)
