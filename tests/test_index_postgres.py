"""The PostgreSQL index (store/index/backends/postgres.py) where only it can be shown: replicas sharing one database.

A real server (tests/support/postgres.py: initdb + pg_ctl on loopback, as `nobody` when run as root). The
contract suite runs on it too: `REPLAY_TEST_INDEX=postgresql pytest tests/<files>` gives the
`service` / `shared_service` fixtures a fresh database each.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psycopg
import pytest

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape
from replay_format.rows import Rows, RowsMeta
from replay_service.app import open_store
from replay_service.checks.check import check
from replay_service.errors import IndexTooNew, IndexUnreachable, RunDeleted
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.store.index import SCHEMA_VERSION, Index
from tests.support.data import batch_bytes, many_routes
from tests.support.service import ServiceProcess, free_port

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
SMALL = RunShape(num_moe_layers=4, top_k=2, num_experts=16)


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
            assert summary.rows == 2 * writers * per_writer * n
            assert summary.requests == writers * per_writer + 1
            assert client.request(run, "shared").rows == writers * per_writer * n  # no lost counter update
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


def test_pooled_sessions_ask_the_server_to_notice_a_lost_replica(postgres):
    """Each pooled session carries the server-side liveness settings (SERVER_LIVENESS; shown end to end by
    test_replicas.py's cut mid-commit), except where the URL's `options` set one: the operator's value wins."""
    from replay_service.store.index.backends.postgres import SERVER_LIVENESS, PostgresBackend

    def settings(url: str) -> dict[str, str]:
        backend = PostgresBackend(url)
        try:
            rows = backend.query("SELECT name, setting FROM pg_settings WHERE name = ANY(?)", (list(SERVER_LIVENESS),))
        finally:
            backend.pool.close()
        return {row["name"]: row["setting"] for row in rows}

    url = postgres.new_database()
    assert settings(url) == SERVER_LIVENESS
    assert settings(f"{url}?options=-c%20tcp_keepalives_idle%3D42") == {**SERVER_LIVENESS, "tcp_keepalives_idle": "42"}


def test_a_run_lookup_does_not_wait_behind_another_runs_index_read(postgres):
    """On a shared index every run lookup reads the run's row (store/runs.py). One that waits on the server, here held
    inside its read of run `slow` as a slow or cut-off server holds it, no longer holds the registry's lock: another
    run's lookup and a batch's (`for_batch`) go on meanwhile. Before, they queued behind it, and a replica cut off
    its index answered its 503s one pool wait after another (~7 s each, in turn)."""
    from replay_service.store.runs import RunRegistry

    shape = RunShape(num_moe_layers=2, top_k=2, num_experts=8)
    index = Index(postgres.new_database())
    release = threading.Event()
    try:
        for run in ("slow", "other"):
            index.register_run(run, shape, "test", time.time())
        registry = RunRegistry(index)
        entered = threading.Event()
        server_read = index.run

        def held_read(run_id: str):
            if run_id == "slow":
                entered.set()
                release.wait(120)
            return server_read(run_id)

        index.run = held_read  # type: ignore[method-assign]
        with ThreadPoolExecutor(3) as pool:
            slow = pool.submit(registry.get, "slow")
            assert entered.wait(30)
            other = pool.submit(registry.get, "other")
            batch = pool.submit(registry.for_batch, RowsMeta("other", "w0", 0, shape))
            try:
                done = [f.result(timeout=30) for f in (other, batch)]  # a hang guard: before, both waited for `slow`
            except TimeoutError:
                done = []
            finally:
                release.set()
            assert [state.run_id for state in done] == ["other", "other"]
            assert done[0] is done[1]  # one state per run: its commit lock is one
            assert slow.result(timeout=60).run_id == "slow"
    finally:
        release.set()
        index.close()


def test_a_row_read_before_a_change_does_not_undo_it(postgres):
    """Lookups read without the registry's lock, so a row read before a run was created or widened may arrive after
    (store/runs.py): applied then, a stale "no such run" would mark the new run's state deleted under its first batch,
    and a stale layer count would narrow the run's reads again. Reads are applied in the order they started."""
    from replay_service.store.runs import RunRegistry

    narrow = RunShape(num_moe_layers=2, top_k=2, num_experts=8, moe_layers=(0, 1))  # its layer count derived: 2
    wide = RunShape(num_moe_layers=2, top_k=2, num_experts=8, moe_layers=(0, 1), num_hidden_layers=4)
    index = Index(postgres.new_database())
    release = threading.Event()
    try:
        index.register_run("grows", narrow, "test", time.time())
        registry = RunRegistry(index)
        registry.get("grows")  # kept, with the derived count
        read_once = threading.Event()
        read_done = threading.Event()
        server_read = index.run

        def stale_read(run_id: str):
            row = server_read(run_id)  # the row as it is now, handed back only later
            if not read_once.is_set():
                read_once.set()
                read_done.set()
                release.wait(120)
            return row

        index.run = stale_read  # type: ignore[method-assign]
        with ThreadPoolExecutor(2) as pool:
            # a read of a run that does not exist yet, and one of `grows` before it widens: both held after reading
            new_run = pool.submit(registry.get, "new")
            assert read_done.wait(30)
            state = registry.for_batch(RowsMeta("new", "w0", 0, narrow))  # created meanwhile
            release.set()
            assert new_run.result(timeout=60) is state  # the later read's state, not "gone"
            assert not state.deleted and registry.get("new") is state

            read_once.clear()
            read_done.clear()
            release.clear()
            old_grows = pool.submit(registry.get, "grows")
            assert read_done.wait(30)
            widened = registry.for_batch(RowsMeta("grows", "w0", 0, wide))  # learns 4 layers meanwhile
            assert widened.shape.num_hidden_layers == 4
            release.set()
            assert old_grows.result(timeout=60).shape.num_hidden_layers == 4  # not narrowed back to 2
            assert widened.shape.num_hidden_layers == 4
    finally:
        release.set()
        index.close()


def expected_load(experts: list[np.ndarray], layers: int = 48, num_experts: int = 128) -> np.ndarray:
    """Expert counts of clean rows `(n, layers, top_k)`: what GET /expert-load must answer."""
    load = np.zeros((layers, num_experts), np.int64)
    for ex in experts:
        for layer in range(layers):
            load[layer] += np.bincount(ex[:, layer].reshape(-1), minlength=num_experts)
    return load


def test_expert_load_is_exact_on_every_replica(tmp_path, postgres_url):
    """Writers spread over two replicas ingest disjoint batches of one run at once: each replica's expert load is
    the index's (the sum over every batch), not the batches it took itself."""
    run, writers, per_writer, n = "load", 6, 4, 24
    rng = np.random.default_rng(11)
    sent = {(w, seq): many_routes(rng, n) for w in range(writers) for seq in range(per_writer)}
    env = {"REPLAY_INDEX_URL": postgres_url}
    with ServiceProcess(tmp_path / "data", env=env) as a, ServiceProcess(tmp_path / "data", env=env) as b:
        replicas = (a, b)
        go = threading.Barrier(writers)
        codes: dict = {}

        def send(w: int) -> None:
            with httpx.Client(base_url=replicas[w % 2].url, timeout=60) as http:
                go.wait()
                for seq in range(per_writer):
                    body = batch_bytes(run, f"w{w}", seq, [f"w{w}-s{seq}"] * n, np.arange(n), sent[(w, seq)])
                    codes[(w, seq)] = http.post("/v1/ingest", content=body, headers=ARROW).status_code

        threads = [threading.Thread(target=send, args=(w,)) for w in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(codes.values()) == {200}
        want = expected_load(list(sent.values()))
        for replica in replicas:
            load = ReplayClient(replica.url).expert_load(run)
            assert np.array_equal(np.array(load.counts), want)
            assert load.rows == writers * per_writer * n


def test_a_run_deleted_on_one_replica_is_gone_on_the_other(tmp_path, postgres_url):
    """Replica B knew the run; A deletes it: B answers 404 for it at once, and B's next batch of that id starts a
    fresh run (of another shape even), seen by A too."""
    run, n = "gone", 16
    rng = np.random.default_rng(3)
    first, again = many_routes(rng, n), many_routes(rng, n, SMALL)
    env = {"REPLAY_INDEX_URL": postgres_url}
    with ServiceProcess(tmp_path / "data", env=env) as a, ServiceProcess(tmp_path / "data", env=env) as b:
        with httpx.Client(base_url=b.url, timeout=60) as on_b, httpx.Client(base_url=a.url, timeout=60) as on_a:
            assert on_b.post("/v1/ingest", content=batch_bytes(run, "w", 0, ["r"] * n, np.arange(n), first),
                             headers=ARROW).status_code == 200
            assert on_b.get(f"/v1/runs/{run}/expert-load").status_code == 200  # B holds the run's state
            assert on_a.delete(f"/v1/runs/{run}").status_code == 200
            for path in (f"/v1/runs/{run}", f"/v1/runs/{run}/expert-load", f"/v1/runs/{run}/requests/r/routes"):
                gone = on_b.get(path)
                assert gone.status_code == 404 and "not found" in gone.json()["detail"], path
            body = batch_bytes(run, "w", 0, ["r2"] * n, np.arange(n), again, shape=SMALL)
            answer = on_b.post("/v1/ingest", content=body, headers=ARROW)
            assert answer.status_code == 200 and answer.json()["duplicate"] is False  # a fresh run: seq 0 is new
        for replica in (a, b):
            client = ReplayClient(replica.url)
            assert client.run(run).rows == n
            assert client.get_route(run, "r2", strict=True).experts.tobytes() == again.tobytes()
            assert np.array_equal(np.array(client.expert_load(run).counts), expected_load([again], 4, 16))


def test_a_batch_in_flight_when_another_replica_deletes_its_run(tmp_path, postgres_url):
    """A batch whose run another replica deletes between its shape check and its commit: a clear 404
    (RunDeleted), nothing kept; the next batch of that id on the same replica starts a fresh run."""
    a, b = (open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False, index_url=postgres_url))
            for _ in range(2))  # two replicas on one index and one directory
    pipeline = IngestPipeline.over(b)  # B's
    try:
        rng = np.random.default_rng(4)

        def rows(seq: int, first: int, experts: np.ndarray) -> Rows:  # one request "r", positions first..first+7
            return Rows(RowsMeta("race", "w", seq, SMALL), ["r"], np.zeros(8, np.int32),
                        np.arange(first, first + 8, dtype=np.int32), np.arange(8, dtype=np.int32),
                        experts.reshape(8, -1), np.zeros(8, np.uint16))

        pipeline.ingest(rows(0, 0, many_routes(rng, 8, SMALL)))
        late = rows(1, 8, many_routes(rng, 8, SMALL))
        state = b.registry.for_batch(late.meta)  # B's pipeline, up to the commit
        segment = pipeline.segments.write(check(late, state.shape))
        a.delete_run("race")  # another replica
        with pytest.raises(RunDeleted, match="deleted while this batch was"):  # its folder went, or its run row
            pipeline.committer.commit(segment, state)
        assert not b.has_run("race")
        fresh = many_routes(rng, 8, SMALL)
        assert pipeline.ingest(rows(1, 0, fresh)).stored
        assert a.read_route("race", "r").experts.tobytes() == b.read_route("race", "r").experts.tobytes()
        assert b.read_route("race", "r").experts.tobytes() == fresh.reshape(8, -1).tobytes()
        assert a.run_summary("race").rows == 8
    finally:
        pipeline.close()
        a.close()
        b.close()


def test_once_the_index_is_found_gone_calls_ask_the_server_instead_of_waiting_on_the_pool(monkeypatch):
    """The first call of an outage waits the pool's POOL_WAIT_S, then finds the server gone (IndexUnreachable). From
    then on a call asks the server directly before it waits on the pool: refused at once, it answers
    IndexUnreachable at once; once the server is back the first call goes on at once on a fresh pool. Before, every
    call of the outage waited out the pool's wait, and so did the first call after it (the pool backing off).
    The later waits are an hour here: a call that waits on the pool does not answer within the test."""
    from replay_service.store.index.backends import postgres
    from tests.support.postgres import Cluster

    def answer(call):  # what `call` answers or raises, or "no answer" while it still waits (a daemon thread)
        box: list = []

        def run() -> None:
            try:
                box.append(call())
            except Exception as exc:  # noqa: BLE001 - the answer under test
                box.append(exc)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(60)
        return box[0] if box else "no answer"

    cluster = Cluster()  # its own: stopping it must not touch the session's
    try:
        monkeypatch.setattr(postgres, "POOL_WAIT_S", 1)
        backend = postgres.PostgresBackend(cluster.url())
        assert backend.query("SELECT 1 AS one") == [{"one": 1}]
        cluster.stop()
        assert isinstance(answer(lambda: backend.query("SELECT 1 AS one")), IndexUnreachable)  # one pool wait
        monkeypatch.setattr(postgres, "POOL_WAIT_S", 3600)
        backend.pool.timeout = 3600
        for _ in range(3):
            assert isinstance(answer(lambda: backend.query("SELECT 1 AS one")), IndexUnreachable)
        cluster.start()
        assert answer(lambda: backend.query("SELECT 1 AS one")) == [{"one": 1}]
        assert answer(lambda: backend.query("SELECT 2 AS two")) == [{"two": 2}]
    finally:
        cluster.close()


def test_a_replica_that_loses_its_index_answers_503_and_recovers(tmp_path):
    """The PostgreSQL server stops under a serving replica: reads and ingests answer 503 naming the index (never
    rows without it); once the server is back on its port the same process serves again, without a restart."""
    from tests.support.postgres import Cluster

    cluster = Cluster()  # its own: stopping it must not touch the session's
    try:
        rng = np.random.default_rng(9)
        first, second = many_routes(rng, 16), many_routes(rng, 16)
        with ServiceProcess(tmp_path / "data", env={"REPLAY_INDEX_URL": cluster.new_database()}) as replica, \
                httpx.Client(base_url=replica.url, timeout=120) as http:
            assert http.post("/v1/ingest", content=batch_bytes("lost", "w", 0, ["r"] * 16, np.arange(16), first),
                             headers=ARROW).status_code == 200
            cluster.stop()
            answers = [http.get("/v1/runs/lost/requests/r/routes"), http.get("/v1/runs/lost/expert-load"),
                       http.get("/v1/runs/lost"), http.get("/v1/runs"),
                       http.post("/v1/ingest", content=batch_bytes("lost", "w", 1, ["r"] * 16, np.arange(16, 32),
                                                                   second), headers=ARROW)]
            for answer in answers:
                assert answer.status_code == 503, (answer.request.url, answer.text)
                assert "REPLAY_INDEX_URL" in answer.json()["detail"]
            cluster.start()
            again = http.post("/v1/ingest", content=batch_bytes("lost", "w", 1, ["r"] * 16, np.arange(16, 32), second),
                              headers=ARROW)
            assert again.status_code == 200, again.text
            assert again.json()["duplicate"] is False  # the refused batch was not stored
            assert http.post("/v1/ingest", content=batch_bytes("lost", "w", 1, ["r"] * 16, np.arange(16, 32), second),
                             headers=ARROW).json()["duplicate"] is True
            client = ReplayClient(replica.url)
            route = client.get_route("lost", "r", strict=True)
            assert route.experts.tobytes() == np.concatenate([first, second]).tobytes()
            assert np.array_equal(np.array(client.expert_load("lost").counts), expected_load([first, second]))
    finally:
        cluster.close()


def test_a_schema_5_database_is_migrated_and_its_rows_read_as_version_unknown(tmp_path, postgres):
    """A database a release before weight versions left (schema 5: no recompute columns, no version tables) is
    brought to the current schema on start; its rows read as version unknown, and new rows' versions and
    recomputes are kept beside them."""
    from replay_format.rows import build_rows, encode_stream
    from replay_format.weight_versions import WeightVersions

    url = postgres.new_database()
    env = {"REPLAY_INDEX_URL": url}
    rng = np.random.default_rng(23)
    old, v1, v2 = many_routes(rng, 8), many_routes(rng, 8), many_routes(rng, 8)
    with ServiceProcess(tmp_path / "data", env=env) as service:
        ReplayClient(service.url).ingest(batch_bytes("pg5", "w", 0, ["r"] * 8, np.arange(8), old))
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in ("ALTER TABLE requests DROP COLUMN recomputed",
                          "ALTER TABLE requests DROP COLUMN first_recomputed",
                          "DROP TABLE version_spans", "DROP TABLE run_versions",
                          "UPDATE schema_version SET version = 5"):
            conn.execute(statement)
    with ServiceProcess(tmp_path / "data", env=env) as service:
        client = ReplayClient(service.url)
        summary = client.request("pg5", "r")
        assert (summary.rows, summary.weight_versions, summary.recomputed) == (8, (), 0)
        assert client.get_route("pg5", "r").versions().per_row() == [None] * 8
        for seq, (ex, label) in enumerate(((v1, "v1"), (v2, "v2")), start=1):
            batch = build_rows(RowsMeta("pg5", "w", seq, RunShape(48, 8, 128)), ["s"] * 8, np.arange(8), ex,
                               weight_versions=WeightVersions.single(label, 8))
            client.ingest(encode_stream(batch))
        summary = client.request("pg5", "s")
        assert (summary.recomputed, summary.first_recomputed, summary.flagged["CONFLICT"]) == (8, 0, 0)
        assert [s.to_json() for s in summary.weight_versions] == [{"version": "v1", "start": 0, "end": 8}]
        assert client.get_route("pg5", "s", recompute="latest").versions().per_row() == ["v2"] * 8
        assert [v.raw for v in client.run("pg5").weight_versions] == [{"version": "v1", "rows": 8},
                                                                     {"version": None, "rows": 8}]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
