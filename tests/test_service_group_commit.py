"""Group commit (ingest/commit.py): many batches per index transaction, each failure answered to its own batch.

A group is formed deterministically in process: the test holds a run's commit lock, so the first batch's
leader waits on it while the others queue; released, the next leader commits the whole queue as one group.
Over HTTP, many writers at once (groups form as they will) and a kill -9 during such a stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import numpy as np

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_format.rows import Rows, RowsMeta
from replay_service.app import open_store
from replay_service.errors import Conflict, Forbidden, RunDeleted
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ingest.result import IngestOutcome
from replay_service.ownership import Actor, acting
from replay_service.settings import ServiceSettings
from tests.support.data import QWEN3_SHAPE, batch_bytes, many_routes, routes
from tests.support.service import ServiceProcess

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


def _rows(run: str, writer: str, seq: int, request: str, experts: np.ndarray) -> Rows:
    n = len(experts)
    return Rows(RowsMeta(run, writer, seq, QWEN3_SHAPE), [request], np.zeros(n, np.int32),
                np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32), experts.reshape(n, -1),
                np.zeros(n, np.uint16))


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.002)


def test_one_group_keeps_its_good_batches_and_answers_each_failure_to_its_batch(tmp_path):
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=True))  # fsync: folders synced per group
    pipeline = IngestPipeline.over(store)
    rng = np.random.default_rng(7)
    owner_a, owner_b = Actor("writer-a", admin=False), Actor("writer-b", admin=False)
    sent = {name: routes(rng, 16) for name in ("first", "owned", "lead", "g1", "g2", "c1", "c2", "late", "gone")}
    token = acting.set(owner_a)
    try:
        pipeline.ingest(_rows("run", "wa", 0, "owned", sent["owned"]))  # writer-a owns request "owned"
    finally:
        acting.reset(token)
    pipeline.ingest(_rows("run", "w", 0, "first", sent["first"]))
    pipeline.ingest(_rows("gone", "w", 0, "first", sent["first"]))
    committer = pipeline.committer
    answers: dict[str, object] = {}

    def send(name: str, rows: Rows, actor: Actor | None = None) -> threading.Thread:
        def go() -> None:
            acting.set(actor)  # this thread's context: the batch's writer
            try:
                answers[name] = pipeline.ingest(rows).outcome
            except Exception as exc:  # the answer to this batch
                answers[name] = exc
        thread = threading.Thread(target=go)
        thread.start()
        return thread

    run_lock = store.registry.require("run").lock
    run_lock.acquire()  # the first leader waits on it with its one batch; the rest queue behind it
    threads = [send("lead", _rows("run", "w", 1, "lead", sent["lead"]))]
    _until(lambda: committer._leading and not committer._queue, "the first batch leads a commit")
    queued = [
        ("g1", _rows("run", "w", 2, "g1", sent["g1"]), None),
        ("g2", _rows("run", "w2", 0, "g2", sent["g2"]), None),
        ("retry", _rows("run", "w", 2, "g1", sent["g1"]), None),  # a concurrent retry of g1: same group
        ("c1", _rows("run", "wc", 0, "c1", sent["c1"]), None),  # the same (writer, seq), other rows: one Conflict
        ("c2", _rows("run", "wc", 0, "c1", sent["c2"]), None),
        ("forbidden", _rows("run", "wb", 0, "owned", sent["late"]), owner_b),  # writer-a's request: 403
        ("mine", _rows("run", "wa", 1, "late", sent["late"]), owner_a),
        ("gone", _rows("gone", "w", 1, "second", sent["gone"]), None),  # its run is deleted while it waits
    ]
    for name, rows, actor in queued:
        threads.append(send(name, rows, actor))
    _until(lambda: len(committer._queue) == len(queued), "every batch queued behind the leader: one group")
    store.delete_run("gone")
    run_lock.release()
    for thread in threads:
        thread.join()

    assert answers["lead"] == answers["g2"] == answers["mine"] == IngestOutcome.STORED
    assert sorted([answers["g1"], answers["retry"]]) == [IngestOutcome.DUPLICATE, IngestOutcome.STORED]
    kept, refused = ("c1", "c2") if answers["c1"] == IngestOutcome.STORED else ("c2", "c1")
    assert answers[kept] == IngestOutcome.STORED and isinstance(answers[refused], Conflict), answers
    assert isinstance(answers["forbidden"], Forbidden), answers["forbidden"]
    assert isinstance(answers["gone"], RunDeleted), answers["gone"]

    def stored(request: str) -> bytes:
        return store.read_route("run", request).experts.tobytes()

    for request in ("first", "lead", "g1", "g2", "late"):
        assert stored(request) == sent[request].reshape(16, -1).tobytes()
    assert stored("c1") == sent[kept].reshape(16, -1).tobytes()
    assert stored("owned") == sent["owned"].reshape(16, -1).tobytes()  # the refused batch left nothing
    assert store.request_summary("run", "owned").rows == 16
    assert not store.has_run("gone")
    # Only the stored batches' segments remain (failed and duplicate ones were deleted), no temp file.
    files = list((tmp_path / "data" / "runs" / "run").glob("*.arrow*"))
    assert len(files) == 7  # owned, first, lead, g1, g2, the kept c, late
    load = store.expert_load("run")[1].copy()
    store.close()
    again = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    try:
        assert np.array_equal(again.expert_load("run")[1], load)  # memory and index agree after the group
    finally:
        again.close()


def test_many_writers_at_once_through_the_service(shared_service):
    rng = np.random.default_rng(11)
    run, writers, per_writer, n = "group-http", 8, 3, 64
    bodies, expected = {}, {}
    for w in range(writers):
        for seq in range(per_writer):
            ex = many_routes(rng, n)
            request = f"w{w}-s{seq}"
            expected[request] = ex
            bodies[(w, seq)] = batch_bytes(run, f"w{w}", seq, [request] * n, np.arange(n), ex)
    reused = batch_bytes(run, "w0", 0, ["w0-s0"] * n, np.arange(n), many_routes(rng, n))  # seq 0 again, other rows
    answers: dict = {}
    go = threading.Barrier(writers)

    def writer(w: int) -> None:
        with httpx.Client(base_url=shared_service.url, timeout=60) as http:
            go.wait()
            for seq in range(per_writer):
                answers[(w, seq)] = http.post("/v1/ingest", content=bodies[(w, seq)], headers=ARROW).status_code
                if w % 3 == 0:  # a retry of the batch just sent, while others commit
                    answers[(w, seq, "retry")] = http.post("/v1/ingest", content=bodies[(w, seq)],
                                                           headers=ARROW).json()["duplicate"]
            if w == 1:
                answers["reused"] = http.post("/v1/ingest", content=reused, headers=ARROW).status_code

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(answers[(w, s)] == 200 for w in range(writers) for s in range(per_writer))
    assert all(answers[(w, s, "retry")] for w in range(0, writers, 3) for s in range(per_writer))
    assert answers["reused"] == 409
    client = ReplayClient(shared_service.url)
    summary = client.run(run)
    assert summary.rows == writers * per_writer * n and summary.requests == writers * per_writer
    for request, ex in expected.items():
        assert client.get_route(run, request, strict=True).experts.tobytes() == ex.tobytes()


def _stream(url: str, bodies: list[bytes], acked: list, key: int) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        for seq, body in enumerate(bodies):
            try:
                answer = http.post("/v1/ingest", content=body, headers=ARROW)
            except httpx.HTTPError:
                return  # the server died mid-request: not acknowledged
            if answer.status_code == 200:
                acked.append((key, seq))


def test_kill9_during_concurrent_ingests_loses_no_acknowledged_batch(tmp_path):
    writers = 8
    rng = np.random.default_rng(3)
    n, per_writer = 1024, 30  # small batches from many writers: groups of several batches are committing
    bodies = {w: [] for w in range(writers)}
    expected = {}
    for w in range(writers):
        for seq in range(per_writer):
            ex = many_routes(rng, n)
            expected[(w, seq)] = ex
            bodies[w].append(batch_bytes("crash", f"w{w}", seq, [f"w{w}-s{seq}"] * n, np.arange(n), ex))
    data = tmp_path / "data"
    proc = ServiceProcess(data).start()
    acked: list = []
    threads = [threading.Thread(target=_stream, args=(proc.url, bodies[w], acked, w)) for w in range(writers)]
    for thread in threads:
        thread.start()
    _until(lambda: len(acked) >= 3 * writers, "some batches acknowledged")
    proc.kill9()
    for thread in threads:
        thread.join()
    acknowledged = set(acked)
    assert len(acknowledged) < writers * per_writer
    with ServiceProcess(data, log_path=tmp_path / "restart.log") as again:
        client = ReplayClient(again.url)
        for w, seq in acknowledged:
            route = client.get_route("crash", f"w{w}-s{seq}", strict=True)
            assert route.experts.tobytes() == expected[(w, seq)].tobytes(), f"acknowledged batch {(w, seq)} changed"
        for w in bodies:  # writers resume; retries are idempotent
            for body in bodies[w]:
                client.ingest(body)
        assert client.run("crash").rows == writers * per_writer * n
