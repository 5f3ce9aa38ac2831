"""The PostgreSQL index (store/index_backends/postgres.py) where only it can be shown: replicas sharing one database.

A real server (tests/support/postgres.py: initdb + pg_ctl on loopback, as `nobody` when run as root). The
contract suite runs on it too: `REPLAY_TEST_INDEX=postgresql pytest tests/<files>` gives the
`service` / `shared_service` fixtures a fresh database each.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import psycopg
import pytest

from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_service.client import ReplayClient
from replay_service.errors import IndexTooNew, IndexUnreachable
from replay_service.store.index import SCHEMA_VERSION, Index
from tests.support.data import batch_bytes, many_routes
from tests.support.service import ServiceProcess, free_port

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


def test_two_replicas_ingest_one_run_at_once(tmp_path, postgres_url):
    """Two services on one database: every batch sent to both at once (a retry racing its original on the
    other replica) is stored once, and the shared request's counters are exact."""
    run, writers, per_writer, n = "replicas", 6, 4, 32
    rng = np.random.default_rng(5)
    bodies, own = {}, {}
    shared_parts = []
    for w in range(writers):
        for seq in range(per_writer):
            mine, common = many_routes(rng, n), many_routes(rng, n)
            first = (w * per_writer + seq) * n  # each batch holds its own positions of the shared request
            own[f"w{w}-s{seq}"] = mine
            shared_parts.append((first, common))
            bodies[(w, seq)] = batch_bytes(run, f"w{w}", seq, [f"w{w}-s{seq}"] * n + ["shared"] * n,
                                           np.concatenate([np.arange(n), np.arange(first, first + n)]),
                                           np.concatenate([mine, common]))
    shared = np.concatenate([c for _, c in sorted(shared_parts, key=lambda p: p[0])])
    env = {"REPLAY_INDEX_URL": postgres_url}
    data = tmp_path / "data"
    answers: dict = {}
    with ServiceProcess(data, env=env) as a, ServiceProcess(data, env=env) as b:
        go = threading.Barrier(2 * writers)

        def send(url: str, w: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                go.wait()
                for seq in range(per_writer):
                    answer = http.post("/v1/ingest", content=bodies[(w, seq)], headers=ARROW)
                    answers[(url, w, seq)] = (answer.status_code, answer.json().get("duplicate"))

        threads = [threading.Thread(target=send, args=(url, w)) for w in range(writers) for url in (a.url, b.url)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for w in range(writers):
            for seq in range(per_writer):
                (code_a, dup_a), (code_b, dup_b) = answers[(a.url, w, seq)], answers[(b.url, w, seq)]
                assert (code_a, code_b) == (200, 200)
                assert sorted([dup_a, dup_b]) == [False, True], (w, seq)  # stored once, the other a duplicate
        with psycopg.connect(postgres_url) as conn:
            stored = conn.execute("SELECT COUNT(*) FROM segments WHERE run_id = %s", (run,)).fetchone()
        assert stored == (writers * per_writer,)
        for replica in (a, b):
            client = ReplayClient(replica.url)
            summary = client.run(run)
            assert summary["rows"] == 2 * writers * per_writer * n
            assert summary["requests"] == writers * per_writer + 1
            assert client.request(run, "shared")["rows"] == writers * per_writer * n  # no lost counter update
            assert client.get_route(run, "shared", strict=True).experts.tobytes() == shared.tobytes()
            for request, experts in own.items():
                assert client.get_route(run, request, strict=True).experts.tobytes() == experts.tobytes()
        assert not (data / "index.sqlite").exists()  # the index is the database's


def test_a_replica_that_cannot_reach_its_index_refuses_to_start(tmp_path):
    url = f"postgresql://replay@127.0.0.1:{free_port()}/nothing"  # nothing listens there
    with pytest.raises(IndexUnreachable, match="REPLAY_INDEX_URL"):
        Index(url)
    with pytest.raises(RuntimeError, match="REPLAY_INDEX_URL") as refused:
        ServiceProcess(tmp_path / "data", env={"REPLAY_INDEX_URL": url}).start()
    assert "exited with 2" in str(refused.value)


def test_a_newer_schema_is_refused(postgres):
    url = postgres.new_database()
    Index(url).close()  # created at SCHEMA_VERSION
    Index(url).close()  # and opened again as it is
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(IndexTooNew, match=f"schema {SCHEMA_VERSION + 1}"):
        Index(url)


def test_a_password_is_not_repeated_in_the_refusal():
    url = f"postgresql://replay:s3cret@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(IndexUnreachable) as refused:
        Index(url)
    assert "s3cret" not in refused.value.message
