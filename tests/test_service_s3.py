"""Segments in an S3-compatible bucket (REPLAY_SEGMENTS_URL): a real S3 HTTP endpoint (moto server) on loopback.

The same batches go to a service on local files and to one on the bucket; every read format answers the same
bytes from both. Retries are stored once; verify and reindex work on the bucket; orphans are collected after
their grace period only; an unusable bucket refuses the start, naming REPLAY_SEGMENTS_URL, at once or after
REPLAY_START_WAIT_S of tries (and a bucket made within them is served).
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pyarrow.fs as pafs
import pytest

from replay_client.client import ReplayClient
from replay_format.core import ARROW_STREAM_MEDIA_TYPE
from replay_service.app import open_store
from replay_service.errors import IndexNeedsRebuild
from replay_service.ops.reindex import reindex
from replay_service.ops.verify import verify_store
from replay_service.settings import ServiceSettings
from replay_service.store.index import Index
from replay_service.store.lifecycle.retention import collect_orphans
from replay_service.store.segments.cache import SegmentCache
from replay_service.store.segments.places import S3Segments, open_segment_store
from tests.support.data import batch_bytes, routes, two_halves
from tests.support.s3 import MotoS3
from tests.support.service import ServiceProcess, free_port

LENGTHS = {"req-a": 300, "req-b": 41, "req-c": 1000}
RUN = "s3rt"


@pytest.fixture(scope="module")
def s3():
    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture
def aws(s3, monkeypatch):
    """The test process's own AWS variables (in-process store code reads them as the service does)."""
    for key, value in s3.aws_env().items():
        monkeypatch.setenv(key, value)
    return s3


def _batches() -> tuple[list[bytes], dict[str, np.ndarray]]:
    """Two batches of RUN (every request's first half, then the rest) and each request's full route."""
    return two_halves(RUN, LENGTHS, seed=3)


def _store(client: ReplayClient, bodies: list[bytes]) -> None:
    for body in bodies:
        assert client.ingest(body).stored
    for rid, n in LENGTHS.items():
        client.finish(RUN, rid, n + 1)


@pytest.fixture(scope="module")
def pair(s3, tmp_path_factory):
    """A service on local files and one on a bucket, holding the same batches."""
    bucket = s3.bucket()
    bodies, full = _batches()
    local = ServiceProcess(tmp_path_factory.mktemp("local") / "data").start()
    remote = ServiceProcess(tmp_path_factory.mktemp("s3") / "data", env=s3.env(bucket)).start()
    try:
        for service in (local, remote):
            _store(ReplayClient(service.url), bodies)
        yield local, remote, bucket, bodies, full
    finally:
        local.stop()
        remote.stop()


def test_segments_are_objects_in_the_bucket(pair, s3):
    _, remote, bucket, _, _ = pair
    assert not list((remote.data_dir / "runs").rglob("*.arrow"))  # only the run's journal is local
    stored = S3Segments(s3.fs(), f"{bucket}/segments", f"s3://{bucket}/segments").paths()
    assert len(stored) == 2 and all(p.startswith(f"{RUN}/") for p in stored)
    index = Index(remote.data_dir / "index.sqlite", fsync=False)
    try:
        assert index.indexed_paths() == set(stored)
    finally:
        index.close()


def test_every_read_format_is_byte_equal_to_local_files(pair):
    local, remote, _, _, full = pair
    a, b = ReplayClient(local.url), ReplayClient(remote.url)
    for rid, expected in full.items():
        route = b.get_route(RUN, rid, strict=True)
        assert route.experts.tobytes() == expected.tobytes() and route.clean
        for params in ({}, {"format": "npy"}, {"format": "json"}, {"start": 7, "end": 40}):
            path = f"/v1/runs/{RUN}/requests/{rid}/routes"
            one, other = a.http.get(path, params=params), b.http.get(path, params=params)
            assert one.status_code == other.status_code == 200
            assert one.content == other.content, params
    batch = {"requests": list(LENGTHS)}
    one, other = (c.http.post(f"/v1/runs/{RUN}/routes/batch", json=batch) for c in (a, b))
    assert one.status_code == 200 and one.content == other.content
    doc = {"sequences": [{"run": RUN, "request": r} for r in LENGTHS], "pad_multiple": 8}
    one, other = (c.http.post("/v1/trainer/megatron", json=doc) for c in (a, b))
    assert one.status_code == 200 and one.content == other.content


def test_a_retry_is_stored_once(pair, s3):
    _, remote, bucket, bodies, _ = pair
    client = ReplayClient(remote.url)
    again = client.ingest(bodies[1])
    assert not again.stored
    assert len(S3Segments(s3.fs(), f"{bucket}/segments", "").paths()) == 2  # the retry's upload was deleted


def test_a_read_fetches_a_segment_once(pair, aws):
    _, remote, bucket, _, full = pair
    store = open_segment_store(remote.data_dir, f"s3://{bucket}/segments")
    assert isinstance(store, S3Segments)
    cache = SegmentCache(store, capacity=8)
    (first, *_) = store.objects()
    cache.get(first.path)
    assert store.bytes_fetched == first.size  # the whole object, once: its CRC32C covers every byte
    cache.get(first.path)
    assert store.bytes_fetched == first.size  # then served from memory


def test_verify_finds_a_damaged_object(pair, aws, s3):
    _, remote, bucket, _, _ = pair
    store = open_segment_store(remote.data_dir, f"s3://{bucket}/segments")
    found = verify_store(remote.data_dir, store=store)
    assert (found.segments, found.damaged, found.unreadable) == (2, [], [])
    assert found.journal_lines > 0  # the run's journal objects in the bucket, read as reindex reads them
    fs = s3.fs()
    victim = store.paths()[0]
    key = f"{bucket}/segments/{victim}"
    with fs.open_input_stream(key) as f:
        good = f.read()
    image = bytearray(good)
    image[len(image) // 2] ^= 0xFF  # somewhere in the ids
    try:
        with fs.open_output_stream(key) as out:
            out.write(bytes(image))
        found = verify_store(remote.data_dir, store=store)
        assert found.segments == 2 and [p for p, _ in found.damaged] == [victim]
        assert f"s3://{bucket}/segments/{victim}" in found.damaged[0][1]
    finally:
        with fs.open_output_stream(key) as out:
            out.write(good)


def test_orphans_are_deleted_after_their_grace_only(pair, aws, s3):
    _, remote, bucket, _, _ = pair
    store = open_segment_store(remote.data_dir, f"s3://{bucket}/segments")
    orphan = f"{RUN}/{'0' * 32}.arrow"  # an upload whose ingest never committed
    with s3.fs().open_output_stream(f"{bucket}/segments/{orphan}") as out:
        out.write(b"not committed")
    made = next(o.mtime for o in store.objects() if o.path == orphan)
    index = Index(remote.data_dir / "index.sqlite", fsync=False)
    try:
        young = collect_orphans(store, index, grace_s=3600, now=made + 3599)
        assert young.deleted == [] and young.young == [orphan]
        old = collect_orphans(store, index, grace_s=3600, now=made + 3601)
        assert old.deleted == [orphan]
        assert set(store.paths()) == index.indexed_paths()  # indexed objects stay, however old
    finally:
        index.close()


def test_reindex_rebuilds_from_the_bucket(s3, aws, tmp_path):
    bucket = s3.bucket()
    bodies, full = _batches()
    data = tmp_path / "data"
    with ServiceProcess(data, env=s3.env(bucket)) as service:
        _store(ReplayClient(service.url), bodies)
    (data / "index.sqlite").unlink()
    for side in ("-wal", "-shm"):
        (data / f"index.sqlite{side}").unlink(missing_ok=True)
    settings = ServiceSettings(data_dir=data, segments_url=f"s3://{bucket}/segments")
    with pytest.raises(IndexNeedsRebuild, match=f"s3://{bucket}/segments"):
        open_store(settings)
    report = reindex(data, settings)
    assert (report.runs, report.segments, report.damaged) == (1, 2, [])
    with ServiceProcess(data, env=s3.env(bucket)) as service:
        client = ReplayClient(service.url)
        for rid, expected in full.items():
            route = client.get_route(RUN, rid, strict=True)
            assert route.experts.tobytes() == expected.tobytes()


@pytest.mark.parametrize("where", ["missing bucket", "wrong endpoint"])
def test_an_unusable_bucket_refuses_the_start(s3, tmp_path, where):
    env = s3.env("no-such-bucket") if where == "missing bucket" else {
        **s3.env(s3.bucket()), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    service = ServiceProcess(tmp_path / "data", env=env)
    with pytest.raises(RuntimeError) as refused:
        service.start()
    assert "exited with 2" in str(refused.value)
    assert "REPLAY_SEGMENTS_URL=s3://" in str(refused.value)



def test_a_start_waits_for_a_bucket_made_later_when_told_to(s3, tmp_path):
    """REPLAY_START_WAIT_S: a replica started before its bucket exists (compose, Kubernetes) keeps trying, and
    serves once the bucket is there; each miss is logged."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    service = ServiceProcess(tmp_path / "data", env={**s3.env(name), "REPLAY_START_WAIT_S": "60"})
    stop = threading.Event()

    def make_after_a_miss() -> None:  # the bucket appears once the start has missed it (not after a set time: a
        # start slowed by a loaded machine came after a 2 s timer's bucket, 2026-12-06)
        while not stop.wait(0.1):
            if service.log_path.is_file() and "trying again" in service.log_path.read_text():
                s3.bucket(name)
                return

    maker = threading.Thread(target=make_after_a_miss, daemon=True)
    maker.start()
    try:
        with service:
            sent = routes(np.random.default_rng(7), 8)
            with ReplayClient(service.url) as client:
                client.ingest(batch_bytes(RUN, "w", 0, ["r"] * 8, np.arange(8), sent))
                assert client.get_route(RUN, "r").experts.tobytes() == sent.tobytes()
    finally:
        stop.set()
        maker.join(timeout=10)
    assert "trying again" in service.log_path.read_text()
    assert name in {info.base_name for info in s3.fs().get_file_info(pafs.FileSelector("/"))}


def test_a_start_that_waited_in_vain_refuses_naming_the_bucket(s3, tmp_path):
    service = ServiceProcess(tmp_path / "data", env={**s3.env("never-made"), "REPLAY_START_WAIT_S": "2"})
    with pytest.raises(RuntimeError) as refused:
        service.start()
    assert "exited with 2" in str(refused.value)
    assert "REPLAY_SEGMENTS_URL=s3://never-made" in str(refused.value)
    assert "trying again" in str(refused.value)

def test_a_bucket_gone_at_run_time_answers_503_and_indexes_nothing(tmp_path):
    """The store stops answering after start-up: an uncached read and an ingest answer 503 naming the store;
    the failed ingest is neither indexed nor acknowledged; a retry of a stored batch is still answered (index)."""
    own = MotoS3().start()  # its own server: this test stops it
    bucket = own.bucket()
    bodies, _ = _batches()
    data = tmp_path / "data"
    try:
        with ServiceProcess(data, env=own.env(bucket)) as service:
            client = ReplayClient(service.url)
            assert client.ingest(bodies[0]).stored  # not read back: its segment is in no cache
            assert client.http.get("/healthz").status_code == 200
            own.stop()
            url = f"s3://{bucket}/segments"
            health = client.http.get("/healthz")  # a load balancer's check takes the replica out
            assert health.status_code == 503 and health.json()["segment_store"] == url, health.text
            read = client.http.get(f"/v1/runs/{RUN}/requests/req-a/routes")
            assert read.status_code == 503, read.text
            assert read.json()["segment_store"] == url and url in read.json()["detail"]
            ingest = client.http.post("/v1/ingest", content=bodies[1],
                                      headers={"content-type": ARROW_STREAM_MEDIA_TYPE})
            assert ingest.status_code == 503, ingest.text
            assert ingest.json()["segment_store"] == url
            retry = client.ingest(bodies[0])  # answered from the index: the store is not needed
            assert not retry.stored
            index = Index(data / "index.sqlite", fsync=False)
            try:
                assert len(index.indexed_paths()) == 1  # only the batch acknowledged before
                assert index.stored_digest(RUN, "w", 1) is None  # the refused one: nothing of it
            finally:
                index.close()
    finally:
        own.stop()
