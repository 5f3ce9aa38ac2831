"""A training step's first fetch, as training meets it: rows shipped as the sink ships them, read by many ranks at once
right after ingest, on a service of two workers.

Each segment is opened (mapped and checked whole) by one read of a worker while the others needing it wait for that
read (store/segments/cache.py), and a segment's columns are decoded once per opening (store/requests/rows.py). What
that must not change: every rank's answer equals the rows sent, and a segment damaged after ingest is refused on its
first open, to every read at once, in every worker.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from bench.segment_files import RUN, SHAPE, load_store_as_sink
from bench.step_fetch import rank_query
from replay_client import ReplayClient
from replay_service.app import open_store
from replay_service.errors import DamagedSegment
from replay_service.ingest.decode import decode_batch
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ops.demo import bulk_routes
from replay_service.settings import ServiceSettings
from replay_service.store.segments import cache as cache_module
from replay_service.store.segments import integrity
from replay_service.store.segments.cache import SegmentCache
from replay_service.store.segments.integrity import open_segment
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

REQUESTS = [f"r{i:04d}" for i in range(16)]
ROWS = 255  # 256 tokens


@pytest.fixture
def sink_service(tmp_path):
    """Two workers over a step's rows shipped as a sink ships them (4 writers, prompts and decodes interleaved)."""
    with ServiceProcess(tmp_path / "data", workers=2, env={"REPLAY_FSYNC": "false"}) as service:
        clients = [ReplayClient(service.url) for _ in range(4)]
        try:
            load_store_as_sink(clients, REQUESTS, ROWS, prompt=64, batch_rows=512)
        finally:
            for client in clients:
                client.close()
        yield service


def _sent() -> np.ndarray:
    """The rows the loader sent, `(request, position, L, K)` (it draws them the same way)."""
    return bulk_routes(ROWS * len(REQUESTS), 0).reshape(len(REQUESTS), ROWS, SHAPE.num_moe_layers, SHAPE.top_k)


def test_first_fetch_at_once_answers_every_rank_the_rows_sent(sink_service):
    sequences = [(RUN, r) for r in REQUESTS]
    ranks = 16  # DP 4 x CP 2 x TP 2, megatron THD
    barrier = threading.Barrier(ranks)

    def fetch(rank: int) -> tuple[int, bytes]:
        seqs, options = rank_query(rank, ranks, sequences, None)
        with ReplayClient(sink_service.url) as client:
            barrier.wait()  # every rank's first fetch at once: no segment opened yet in either worker
            return rank, np.asarray(client.megatron_batch(seqs, packing="thd", **options).experts).tobytes()

    with ThreadPoolExecutor(ranks) as pool:
        first = dict(pool.map(fetch, range(ranks)))
    sent = _sent()
    with ReplayClient(sink_service.url) as client:
        for i, request in enumerate(REQUESTS):  # every row as sent, whichever batches carried it
            assert client.get_route(RUN, request, strict=True).experts.tobytes() == sent[i].tobytes(), request
        for rank in range(ranks):  # each rank's first answer, byte for byte what one client reads later in turn
            seqs, options = rank_query(rank, ranks, sequences, None)
            again = np.asarray(client.megatron_batch(seqs, packing="thd", **options).experts).tobytes()
            assert first[rank] == again, rank


def test_a_segment_damaged_after_ingest_is_refused_to_every_first_read_at_once(sink_service):
    segments = sorted((sink_service.data_dir / "runs" / RUN).glob("*.arrow"))
    damaged = segments[len(segments) // 2]
    blob = bytearray(damaged.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # inside the rows' buffers
    damaged.write_bytes(bytes(blob))
    rel = damaged.relative_to(sink_service.data_dir / "runs").as_posix()
    barrier = threading.Barrier(12)

    def read(i: int) -> tuple[int, dict]:
        barrier.wait()
        answer = calls.post(f"{sink_service.url}/v1/runs/{RUN}/routes/batch", json={"requests": REQUESTS}, timeout=60)
        return answer.status_code, answer.json() if answer.status_code != 200 else {}

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(read, range(12)))
    assert all(status == 503 and body["segment"] == rel for status, body in answers), answers


def test_concurrent_first_reads_open_a_segment_once_and_share_it(tmp_path, monkeypatch):
    runs, path = _one_segment(tmp_path)
    opened: list[str] = []
    real_open = cache_module.open_segment

    def counting_open(store, rel_path, pool=None):
        opened.append(rel_path)
        return real_open(store, rel_path, pool)

    monkeypatch.setattr(cache_module, "open_segment", counting_open)
    cache = SegmentCache(runs, capacity=64)
    barrier = threading.Barrier(8)

    def get(_: int):
        barrier.wait()
        return cache.get(path)

    with ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(get, range(8)))
    assert opened == [path]  # one open and one checksum pass for eight reads
    assert all(b is batches[0] for b in batches)


def _one_segment(tmp_path) -> tuple[Path, str]:
    """A data directory's runs folder holding one request's rows (written by a real service), and one segment."""
    with ServiceProcess(tmp_path / "data", env={"REPLAY_FSYNC": "false"}) as service, \
            ReplayClient(service.url) as client:
        load_store_as_sink([client], REQUESTS[:2], ROWS, prompt=64, batch_rows=512)
        runs = service.data_dir / "runs"
    return runs, sorted(p.relative_to(runs).as_posix() for p in (runs / RUN).glob("*.arrow"))[0]


def _damage_keeping_the_stamp(path: Path) -> None:
    """Flip one byte of the rows in place, then put the file's modification time back (same inode, same size)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_worker_pool_checks_each_file_once_and_a_new_pool_checks_again(tmp_path, monkeypatch):
    runs, rel = _one_segment(tmp_path)
    summed: list[int] = []
    real_crc = integrity.segment_crc
    monkeypatch.setattr(integrity, "segment_crc", lambda batch, md=None: summed.append(1) or real_crc(batch, md))
    first = open_segment(runs, rel, pool="pool-a")
    second = open_segment(runs, rel, pool="pool-a")  # another worker of the same service
    assert len(summed) == 1
    assert first.equals(second)
    assert os.getxattr(runs / rel, integrity.CHECKED_ATTR).startswith(b"pool-a:")

    _damage_keeping_the_stamp(runs / rel)
    for pool in ("pool-b", None):  # a restarted service, a command-line tool: checked whole, refused
        with pytest.raises(DamagedSegment):
            open_segment(runs, rel, pool=pool)


def test_a_restarted_service_refuses_a_file_damaged_behind_its_predecessors_check(tmp_path):
    runs, rel = _one_segment(tmp_path)
    data = runs.parent
    with ServiceProcess(data, workers=2, env={"REPLAY_FSYNC": "false"}) as service:
        assert calls.post(f"{service.url}/v1/runs/{RUN}/routes/batch", json={"requests": REQUESTS[:2]},
                          timeout=60).status_code == 200
    assert os.getxattr(runs / rel, integrity.CHECKED_ATTR)  # its workers' pool checked it
    _damage_keeping_the_stamp(runs / rel)
    with ServiceProcess(data, workers=2, env={"REPLAY_FSYNC": "false"}) as service:
        answer = calls.post(f"{service.url}/v1/runs/{RUN}/routes/batch", json={"requests": REQUESTS[:2]}, timeout=60)
        assert answer.status_code == 503 and answer.json()["segment"] == rel, answer.text[:300]


def test_a_stored_segment_is_checked_off_the_request_path_and_its_first_read_maps_it(tmp_path, monkeypatch):

    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    try:
        sent = routes(np.random.default_rng(3), 32)
        pipeline.ingest(decode_batch("", batch_bytes("bg", "w", 0, ["r"] * 32, np.arange(32), sent)))
        assert store.cache.checked_all(timeout=120)
        (segment,) = (tmp_path / "data" / "runs" / "bg").glob("*.arrow")
        assert os.getxattr(segment, integrity.CHECKED_ATTR).startswith(store.cache.pool.encode())
        summed: list[int] = []
        real_crc = integrity.segment_crc
        monkeypatch.setattr(integrity, "segment_crc", lambda batch, md=None: summed.append(1) or real_crc(batch, md))
        assert store.read_route("bg", "r").experts.tobytes() == sent.reshape(32, -1).tobytes()
        assert summed == []  # the first read mapped it, checked already
    finally:
        pipeline.close()
        store.close()
