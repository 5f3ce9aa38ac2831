"""Acknowledged means durable: retries stored once, kill -9 mid-stream loses nothing acknowledged."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np

import capture.sender.spill
import replay_format.durable
import replay_service.store.segments.durable
from capture.vllm.sink import spill_root
from replay_client.client import ReplayClient, ReplayError
from replay_format import ARROW_STREAM_MEDIA_TYPE
from tests.support.data import batch_bytes, many_routes, routes
from tests.support.service import ServiceProcess
from tests.support.stand_ins import record_fsyncs

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


def test_retried_ingest_is_stored_once(service):
    rng = np.random.default_rng(0)
    ex = routes(rng, 64)
    body = batch_bytes("retry", "w0", 7, ["a"] * 64, np.arange(64), ex)
    client = ReplayClient(service.url)
    first, second = client.ingest(body), client.ingest(body)
    assert first.stored and not first.duplicate
    assert second.duplicate and not second.stored
    summary = client.run("retry")
    assert summary.rows == 64 and summary.flagged["CONFLICT"] == 0
    assert client.get_route("retry", "a", strict=True).experts.tobytes() == ex.tobytes()
    # The same (writer, seq) with other rows is refused: that is a writer bug, not a retry.
    other = batch_bytes("retry", "w0", 7, ["a"] * 64, np.arange(64), routes(rng, 64))
    try:
        client.ingest(other)
        raise AssertionError("a reused seq with other rows was accepted")
    except ReplayError as exc:
        assert exc.status == 409 and "already stored seq 7" in exc.detail
    # Another writer may send the same seq number.
    assert client.ingest(batch_bytes("retry", "w1", 7, ["b"] * 64, np.arange(64), ex)).stored


def _writer(url, run, writer, batches, acked, stop):
    with httpx.Client(base_url=url, timeout=30) as http:
        for seq, body in enumerate(batches):
            if stop.is_set():
                return
            try:
                answer = http.post("/v1/ingest", content=body, headers=ARROW)
            except httpx.HTTPError:
                return  # the server died mid-request: this batch is not acknowledged
            if answer.status_code == 200:
                acked.append((writer, seq))


def test_kill9_mid_stream_keeps_every_acknowledged_row(tmp_path):
    rows_per_batch = 4096  # 1.5 MiB of ids per batch: kills land inside writes
    rng = np.random.default_rng(42)
    batches, expected = {}, {}
    for writer in ("w0", "w1"):
        batches[writer] = []
        for seq in range(40):
            request = f"{writer}-s{seq}"
            ex = many_routes(rng, rows_per_batch)
            expected[(writer, seq)] = (request, ex)
            batches[writer].append(batch_bytes("crash", writer, seq, [request] * rows_per_batch,
                                               np.arange(rows_per_batch), ex))
    data = tmp_path / "data"
    proc = ServiceProcess(data).start()
    acked: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=_writer, args=(proc.url, "crash", w, batches[w], acked, stop)) for w in batches]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 12 and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill9()  # ingests are in flight on both writers now
    stop.set()
    for t in threads:
        t.join()
    acknowledged = set(acked)
    assert 12 <= len(acknowledged) < 80

    with ServiceProcess(data, log_path=tmp_path / "restart.log") as again:
        client = ReplayClient(again.url)
        assert not list(data.rglob("*.tmp"))
        stored = {r.request_id for r in client.requests("crash")}
        for key, (request, ex) in expected.items():
            if key in acknowledged:
                route = client.get_route("crash", request, strict=True)
                assert route.experts.tobytes() == ex.tobytes(), f"acknowledged batch {key} changed"
            elif request in stored:
                # Written but not acknowledged (killed between commit and answer): whole, never torn.
                assert client.get_route("crash", request, strict=True).experts.tobytes() == ex.tobytes()
        assert stored >= {expected[k][0] for k in acknowledged}
        # The writers resume from their first unacknowledged seq; retries are idempotent.
        for writer in batches:
            for body in batches[writer]:
                client.ingest(body)
        summary = client.run("crash")
        assert summary.requests == 80 and summary.rows == 80 * rows_per_batch
        assert all(v == 0 for v in summary.flagged.values())


def test_partial_files_never_break_startup(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as proc:
        ReplayClient(proc.url).ingest(
            batch_bytes("p", "w", 0, ["a"] * 8, np.arange(8), routes(np.random.default_rng(1), 8)))
    run_dir = data / "runs" / "p"
    (run_dir / "deadbeef.arrow.tmp").write_bytes(b"ARROW1\0\0 torn")  # crash inside a write
    (run_dir / "cafe.arrow").write_bytes(b"ARROW1\0\0 renamed, never indexed")  # crash before the index commit
    with ServiceProcess(data, log_path=tmp_path / "second.log") as proc:
        client = ReplayClient(proc.url)
        assert client.get_route("p", "a", strict=True).positions.tolist() == list(range(8))
    assert sorted(p.suffix for p in run_dir.iterdir()) == [".arrow", ".jsonl"]  # the segment and the run journal
    assert [p.name for p in (data / "quarantine" / "runs" / "p").iterdir()] == ["cafe.arrow"]  # kept, not deleted


def test_one_folder_fsync_on_both_sides(tmp_path, monkeypatch):
    """A store file is fsynced, renamed into place, then its folder fsynced by `replay_format.durable.fsync_dir`: the
    one helper, which the capture sender's spill and its adoption of a stopped writer's items call too."""
    synced = record_fsyncs(monkeypatch)
    replay_service.store.segments.durable.write_file(tmp_path / "runs" / "r" / "x.arrow", b"bytes")
    assert synced == ["file", str(tmp_path / "runs" / "r")]
    assert [p.name for p in (tmp_path / "runs" / "r").iterdir()] == ["x.arrow"]  # no .tmp left
    helper = replay_format.durable.fsync_dir
    assert replay_service.store.segments.durable.fsync_dir is helper
    assert capture.sender.spill.fsync_dir is helper and spill_root.fsync_dir is helper
