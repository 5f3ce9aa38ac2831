"""Three replicas on one PostgreSQL index and one S3 bucket, under writers and readers: one killed with kill -9,
another cut off its storage by the network and brought back (issue 15, "How it is shown", third bullet).

Real parts, all started here: a PostgreSQL cluster (tests/support/postgres.py), a moto S3 server in its own
process (tests/support/s3.py), three `replay-service serve` processes (A, B, C). C runs in a network namespace
(tests/support/netns.py) with two veth links: a client link the test reaches it through, and a storage link
through which it reaches PostgreSQL and the bucket. Cutting the storage link leaves C reachable but without its
index and bucket: it must answer 503 naming them, never rows, and serve again once the link is back, in the same
process.

Eight writers post batches round robin over the replicas; a batch that meets a dead replica or a 503 is posted
again, the same bytes with the same (run, writer, seq), to the next replica: at-least-once delivery, which the
index's idempotency key turns into exactly-once storage. Readers on every replica read acknowledged routes the
whole time and compare bytes. Needs root (network namespaces); skipped elsewhere.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import numpy as np
import psycopg
import pytest

from replay_client.client import ReplayClient, ReplayError, routes_from_stream
from replay_format import ARROW_STREAM_MEDIA_TYPE
from tests.support.data import batch_bytes, many_routes
from tests.support.netns import Island
from tests.support.postgres import Cluster, binaries
from tests.support.s3 import MotoS3
from tests.support.service import ServiceProcess
from tests.test_index_postgres import expected_load

T = TypeVar("T")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or binaries() is None,
                                reason="needs root, iproute2 and PostgreSQL (network namespaces, a real cluster)")

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
RUN, WRITERS, PER_WRITER, ROWS = "replicas", 8, 12, 32


@dataclass
class Batch:
    """One batch the writers send: its bytes, and what a read of its request must give back."""

    request: str  # its one request: ROWS rows at positions 0..ROWS-1
    experts: np.ndarray
    tokens: np.ndarray
    body: bytes = field(repr=False)


def make_batch(rng: np.random.Generator, writer: int | str, seq: int) -> Batch:
    experts = many_routes(rng, ROWS)
    tokens = rng.integers(0, 150_000, ROWS, dtype=np.int32)
    request = f"w{writer}-s{seq}"
    body = batch_bytes(RUN, f"w{writer}", seq, [request] * ROWS, np.arange(ROWS), experts, token_ids=tokens)
    return Batch(request, experts, tokens, body)


class Ledger:
    """What every thread saw, under one lock: acknowledged batches, 503s, and anything that must not happen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, Batch] = {}
        self.retried: set[str] = set()
        self.refusals: dict[str, int] = {"A": 0, "B": 0, "C": 0}  # 503 answers per replica
        self.good_reads: dict[str, int] = {"A": 0, "B": 0, "C": 0}
        self.problems: list[str] = []
        self.changed = threading.Condition(self.lock)

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)

    def refused(self, replica: str, detail: str, bucket: str) -> None:
        """A 503: fine, as long as it names what is missing (the index or the bucket)."""
        with self.lock:
            self.refusals[replica] += 1
            if "REPLAY_INDEX_URL" not in detail and bucket not in detail:
                self.problems.append(f"a 503 from {replica} names neither the index nor the bucket: {detail}")

    def ack(self, batch: Batch, retried: bool) -> None:
        with self.changed:
            self.acked[batch.request] = batch
            if retried:
                self.retried.add(batch.request)
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 300.0) -> None:
        """Until `count` batches are acknowledged (a bound against a hang, not a timing assertion)."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.acked) >= count, timeout):
                raise AssertionError(f"only {len(self.acked)} of {count} batches acknowledged: {self.problems}")


def over_storage_link(index_url: str, island: Island) -> str:
    """The index URL as a replica inside `island` reaches the server: over its storage link, not loopback."""
    assert island.storage is not None
    return index_url.replace("@127.0.0.1:", f"@{island.storage.outer}:")


def ingest(http: httpx.Client, url: str, body: bytes) -> httpx.Response:
    return http.post(f"{url}/v1/ingest", content=body, headers=ARROW)


def answered(service: ServiceProcess, call: Callable[[], T]) -> T:
    """`call()`, a request to `service`; a timeout fails the test with the service's thread stacks (where it hung)."""
    try:
        return call()
    except httpx.TimeoutException as exc:
        pytest.fail(f"{service.url} did not answer ({exc!r}); its threads:\n{service.thread_stacks()[-8000:]}")


def test_three_replicas_survive_a_kill_and_a_network_cut(tmp_path):
    """Every acknowledged batch reads back byte-equal from both survivors and is stored once; C, cut off its
    storage, answers 503 naming what it lost (reads and ingests), never other bytes, and serves again after."""
    island = Island()
    cluster: Cluster | None = None
    s3: MotoS3 | None = None
    services: list[ServiceProcess] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()  # readers end
    killed = threading.Event()  # A is gone: writers move on to the middle third
    restored = threading.Event()  # C has its storage back: writers send the last third
    began = time.monotonic()
    marks: list[str] = []  # when each phase ended (printed: where the time goes on a loaded machine)

    def mark(what: str) -> None:
        marks.append(f"{what} {time.monotonic() - began:.1f}s")

    try:
        island.open()
        assert island.storage is not None and island.client is not None
        s3 = MotoS3(host=island.storage.outer)  # every replica reaches the bucket on the storage link's address
        with ThreadPoolExecutor(2) as pool:  # initdb and moto's imports at once
            making = pool.submit(Cluster, [island.storage.outer], [f"{island.storage.inner}/32"])
            moto = pool.submit(s3.start)
        cluster = making.result()  # or its failure (moto's is raised next; both are cleaned up below)
        moto.result()
        bucket = s3.bucket()
        index_url = cluster.new_database()
        # C reaches PostgreSQL over its storage link; no liveness options in its URL: the service's defaults
        # (postgres.py LIVENESS) must end connections the cut leaves stalled, or C hangs instead of answering 503
        env = {"REPLAY_INDEX_URL": index_url, **s3.env(bucket)}
        c_index = over_storage_link(index_url, island)
        a = ServiceProcess(tmp_path / "a", env=env)
        b = ServiceProcess(tmp_path / "b", env=env)
        c = ServiceProcess(tmp_path / "c", env={**env, "REPLAY_INDEX_URL": c_index}, host=island.client.inner,
                           netns=island.name, args=["--insecure"])  # no tokens file, on a non-loopback address
        services += [a, b, c]
        _start_together(services)
        mark("started")
        urls = {"A": a.url, "B": b.url, "C": c.url}
        names = list(urls)
        ledger = Ledger()
        rng = np.random.default_rng(15)
        plan = {(w, s): make_batch(rng, w, s) for w in range(WRITERS) for s in range(PER_WRITER)}

        def deliver(http: httpx.Client, batch: Batch, first: int) -> None:
            """Post until a replica acknowledges, moving to the next one on a dead connection or a 503."""
            for attempt in range(60):
                name = names[(first + attempt) % len(names)]
                try:
                    answer = ingest(http, urls[name], batch.body)
                except httpx.TransportError:
                    time.sleep(0.05 if attempt < 3 else 0.3)  # A's port refuses after the kill
                    continue
                if answer.status_code == 200:
                    ledger.ack(batch, retried=attempt > 0)
                    return
                if answer.status_code == 503:
                    ledger.refused(name, answer.json()["detail"], bucket)
                    time.sleep(0.05 if attempt < 3 else 0.3)
                    continue
                ledger.problem(f"{batch.request} on {name}: {answer.status_code} {answer.text[:300]}")
                return
            ledger.problem(f"{batch.request} was never acknowledged")

        def write(w: int) -> None:
            with httpx.Client(timeout=120) as http:
                for seq in range(PER_WRITER):
                    if seq == PER_WRITER // 3:
                        killed.wait(300)
                    if seq == 2 * PER_WRITER // 3:
                        restored.wait(300)
                    deliver(http, plan[(w, seq)], w + seq)

        def read(name: str) -> None:
            """Read acknowledged routes from one replica until told to stop; every 200 must be the batch's bytes."""
            picker = random.Random(name)
            with ReplayClient(urls[name], timeout=120) as client:
                while not stop.is_set():
                    with ledger.lock:
                        acked = list(ledger.acked.values())
                    if not acked:
                        time.sleep(0.05)
                        continue
                    batch = picker.choice(acked)
                    try:
                        route = client.get_route(RUN, batch.request, strict=True)
                    except ReplayError as exc:
                        if exc.status == 503:
                            ledger.refused(name, exc.detail, bucket)
                        else:
                            ledger.problem(f"read {batch.request} on {name}: {exc}")
                        continue
                    except (OSError, httpx.TransportError) as exc:
                        if name == "A" and killed.is_set():
                            return  # its process is gone, as it should be
                        ledger.problem(f"read {batch.request} on {name}: {exc!r}")
                        continue
                    if (route.experts.tobytes() != batch.experts.tobytes()
                            or route.token_ids.tobytes() != batch.tokens.tobytes()):
                        ledger.problem(f"read {batch.request} on {name}: other bytes than were acknowledged")
                    else:
                        with ledger.lock:
                            ledger.good_reads[name] += 1
                    time.sleep(0.02)  # leave the two cores to the writers and replicas too

        threads = [threading.Thread(target=write, args=(w,), name=f"writer-{w}", daemon=True) for w in range(WRITERS)]
        threads += [threading.Thread(target=read, args=(name,), name=f"reader-{name}", daemon=True) for name in names]
        for thread in threads:
            thread.start()

        ledger.wait_for(WRITERS * PER_WRITER // 6)  # writers in the first third
        killed.set()  # first: a reader that finds A's port closed must know it was meant to be
        a.kill9()
        mark("A killed")
        ledger.wait_for(WRITERS * PER_WRITER // 2)  # writers in the middle third, A's batches moved on
        probe = make_batch(rng, "probe", 0)
        island.cut()
        mark("C cut")
        with httpx.Client(timeout=120) as http:
            with ledger.lock:
                known = next(iter(ledger.acked.values()))
            refused_read = refused_ingest = None
            for _ in range(40):  # until C notices (its stalled connections time out), a bound against a hang
                if not refused_read:
                    refused_read = _refused_or_right(answered(c, lambda: http.get(
                        f"{c.url}/v1/runs/{RUN}/requests/{known.request}/routes", params={"strict": "true"})), known)
                    mark(f"read {'503' if refused_read else '200'}")
                if not refused_ingest:
                    refused_ingest = _refused_or_right(answered(c, lambda: ingest(http, c.url, probe.body)), None)
                    mark(f"ingest {'503' if refused_ingest else '200'}")
                if refused_read and refused_ingest:
                    break
            assert refused_read and refused_ingest, "C answered no 503 while cut off its index and bucket"
            for answer in (refused_read, refused_ingest):
                detail = answer.json()["detail"]
                assert "REPLAY_INDEX_URL" in detail or bucket in detail, detail
            mark("C refused")
            island.restore()
            back = None
            for _ in range(120):  # the same process serves again once the link is back (no restart)
                back = answered(c, lambda: ingest(http, c.url, probe.body))
                if back.status_code != 503:
                    break
                time.sleep(0.5)
            assert back is not None and back.status_code == 200, back.text if back is not None else None
            assert back.json()["duplicate"] is False  # the refused probe had stored nothing
            mark("C back")
            ledger.ack(probe, retried=True)
            restored.set()
            for thread in threads[:WRITERS]:
                thread.join(300)
            stop.set()
            for thread in threads[WRITERS:]:
                thread.join(300)

            mark("written")
            assert not ledger.problems, "\n".join(ledger.problems[:20])
            acked = ledger.acked
            assert len(acked) == WRITERS * PER_WRITER + 1  # every batch, and the probe
            assert ledger.good_reads["B"] > 0 and ledger.good_reads["C"] > 0, ledger.good_reads
            for name, replica in (("B", b), ("C", c)):  # the survivors: every acknowledged batch, byte-equal
                with ReplayClient(replica.url, timeout=120) as client:
                    wanted = sorted(acked)
                    for batch, route in zip((acked[r] for r in wanted), client.get_routes(RUN, wanted, strict=True),
                                            strict=True):
                        assert route.request_id == batch.request, name
                        assert route.experts.tobytes() == batch.experts.tobytes(), (name, batch.request)
                        assert route.token_ids.tobytes() == batch.tokens.tobytes(), (name, batch.request)
                    summary = client.run(RUN)
                    assert summary.rows == len(acked) * ROWS, (name, summary)  # stored once, retries or not
                    assert summary.requests == len(acked), (name, summary)
                    load = client.expert_load(RUN)
                    assert np.array_equal(np.array(load.counts), expected_load([x.experts for x in acked.values()]))
            with psycopg.connect(index_url) as conn:
                stored = conn.execute("SELECT COUNT(*) FROM segments WHERE run_id = %s", (RUN,)).fetchone()
            assert stored == (len(acked),)  # one segment per batch, however often it was posted
            repeats = [x for i, x in enumerate(acked.values()) if x.request in ledger.retried or i % 8 == 0]
            for i, batch in enumerate(repeats):  # a repeat on either survivor: a duplicate, nothing stored
                again = ingest(http, (b.url, c.url)[i % 2], batch.body)
                assert again.status_code == 200 and again.json()["duplicate"] is True, (batch.request, again.text)
            mark("checked")
            print(f"\nacknowledged {len(acked)} batches ({len(ledger.retried)} after a retry); 503s per replica "
                  f"{ledger.refusals}; byte-equal reads during the run {ledger.good_reads}")
    finally:
        print(f"\nphases: {', '.join(marks)}")
        for event in (stop, killed, restored):  # a failed step lets every thread run out (daemons besides)
            event.set()
        for service in services:
            service.stop()
        if s3 is not None:
            s3.stop()
        if cluster is not None:
            cluster.close()
        island.close()


HOLDER = """
import sys
from replay_service.store.index.backends.postgres import PostgresBackend
tx = PostgresBackend(sys.argv[1]).begin()
tx.lock_runs([sys.argv[2]])  # as a commit leader does, before its batches' rows
print("locked", flush=True)
sys.stdin.read()  # alive and idle in its transaction until the test closes stdin
"""


def test_a_replica_cut_off_mid_commit_does_not_hold_its_runs_lock(tmp_path):
    """A replica cut off the network while its transaction holds a run's lock (replay_service/ingest/commit.py:
    lock_runs, then the
    batches' rows) must not stall every other replica's commits of that run for as long as its session lives at the
    server: the server ends that session well inside the cut. Before SERVER_LIVENESS the session stayed idle in
    transaction with the lock for the whole cut (in a real network, until the server's 2-hour keepalive)."""
    island = Island()
    cluster: Cluster | None = None
    holder = None
    try:
        island.open()
        assert island.storage is not None
        cluster = Cluster([island.storage.outer], [f"{island.storage.inner}/32"])
        url = cluster.new_database()
        holder = subprocess.Popen(
            ["ip", "netns", "exec", island.name, sys.executable, "-c", HOLDER,
             over_storage_link(url, island), RUN],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        island.cut()
        began = time.monotonic()
        with psycopg.connect(url, autocommit=True) as other:  # another replica's commit of the same run
            other.execute("SET lock_timeout = '120s'")  # a bound against a hang, not a timing assertion
            with other.transaction():
                other.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (RUN,))
            waited = time.monotonic() - began
        assert holder.poll() is None  # the holder lives on, still cut off: the server let its lock go
        print(f"\nanother replica took the run's lock {waited:.1f} s into the cut")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        if cluster is not None:
            cluster.close()
        island.close()


def _start_together(services: list[ServiceProcess]) -> None:
    """Start the replicas at once (each start is mostly imports: seconds apiece on a loaded machine)."""
    failures: list[BaseException] = []

    def start(service: ServiceProcess) -> None:
        try:
            service.start(timeout=180)
        except BaseException as exc:  # noqa: BLE001  # raised below, in the test's thread
            failures.append(exc)

    starting = [threading.Thread(target=start, args=(service,)) for service in services]
    for thread in starting:
        thread.start()
    for thread in starting:
        thread.join()
    if failures:
        raise failures[0]


def _refused_or_right(answer: httpx.Response, batch: Batch | None) -> httpx.Response | None:
    """The answer when it is a 503; else it must be a 200 and, for a read of `batch`, that batch's bytes (a
    request in flight when the link went down may still complete: right, or refused, never anything else)."""
    if answer.status_code == 503:
        return answer
    assert answer.status_code == 200, answer.text  # neither a 500 nor a 404 for an acknowledged route
    if batch is not None:
        (route,) = routes_from_stream(bytearray(answer.content))
        assert route.experts.tobytes() == batch.experts.tobytes()
        assert route.token_ids.tobytes() == batch.tokens.tobytes()
    return None
