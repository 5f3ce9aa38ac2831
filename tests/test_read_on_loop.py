"""Hot route reads on the event loop (placement/on_loop.py) and the SQLite index's reader connections.

- A query of a thread without a transaction runs on a read-only connection: it does not wait for another
  thread's open transaction (a group commit's fsync, another worker's write lock), sees only committed rows, and
  cannot write. The thread holding the transaction still sees its own writes.
- On the event loop, a read that would wait (a segment not opened yet, more than `MAX_ROWS`, the run registry's
  lock held) raises WouldWait before waiting; once the segment is opened the same read is served there, the same
  rows. `hot_reads=thread` keeps every read off the loop.
- Through a real server: the first GET of a segment is read in a thread, the next ones on the event loop, every
  answer byte-equal to what was sent; `replay_route_reads_total` says where each was read.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_service.app import open_store
from replay_service.ingest.decode import decode_batch
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.placement import on_loop
from replay_service.settings import ServiceSettings
from replay_service.store.index.backends.sqlite import SqliteBackend
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess

RUN = "loop"
LENGTHS = {"short": 300, "long": on_loop.MAX_ROWS + 2000}  # rows


def _table(path: Path) -> SqliteBackend:
    backend = SqliteBackend(path, fsync=False)
    tx = backend.begin()
    tx.execute("CREATE TABLE t (v INTEGER)")
    tx.execute("INSERT INTO t VALUES (1)")
    tx.finish(commit=True)
    return backend


def test_a_read_does_not_wait_for_another_threads_transaction(tmp_path):
    backend = _table(tmp_path / "index.sqlite")
    inserted, release = threading.Event(), threading.Event()
    seen_inside: list[int] = []

    def writer() -> None:
        tx = backend.begin()
        tx.execute("INSERT INTO t VALUES (2)")
        seen_inside.append(backend.query("SELECT count(*) AS n FROM t")[0]["n"])  # its own write: on its connection
        inserted.set()
        release.wait(60)
        tx.finish(commit=True)

    thread = threading.Thread(target=writer)
    thread.start()
    assert inserted.wait(30)
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(backend.query("SELECT count(*) AS n FROM t")[0]["n"]))
    reader.start()
    reader.join(20)  # the old single connection made this wait until the writer committed (never, here)
    finished = not reader.is_alive()
    release.set()
    thread.join(30)
    reader.join(30)
    assert finished, "a query waited for another thread's open transaction"
    assert seen == [1], "a query outside the transaction saw its uncommitted row"
    assert seen_inside == [2], "the transaction's own thread did not see its write"
    assert backend.query("SELECT count(*) AS n FROM t")[0]["n"] == 2  # committed: every reader sees it
    backend.close()


def test_a_write_outside_a_transaction_is_refused(tmp_path):
    backend = _table(tmp_path / "index.sqlite")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        backend.query("INSERT INTO t VALUES (3)")
    assert backend.query("SELECT count(*) AS n FROM t")[0]["n"] == 1
    backend.close()


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A data directory holding RUN's requests (stored in this process, then closed), and each one's rows."""
    data = tmp_path_factory.mktemp("on_loop") / "data"
    rng = np.random.default_rng(3)
    sent = {rid: routes(rng, rows) for rid, rows in LENGTHS.items()}
    store = open_store(ServiceSettings(data_dir=data, fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        for seq, (rid, ids) in enumerate(sent.items()):
            body = batch_bytes(RUN, "w", seq, [rid] * len(ids), np.arange(len(ids)), ids)
            pipeline.ingest(decode_batch(ARROW_STREAM_MEDIA_TYPE, body))
    finally:
        store.close()
    return data, sent


def test_a_read_that_would_wait_is_refused_on_the_loop_and_served_once_hot(stored):
    data, sent = stored
    store = open_store(ServiceSettings(data_dir=data, fsync=False))
    try:
        assert store.reads_on_loop  # SQLite and local segments
        with pytest.raises(on_loop.WouldWait, match="not opened yet"), on_loop.on_event_loop():
            store.read_route(RUN, "short")
        in_thread = store.read_route(RUN, "short")  # opens and checks the segment
        with on_loop.on_event_loop():
            hot = store.read_route(RUN, "short")
        assert np.array_equal(hot.experts_3d(), sent["short"]) and np.array_equal(hot.experts, in_thread.experts)

        store.read_route(RUN, "long", 0, 1)  # its segment opened too
        with pytest.raises(on_loop.WouldWait, match="rows is more than"), on_loop.on_event_loop():
            store.read_route(RUN, "long")
        with on_loop.on_event_loop():
            bounded = store.read_route(RUN, "long", 0, on_loop.MAX_ROWS)
        assert np.array_equal(bounded.experts_3d(), sent["long"][: on_loop.MAX_ROWS])

        registering = store.registry._lock  # held while a thread registers a run (a transaction)
        with registering, on_loop.on_event_loop():  # a run this process keeps needs no lock (store/runs.py)
            assert np.array_equal(store.read_route(RUN, "short").experts, in_thread.experts)
        store.registry.forget(RUN)  # as a run seen for the first time: its row is applied under the lock
        with registering:
            with pytest.raises(on_loop.WouldWait, match="being registered"), on_loop.on_event_loop():
                store.read_route(RUN, "short")
        with on_loop.on_event_loop():
            assert np.array_equal(store.read_route(RUN, "short").experts, in_thread.experts)
    finally:
        store.close()
    kept_in_threads = open_store(ServiceSettings(data_dir=data, fsync=False, hot_reads="thread"))  # REPLAY_HOT_READS
    try:
        assert not kept_in_threads.reads_on_loop
    finally:
        kept_in_threads.close()


def _route_reads(http: httpx.Client) -> dict[str, float]:
    """`replay_route_reads_total` by place, from the service's exposition."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {s.labels["place"]: s.value for f in families if f.name == "replay_route_reads"
            for s in f.samples if s.name == "replay_route_reads_total"}


def test_hot_gets_are_read_on_the_loop_through_a_server(stored):
    data, sent = stored
    with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc, ReplayClient(proc.url) as client, \
            httpx.Client(base_url=proc.url) as http:
        first = client.get_route_npy(RUN, "short")  # cold: its segment opened in a thread
        assert _route_reads(http) == {"thread": 1.0}
        for _ in range(3):
            assert np.array_equal(client.get_route_npy(RUN, "short"), sent["short"])
            assert np.array_equal(client.get_route(RUN, "short").experts, sent["short"])
        assert np.array_equal(first, sent["short"])
        whole = client.get_route_npy(RUN, "long")  # more than MAX_ROWS: in a thread, whatever is opened
        assert np.array_equal(whole, sent["long"])
        json_rows = http.get(f"/v1/runs/{RUN}/requests/short/routes", params={"format": "json", "end": 2}).json()
        assert [r["experts"] for r in json_rows["rows"]] == sent["short"][:2].tolist()  # JSON: always in a thread
        assert _route_reads(http) == {"thread": 3.0, "event_loop": 6.0}
