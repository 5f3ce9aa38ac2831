"""Index loss is never data loss, and damaged rows are never served (issue 13, items 1 and 5), through a real server.

- The index deleted (or left empty) beside stored segments: the service refuses to start and names
  `replay-service reindex`; after it, every row, flag and summary reads back as before, and retries of
  stored batches are still answered as duplicates.
- A complete segment no index row names is quarantined at start-up, never deleted; `.tmp` files are deleted.
- One flipped id byte in a segment: reads (plain, strict, .npy) answer a JSON 503 naming the segment, the
  metrics count it, `replay-service verify` lists it (exit status 1); restored, it is served again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from replay_client.client import ReplayClient
from replay_format import RunShape
from replay_service.store.index import Index
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

SHAPE = RunShape(num_moe_layers=8, top_k=4, num_experts=64)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_service.ops.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _rows(client: ReplayClient, run: str, request: str, positions, experts, seq: int, writer: str = "w",
          flags=None) -> dict:
    positions = np.asarray(positions, np.int32)
    return client.ingest(batch_bytes(run, writer, seq, [request] * len(positions), positions,
                                     experts.reshape(len(positions), -1), shape=SHAPE,
                                     token_ids=(1000 + positions).astype(np.int32), flags=flags))


def _fill(url: str, run: str) -> None:
    """A run with every kind of index state: spans over several segments, a late CONFLICT, padding, ends,
    an aborted request with a gap, a prefix-cache reference and a second writer."""
    client = ReplayClient(url)
    rng = np.random.default_rng(13)
    a = routes(rng, 16, SHAPE)
    assert _rows(client, run, "a", range(10), a[:10], seq=0).stored
    pad = np.zeros(7, np.uint16)
    pad[-1] = 64  # PADDING: dropped, counted
    assert _rows(client, run, "b", range(7), routes(rng, 7, SHAPE), seq=1, flags=pad).stored
    late = a[3:15].copy()
    late[0] = routes(rng, 1, SHAPE)[0]  # position 3 again, other ids: a late CONFLICT on the served row
    assert _rows(client, run, "a", range(3, 15), late, seq=2).stored
    client.finish(run, "a", 16)
    client.finish(run, "b", 9, status="aborted")  # rows 0..5 stored, 6..7 GAP
    answer = calls.post(f"{url}/v1/runs/{run}/references", timeout=30, json={"references": [
        {"request_id": "c", "start": 0, "end": 4, "source_request_id": "a"}]})
    assert answer.status_code == 200, answer.text
    assert _rows(client, run, "c", range(4, 8), routes(rng, 4, SHAPE), seq=3).stored
    assert _rows(client, run, "d", range(5), routes(rng, 5, SHAPE), seq=0, writer="w2").stored


def _snapshot(url: str, run: str) -> dict:
    """Everything a reader sees of a run: its summary, its request listing, each request's summary and rows."""
    client = ReplayClient(url)
    listing = calls.get(f"{url}/v1/runs/{run}/requests", params={"limit": 100}, timeout=30).json()
    seen = {"run": client.run(run), "listing": listing}
    for item in listing["items"]:
        rid = item["request_id"]
        route = client.get_route(run, rid)
        seen[rid] = (client.request(run, rid), route.positions.tolist(), route.token_ids.tolist(),
                     route.experts.tolist(), route.flags.tolist())
    return seen


def _segments(data: Path, run: str) -> list[Path]:
    return sorted((data / "runs" / run).glob("*.arrow"))


def test_index_loss_is_refused_then_rebuilt_identically(tmp_path):
    data = tmp_path / "data"
    run = "integrity-reindex"
    with ServiceProcess(data) as service:
        _fill(service.url, run)
        before = _snapshot(service.url, run)
        before_runs = ReplayClient(service.url).runs()
    assert before["a"][0].flagged["CONFLICT"] == 1 and before["b"][0].flagged["PADDING"] == 1
    assert before["c"][0].referenced_rows == 4 and before["b"][0].status == "aborted"
    files = _segments(data, run)
    assert len(files) == 5

    for suffix in ("", "-wal", "-shm"):
        Path(f"{data / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    with pytest.raises(RuntimeError, match="replay-service reindex"):
        ServiceProcess(data).start()
    assert _segments(data, run) == files  # nothing deleted, nothing quarantined
    assert not (data / "index.sqlite").exists()

    Index(data / "index.sqlite").close()  # an empty index beside the segments is refused too
    with pytest.raises(RuntimeError, match="replay-service reindex"):
        ServiceProcess(data).start()

    done = _cli("reindex", "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 segments" in done.stdout
    assert list(data.glob("index.sqlite.before-reindex-*"))  # the empty one, kept aside

    with ServiceProcess(data) as service:
        assert _snapshot(service.url, run) == before
        assert ReplayClient(service.url).runs() == before_runs
        again = _rows(ReplayClient(service.url), run, "a", range(10), routes(np.random.default_rng(13), 16, SHAPE)[:10],
                      seq=0)
        assert again.duplicate is True  # digests were restored: a retry is still a retry
    assert _segments(data, run) == files


def test_reindex_takes_the_event_after_a_torn_journal_line_and_names_a_line_it_cannot_read(tmp_path):
    """A crash mid-append leaves a torn journal line, and the writer's retry appends the same event right after the
    torn bytes (O_APPEND): reindex takes that event (before, the whole line was skipped: the run's references were
    lost). A line of a newer journal major is not replayed: reindex rebuilds the rest and names it, exit status 1
    (before, it was replayed as if this release understood it)."""
    data = tmp_path / "data"
    run = "integrity-journal"
    with ServiceProcess(data) as service:
        _fill(service.url, run)
        before = _snapshot(service.url, run)
    journal = data / "runs" / run / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    assert b'"references"' in lines[-1]
    torn = lines[-1][: len(lines[-1]) // 2]  # the append the crash cut short; the retry's line follows it
    newer = b'{"format_version":"2.0","t":%d,"event":"end","request_id":"d","num_tokens":99,"status":"aborted"}\n'
    journal.write_bytes(b"".join(lines[:-1]) + torn + lines[-1] + newer % (time.time_ns(),))
    checked = _cli("verify", "--data", str(data))  # found before the index is lost
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"UNREADABLE runs/{run}/journal.jsonl line {len(lines) + 1}: " in checked.stdout
    assert "5 segments checked, 0 damaged; 4 journal lines read, 1 unreadable" in checked.stdout
    for suffix in ("", "-wal", "-shm"):
        Path(f"{data / 'index.sqlite'}{suffix}").unlink(missing_ok=True)

    done = _cli("reindex", "--data", str(data))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"NOT INDEXED runs/{run}/journal.jsonl line {len(lines) + 1}" in done.stderr
    assert "format_version 2.0 is newer than this reader knows" in done.stderr
    with ServiceProcess(data) as service:
        assert _snapshot(service.url, run) == before  # c's reference kept; d not ended by the line not understood


def test_stray_segment_is_quarantined_not_deleted(tmp_path):
    data = tmp_path / "data"
    run = "integrity-stray"
    with ServiceProcess(data) as service:
        _fill(service.url, run)
        before = _snapshot(service.url, run)
    files = _segments(data, run)
    stray = files[0].with_name(f"{uuid.uuid4().hex}.arrow")
    shutil.copyfile(files[0], stray)  # complete, named by no index row
    partial = files[0].with_name(f"{uuid.uuid4().hex}.arrow.tmp")
    partial.write_bytes(b"half a segment")
    with ServiceProcess(data) as service:
        assert _snapshot(service.url, run) == before
    assert not stray.exists() and not partial.exists()
    kept = data / "quarantine" / "runs" / run / stray.name
    assert kept.read_bytes() == files[0].read_bytes()
    assert _segments(data, run) == files
    assert "quarantined 1" in service.log_path.read_text()


def _flip(path: Path, ids: np.ndarray, at: int) -> None:
    blob = bytearray(path.read_bytes())
    offset = blob.find(ids.tobytes())
    assert offset >= 0 and blob.find(ids.tobytes(), offset + 1) < 0
    blob[offset + at] ^= 0x01
    path.write_bytes(bytes(blob))


def test_flipped_byte_is_never_served(shared_service):
    url, data, run = shared_service.url, shared_service.data_dir, "integrity-flip"
    client = ReplayClient(url)
    ids = routes(np.random.default_rng(5), 12, SHAPE)
    assert _rows(client, run, "r", range(12), ids, seq=0).stored
    assert _rows(client, run, "other", range(3), routes(np.random.default_rng(6), 3, SHAPE), seq=1).stored
    damaged = next(p for p in _segments(data, run) if ids.tobytes() in p.read_bytes())
    rel = damaged.relative_to(data / "runs").as_posix()

    _flip(damaged, ids, at=37)  # one id of row 1
    for params in ({}, {"strict": "true"}, {"format": "npy"}, {"format": "json"}):
        answer = calls.get(f"{url}/v1/runs/{run}/requests/r/routes", params=params, timeout=30)
        assert answer.status_code == 503, (params, answer.status_code, answer.text[:200])
        assert answer.json()["segment"] == rel and rel in answer.json()["detail"]
    batch = calls.post(f"{url}/v1/runs/{run}/routes/batch", json={"requests": ["r"]}, timeout=30)
    assert batch.status_code == 503 and batch.json()["segment"] == rel
    assert len(client.get_route(run, "other").positions) == 3  # other segments are served as before

    metrics = calls.get(f"{url}/metrics", timeout=30).text
    assert "replay_segments_damaged_total 1.0" in metrics
    assert "replay_damaged_reads_total 5.0" in metrics

    found = _cli("verify", "--data", str(data), "--run", run)
    assert found.returncode == 1, found.stdout + found.stderr
    assert f"DAMAGED runs/{rel}" in found.stdout and "2 segments checked, 1 damaged" in found.stdout

    _flip(damaged, ids ^ np.eye(1, ids.size, 37, dtype=ids.dtype).reshape(ids.shape), at=37)  # restored
    route = client.get_route(run, "r", strict=True)
    assert route.experts.tobytes() == ids.tobytes()
    assert _cli("verify", "--data", str(data), "--run", run).returncode == 0
