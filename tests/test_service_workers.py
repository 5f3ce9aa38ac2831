"""`replay-service serve` with several worker processes over one index and one segment store (issue 27, "Every
core"): real servers, each connection pinned to a known worker by asking it `/healthz` (its `pid`).

- every round trip byte-equal whichever worker stored and whichever reads;
- a retry that lands on another worker is stored once (and a reused seq is refused there too);
- the STALE content check against every row the service stored recently, whichever worker stored it, also across
  a kill -9 of a worker;
- `/metrics` answers for the whole service, the same totals from every worker;
- kill -9 of one worker under 8 writers: every acknowledged batch reads back, the worker is replaced;
- kill -9 of the whole service, and a shutdown, under writers: nothing acknowledged is lost, no worker outlives it;
- the same on a PostgreSQL index and a bucket.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE, Flag
from tests.support.data import batch_bytes, many_routes, routes
from tests.support.service import ServiceProcess

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
ROWS = 64
KEEP = ["--keep-alive-timeout", "120"]  # a pinned connection must outlive the test's pauses


def pinned(url: str, workers: int) -> dict[int, httpx.Client]:
    """One keep-alive client per worker: new connections (one each) until every worker answered one."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        http = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1))
        pid = http.get("/healthz").json()["pid"]
        if pid in found:
            http.close()
        else:
            found[pid] = http
        if len(found) == workers:
            return found
    raise AssertionError(f"only {len(found)} of {workers} workers answered 200 new connections")


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def body(run: str, writer: str, seq: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    experts = many_routes(rng, ROWS)
    return batch_bytes(run, writer, seq, [f"{writer}-{seq}"] * ROWS, np.arange(ROWS), experts,
                       token_ids=rng.integers(0, 150_000, ROWS)), experts


def test_round_trips_retries_and_metrics_across_workers(tmp_path):
    with ServiceProcess(tmp_path / "data", workers=2, args=KEEP) as service:
        (a, http_a), (b, http_b) = pinned(service.url, 2).items()
        rng = np.random.default_rng(1)
        sent = {}
        for seq in range(12):
            data, experts = body("w2", "wr", seq, rng)
            first = http_a.post("/v1/ingest", content=data, headers=ARROW)
            assert first.status_code == 200 and not first.json()["duplicate"], first.text
            retry = http_b.post("/v1/ingest", content=data, headers=ARROW)  # the same batch, on the other worker
            assert retry.status_code == 200 and retry.json()["duplicate"], retry.text
            sent[f"wr-{seq}"] = experts
        reused, _ = body("w2", "wr", 3, rng)  # seq 3 again with other rows, on the worker that did not store it
        refused = http_b.post("/v1/ingest", content=reused, headers=ARROW)
        assert refused.status_code == 409 and "seq 3" in refused.json()["detail"]
        for http in (http_a, http_b):  # each worker reads what the other stored, byte-equal
            client = ReplayClient(service.url, http=http)
            for request, experts in sent.items():
                assert np.array_equal(client.get_route("w2", request, strict=True).experts, experts)
        run = ReplayClient(service.url, http=http_a).runs()[0]
        assert run.rows == 12 * ROWS  # stored once each

        def scrape(http: httpx.Client) -> dict[str, float]:
            families = {}
            for line in http.get("/metrics").text.splitlines():
                if line.startswith(("replay_rows_ingested_total", 'replay_ingest_batches_total{outcome="')):
                    name, value = line.rsplit(" ", 1)
                    families[name] = float(value)
            return families

        seen_a, seen_b = scrape(http_a), scrape(http_b)
        assert seen_a == seen_b  # one scrape answers for the whole service, whichever worker answers it
        assert seen_a["replay_rows_ingested_total"] == 12 * ROWS
        assert seen_a['replay_ingest_batches_total{outcome="stored"}'] == 12
        assert seen_a['replay_ingest_batches_total{outcome="duplicate"}'] == 12
        assert {a, b} == service.worker_pids()

        # a run deleted through one worker is gone for the other, which knew it: the next batch starts a fresh run
        assert http_a.delete("/v1/runs/w2").status_code == 200
        data, experts = body("w2", "again", 0, rng)
        again = http_b.post("/v1/ingest", content=data, headers=ARROW)
        assert again.status_code == 200 and not again.json()["duplicate"], again.text
        assert ReplayClient(service.url, http=http_a).run("w2").rows == ROWS


def _probe_trial(original_http: httpx.Client, copy_http: httpx.Client, run: str, trial: int,
                 rng: np.random.Generator) -> str:
    """The probe of issue 41: request a<trial> on one connection, then, on another, b<trial> whose rows are a's at
    other positions (a device buffer replayed after the rollout paused); answers b's request id."""
    original = routes(rng, 32)
    a, b = f"a{trial}", f"b{trial}"
    assert original_http.post("/v1/ingest", headers=ARROW, content=batch_bytes(
        run, f"wa{trial}", 0, [a] * 32, np.arange(32), original,
        token_ids=rng.integers(0, 150_000, 32))).status_code == 200
    assert copy_http.post("/v1/ingest", headers=ARROW, content=batch_bytes(
        run, f"wb{trial}", 0, [b] * 32, np.arange(100, 132), original[::-1],
        token_ids=rng.integers(0, 150_000, 32))).status_code == 200
    return b


def test_stale_copies_are_found_whichever_worker_stored_the_original(tmp_path):
    """Every stale copy reads STALE: the original and its copy on two connections, on the same worker and on the
    other one (each placement forced by asking each connection's worker), before and after a kill -9 of a worker
    in the middle of an ingest. On the per-worker tables before issue 41, every copy that reached the other
    worker was stored clean."""
    with ServiceProcess(tmp_path / "data", workers=2, args=KEEP) as service:
        rng = np.random.default_rng(2)
        by_pid = pinned(service.url, 2)
        (pid_a, http_a), (pid_b, http_b) = by_pid.items()
        copies = []
        for trial in range(6):
            # same worker twice, then each way across
            first, second = [(http_a, http_a), (http_a, http_b), (http_b, http_a)][trial % 3]
            copies.append(_probe_trial(first, second, "stale", trial, rng))
        # kill -9 of a worker in the middle of a stream of ingests: its table lock and its slots are the table's
        stop = threading.Event()

        def stream() -> None:
            http = httpx.Client(base_url=service.url, timeout=30)
            seq = 0
            while not stop.is_set():
                try:
                    http.post("/v1/ingest", headers=ARROW, content=body("stale-load", "load", seq, rng)[0])
                except httpx.TransportError:
                    pass
                seq += 1

        loader = threading.Thread(target=stream, daemon=True)
        loader.start()
        time.sleep(1.0)
        os.kill(pid_b, signal.SIGKILL)
        time.sleep(0.5)
        stop.set()
        loader.join(60)
        deadline = time.monotonic() + 60
        while len(service.worker_pids() - {pid_b}) < 2:
            assert time.monotonic() < deadline, "no replacement worker"
            time.sleep(0.2)
        (pid_a, http_a), (pid_c, http_c) = pinned(service.url, 2).items()
        assert pid_b not in (pid_a, pid_c)
        for trial in range(6, 10):
            first, second = [(http_a, http_c), (http_c, http_a)][trial % 2]
            copies.append(_probe_trial(first, second, "stale", trial, rng))
        client = ReplayClient(service.url, http=http_a)
        for b in copies:
            flags = client.get_route("stale", b, start=100).flags
            assert (flags == Flag.STALE).all(), (b, flags)
        for trial in range(10):  # the originals stay clean
            assert not client.get_route("stale", f"a{trial}").flags.any()


def _learnt(http: httpx.Client) -> float:
    """Rows the service's STALE feed learnt from other replicas, summed over its workers (`/metrics`)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('replay_stale_feed_rows_total{direction="learnt"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stale_copies_are_found_whichever_replica_stored_the_original(tmp_path, postgres, moto_s3):
    """Two replicas of two workers each on one PostgreSQL index and one bucket: an original stored through one
    replica and its copy sent to the other reads STALE, each way, and so do copies between the workers of one
    replica. Each copy goes once the other replica's workers have learnt the original through the index (the
    feed's rounds, ingest/stale_feed.py): what a rollout paused for a training step gives it. On per-replica tables
    every copy that reached the other replica was stored clean."""
    env = {"REPLAY_INDEX_URL": postgres.new_database(), **moto_s3.env(moto_s3.bucket())}
    with ServiceProcess(tmp_path / "a", workers=2, env=env, args=KEEP) as replica_a, \
            ServiceProcess(tmp_path / "b", workers=2, env=env, args=KEEP) as replica_b:
        rng = np.random.default_rng(5)
        (_, a0), (_, a1) = pinned(replica_a.url, 2).items()
        (_, b0), (_, b1) = pinned(replica_b.url, 2).items()
        copies = []
        for trial, (first, second, other) in enumerate([(a0, b0, b1), (b1, a1, a0), (a0, a1, b0), (b0, a0, a1)]):
            before = _learnt(other)
            original = routes(rng, 32)
            assert first.post("/v1/ingest", headers=ARROW, content=batch_bytes(
                "stale-replicas", f"wa{trial}", 0, [f"a{trial}"] * 32, np.arange(32), original,
                token_ids=rng.integers(0, 150_000, 32))).status_code == 200
            deadline = time.monotonic() + 60
            while _learnt(other) < before + 2 * 32:  # both workers of the other replica learnt the 32 rows
                assert time.monotonic() < deadline, "the other replica never learnt the original"
                time.sleep(0.05)
            assert second.post("/v1/ingest", headers=ARROW, content=batch_bytes(
                "stale-replicas", f"wb{trial}", 0, [f"b{trial}"] * 32, np.arange(100, 132), original[::-1],
                token_ids=rng.integers(0, 150_000, 32))).status_code == 200
            copies.append(f"b{trial}")
        client = ReplayClient(replica_a.url, http=a0)
        for b in copies:
            flags = client.get_route("stale-replicas", b, start=100).flags
            assert (flags == Flag.STALE).all(), (b, flags)
        for trial in range(len(copies)):
            assert not client.get_route("stale-replicas", f"a{trial}").flags.any()


class Writers:
    """8 writer threads posting batches of one run until stopped; a batch meeting a dead connection or a 503 is
    posted again, the same bytes (on a new connection when the old one died: any worker). `acked` holds what was
    acknowledged."""

    def __init__(self, url: str, run: str, count: int = 8) -> None:
        self.url, self.run = url, run
        self.acked: dict[str, np.ndarray] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write, args=(w,), daemon=True) for w in range(count)]

    def __enter__(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def wait_for(self, acked: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acked) < acked:
            assert time.monotonic() < deadline, f"{len(self.acked)} of {acked} acknowledged: {self.errors[-3:]}"
            time.sleep(0.05)

    def _write(self, w: int) -> None:
        rng = np.random.default_rng(100 + w)
        http = httpx.Client(base_url=self.url, timeout=30)
        seq = 0
        while not self.stop.is_set():
            data, experts = body(self.run, f"w{w}", seq, rng)
            for _ in range(600):  # a dead service is restarted by the test: keep trying the same batch
                try:
                    answer = http.post("/v1/ingest", content=data, headers=ARROW)
                except httpx.TransportError:
                    answer = None
                if answer is not None and answer.status_code == 200:
                    with self.lock:
                        self.acked[f"w{w}-{seq}"] = experts
                    break
                if answer is not None and answer.status_code != 503:
                    with self.lock:
                        self.errors.append(f"w{w} seq {seq}: {answer.status_code} {answer.text}")
                    return
                time.sleep(0.2)  # a dead connection is replaced by the next post (any worker)
                if self.stop.is_set():
                    return
            seq += 1
        http.close()


def read_back(url: str, run: str, acked: dict[str, np.ndarray]) -> None:
    """Every acknowledged batch reads back byte-equal, stored once: the run holds those rows and the in-flight
    batches' at most."""
    client = ReplayClient(url)
    for request, experts in acked.items():
        assert np.array_equal(client.get_route(run, request, strict=True).experts, experts), request
    assert client.run(run).rows >= len(acked) * ROWS


def test_kill_9_of_a_worker_under_8_writers_loses_no_acknowledged_batch(tmp_path):
    with ServiceProcess(tmp_path / "data", workers=2) as service:
        before = service.worker_pids()
        assert len(before) == 2
        with Writers(service.url, "kill-worker") as writers:
            writers.wait_for(40)
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            writers.wait_for(len(writers.acked) + 80)  # the survivor takes every writer meanwhile
        assert not writers.errors, writers.errors
        # uvicorn's supervisor notices the death and spawns a new worker: seconds under a loaded machine's CI
        deadline = time.monotonic() + 60
        after = service.worker_pids()
        while victim in after or len(after) < 2:
            assert time.monotonic() < deadline, f"no replacement worker: {after}"
            time.sleep(0.2)
            after = service.worker_pids()
        read_back(service.url, "kill-worker", writers.acked)


def test_kill_9_of_the_service_and_a_shutdown_under_writers_lose_nothing(tmp_path):
    service = ServiceProcess(tmp_path / "data", workers=2).start()
    with Writers(service.url, "kill-service") as writers:
        writers.wait_for(30)
        workers = service.worker_pids()
        service.kill9()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers):  # none outlives the parent
            assert time.monotonic() < deadline, [pid for pid in workers if alive(pid)]
            time.sleep(0.05)
        service = ServiceProcess(tmp_path / "data", port=service.port, workers=2).start()  # the writers resume
        writers.wait_for(len(writers.acked) + 30)
        service.stop()
        service = ServiceProcess(tmp_path / "data", port=service.port, workers=2).start()
        writers.wait_for(len(writers.acked) + 10)
    try:
        assert not writers.errors, writers.errors
        read_back(service.url, "kill-service", writers.acked)
    finally:
        service.stop()


def test_workers_on_postgresql_and_a_bucket(tmp_path, postgres, moto_s3):
    env = {"REPLAY_INDEX_URL": postgres.new_database(), **moto_s3.env(moto_s3.bucket())}
    with ServiceProcess(tmp_path / "data", workers=2, env=env, args=KEEP) as service:
        (_, http_a), (_, http_b) = pinned(service.url, 2).items()
        rng = np.random.default_rng(3)
        data, experts = body("pg", "one", 0, rng)
        assert not http_a.post("/v1/ingest", content=data, headers=ARROW).json()["duplicate"]
        assert http_b.post("/v1/ingest", content=data, headers=ARROW).json()["duplicate"]
        assert np.array_equal(ReplayClient(service.url, http=http_b).get_route("pg", "one-0").experts, experts)
        with Writers(service.url, "pg-kill") as writers:
            writers.wait_for(20)
            os.kill(min(service.worker_pids()), signal.SIGKILL)
            writers.wait_for(len(writers.acked) + 40)
        assert not writers.errors, writers.errors
        read_back(service.url, "pg-kill", writers.acked)


@pytest.mark.parametrize("workers", [0, 3])
def test_the_worker_count_is_a_setting(tmp_path, workers):
    """`--workers 0` (the default) is one per core this process may use; a number is that many."""
    with ServiceProcess(tmp_path / "data", workers=workers) as service:
        count = workers or len(os.sched_getaffinity(0))
        assert len(service.worker_pids()) == (count if count > 1 else 0)  # one worker is the process itself


@pytest.mark.parametrize("workers", [1, 2])
def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_service_serves_on(tmp_path, workers):
    """`kill -USR1` of each worker, or of the one process (ops/stacks.py): each writes its threads' stacks to the log,
    and nothing stops (before, SIGUSR1's default action ended the process: the service or a worker was gone)."""
    with ServiceProcess(tmp_path / "data", workers=workers) as service:
        before = service.worker_pids()
        stacks = service.thread_stacks()
        assert service.proc is not None and service.proc.poll() is None, stacks[-2000:]
        assert "(most recent call first)" in stacks, stacks[-3000:]
        if before:  # a dump per worker: each main thread's stack starts in spawn_main
            assert stacks.count(" in spawn_main") == len(before), stacks[-3000:]
        else:  # the one process: its main thread runs `serve`
            assert "replay_service/ops/cli.py" in stacks, stacks[-3000:]
        assert service.worker_pids() == before  # no worker died and was replaced
        pids = {httpx.get(f"{service.url}/healthz", timeout=30).json()["pid"] for _ in range(20)}
        assert pids <= (before or {service.proc.pid})


def test_sigusr1_during_a_workers_start_up_waits_for_its_handler_and_ends_nothing(tmp_path):
    """A worker signalled before its app has registered the stack dump (the first moments of its start) gets the
    signal once it has, and serves on: the parent holds SIGUSR1 blocked, its workers start so, and each unblocks it
    after registering (ops/workers.py). Before, SIGUSR1's default action ended the worker and uvicorn started
    another: the first pid seen was gone."""
    service = ServiceProcess(tmp_path / "data", workers=2)
    starting = threading.Thread(target=service.start)
    starting.start()
    deadline = time.monotonic() + 30
    while service.proc is None or not service.worker_pids():
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.001)
    first = min(service.worker_pids())
    os.kill(first, signal.SIGUSR1)  # the worker has only just been spawned: Python is still starting
    starting.join()
    try:
        assert first in service.worker_pids(), service.log_path.read_text()[-3000:]
        assert "(most recent call first)" in service.log_path.read_text()
    finally:
        service.stop()
