"""The operator tools and the start-up path on a PostgreSQL index and a bucket (REPLAY_INDEX_URL, REPLAY_SEGMENTS_URL).

Real parts: a throwaway PostgreSQL cluster (tests/support/postgres.py), a moto S3 server in its own process
(tests/support/s3.py) and real uvicorn replicas (tests/support/service.py). Two replicas, each with its own data
directory (two machines), share one database and one bucket; the CLI runs from a third, empty data directory,
so everything it finds comes from the settings the service reads, never from a local index.sqlite.

- `verify`, `export`, `gc --orphans` and `reindex` read the shared index and the bucket;
- run journals (journal.py) are objects in the bucket, every replica's, so `reindex` into a new, empty database
  rebuilds what both replicas were told (ends, references, creation time); a database holding runs is refused;
- deleting a run deletes its journal objects too;
- start-up: an object or a local file younger than REPLAY_ORPHAN_GRACE_S (another replica's ingest, not yet
  committed) neither refuses a replica's start nor is swept by it; past the grace, today's checks apply.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner, Result

from replay_client.client import ReplayClient
from replay_format.rows import Rows, RowsMeta
from replay_service.app import open_store
from replay_service.errors import IndexNeedsRebuild
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ops import cli
from replay_service.settings import ServiceSettings
from replay_service.store.lifecycle.journal import JOURNAL_DIR, JOURNAL_NAME
from replay_service.store.segments.cache import QUARANTINE_DIR
from replay_service.store.segments.places import S3Segments
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes, two_halves
from tests.support.service import ServiceProcess, calls

RUN = "tools"
LENGTHS = {"req-a": 300, "req-b": 41, "req-c": 120}


def _bodies() -> tuple[list[bytes], dict[str, np.ndarray]]:
    """Two batches of RUN (every request's first half, then the rest) and each request's full route."""
    return two_halves(RUN, LENGTHS, seed=11)


def _snapshot(url: str, run: str) -> dict:
    """Everything a reader sees of a run: its summary, its request listing, each request's summary and rows."""
    client = ReplayClient(url)
    listing = calls.get(f"{url}/v1/runs/{run}/requests", params={"limit": 100}, timeout=30).json()
    seen = {"run": client.run(run), "listing": listing, "load": client.expert_load(run)}
    for item in listing["items"]:
        rid = item["request_id"]
        route = client.get_route(run, rid)
        seen[rid] = (client.request(run, rid), route.positions.tolist(), route.experts.tobytes(),
                     route.flags.tolist())
    return seen


class Shared:
    """One database and one bucket, two replicas on them, and the environment a tool on a third machine gets."""

    def __init__(self, db: str, bucket: str, s3, root: Path) -> None:
        self.db, self.bucket, self.s3, self.root = db, bucket, s3, root
        self.env = {**s3.env(bucket), "REPLAY_INDEX_URL": db}
        self.url = f"s3://{bucket}/segments"
        self.replicas: tuple[ServiceProcess, ...] = ()
        self.full: dict[str, np.ndarray] = {}

    def store(self) -> S3Segments:
        """The bucket's segments, as the test looks into it (its own client)."""
        return S3Segments(self.s3.fs(), f"{self.bucket}/segments", self.url)

    def cli(self, *args: str, **env: str) -> Result:
        """Run `replay-service ARGS --data <an empty directory>` with the shared settings (and `env`).

        An exception other than the command's exit is raised here, with its traceback.
        """
        empty = self.root / f"tool-{time.monotonic_ns()}"
        done = CliRunner().invoke(cli.app, [*args, "--data", str(empty)], env={**self.env, **env})
        if done.exception is not None and not isinstance(done.exception, SystemExit):
            raise done.exception
        return done


@pytest.fixture(scope="module")
def shared(postgres, moto_s3, tmp_path_factory):
    """Replicas A and B (own data directories) on one database and bucket; RUN written through both."""
    root = tmp_path_factory.mktemp("tools")
    setup = Shared(postgres.new_database(), moto_s3.bucket(), moto_s3, root)
    bodies, full = _bodies()
    a = ServiceProcess(root / "a", env=setup.env).start()
    b = ServiceProcess(root / "b", env=setup.env).start()
    try:
        ca, cb = ReplayClient(a.url), ReplayClient(b.url)
        assert ca.ingest(bodies[0]).stored
        assert cb.ingest(bodies[1]).stored
        cb.finish(RUN, "req-a", LENGTHS["req-a"] + 1)  # told only to B
        ca.finish(RUN, "req-b", LENGTHS["req-b"] + 3, status="aborted")  # told only to A: GAP rows at its end
        refs = calls.post(f"{b.url}/v1/runs/{RUN}/references", timeout=30, json={"references": [
            {"request_id": "req-d", "start": 0, "end": 10, "source_request_id": "req-a"}]})
        assert refs.status_code == 200, refs.text
        setup.replicas = (a, b)
        setup.full = full
        yield setup
    finally:
        a.stop()
        b.stop()


def test_journals_are_objects_in_the_bucket_with_every_replicas_events(shared):
    for replica in shared.replicas:
        assert not list((replica.data_dir / "runs").rglob(JOURNAL_NAME))  # nothing only one machine holds
    journal = shared.store().other_objects(f"{RUN}/{JOURNAL_DIR}", ".jsonl")
    assert len(journal) == 4  # the run's creation, two ends (one per replica), one references call
    assert not any(o.path.endswith(".arrow") for o in journal)
    assert len(shared.store().paths()) == 2  # segment listings (and the orphan collector) do not see them


def test_verify_reads_the_shared_index_and_the_bucket(shared):
    done = shared.cli("verify")
    assert done.exit_code == 0, done.output
    assert "2 segments checked, 0 damaged" in done.output
    fs, store = shared.s3.fs(), shared.store()
    victim = store.paths()[0]
    key = f"{shared.bucket}/segments/{victim}"
    with fs.open_input_stream(key) as f:
        good = f.read()
    fs.delete_file(key)  # named by the shared index, gone from the bucket
    try:
        done = shared.cli("verify")
        assert done.exit_code == 1, done.output
        assert f"DAMAGED runs/{victim}" in done.output and "missing" in done.output
    finally:
        with fs.open_output_stream(key) as out:
            out.write(good)


def test_export_reads_the_shared_index_and_the_bucket(shared):
    target = shared.root / "tools.parquet"
    done = shared.cli("export", RUN, "--to", str(target))
    assert done.exit_code == 0, done.output
    table = pq.read_table(target)
    for rid, expected in shared.full.items():
        rows = table.filter(table.column("request").to_numpy(zero_copy_only=False) == rid)
        experts = np.array(rows.column("experts").to_pylist(), np.uint8)
        assert experts[: len(expected)].tobytes() == expected.astype(np.uint8).tobytes(), rid
        flags = rows.column("flags").to_numpy()
        assert not flags[: len(expected)].any() and flags[len(expected):].all(), rid  # req-b's end: GAP rows
    missing = shared.cli("export", "no-such-run", "--to", str(shared.root / "none.parquet"))
    assert missing.exit_code == 1 and "not found" in missing.output


def test_gc_orphans_reads_the_shared_index(shared):
    orphan = f"{RUN}/{'0' * 32}.arrow"  # an upload whose ingest never committed
    with shared.s3.fs().open_output_stream(f"{shared.bucket}/segments/{orphan}") as out:
        out.write(b"not committed")
    kept = shared.cli("gc", "--orphans")
    assert kept.exit_code == 0, kept.output
    assert "0 orphan segments deleted" in kept.output and "1 younger" in kept.output
    time.sleep(0.2)  # older than the grace below (not a timing assertion: only an order of events)
    gone = shared.cli("gc", "--orphans", REPLAY_ORPHAN_GRACE_S="0.1")
    assert gone.exit_code == 0, gone.output
    assert "1 orphan segments deleted" in gone.output
    assert orphan not in shared.store().paths() and len(shared.store().paths()) == 2  # indexed ones stay
    assert len(shared.store().other_objects(f"{RUN}/{JOURNAL_DIR}", ".jsonl")) == 4  # journals are no orphans


def test_reindex_rebuilds_a_lost_database_from_the_bucket(shared, postgres):
    """The database is lost: a new, empty one is rebuilt from the bucket's segments and journals, and a replica
    on it serves what the replicas on the old one served (B's end and references included)."""
    before = _snapshot(shared.replicas[0].url, RUN)
    fresh = postgres.new_database()
    done = shared.cli("reindex", REPLAY_INDEX_URL=fresh)
    assert done.exit_code == 0, done.output
    assert "1 runs, 2 segments" in done.output and "3 journal events replayed" in done.output  # ends, references
    with ServiceProcess(shared.root / "c", env={**shared.env, "REPLAY_INDEX_URL": fresh}) as replica:
        after = _snapshot(replica.url, RUN)
    assert after == before
    assert after["req-a"][0].status == "finished" and after["req-b"][0].status == "aborted"
    again = shared.cli("reindex", REPLAY_INDEX_URL=fresh)  # now it holds a run: refused, nothing changed
    assert again.exit_code == 2, again.output
    assert "needs an empty database" in again.output and "holds 1 runs" in again.output


def test_deleting_a_run_deletes_its_journal_objects(shared):
    url = shared.replicas[1].url
    client = ReplayClient(url)
    rng = np.random.default_rng(2)
    body = bytes(batch_bytes("gone", "w", 0, ["r"] * 8, np.arange(8), routes(rng, 8)))
    assert client.ingest(body).stored
    client.finish("gone", "r", 9)
    assert shared.store().other_objects(f"gone/{JOURNAL_DIR}", ".jsonl")
    assert calls.delete(f"{url}/v1/runs/gone", timeout=30).status_code == 200
    assert shared.store().other_objects("gone", "") == []  # segments and journal alike


# ---- start-up: another replica's uncommitted writes survive a replica's start


@pytest.fixture
def aws(moto_s3, monkeypatch):
    """The test process's own AWS variables (in-process store code reads them as the service does)."""
    for key, value in moto_s3.aws_env().items():
        monkeypatch.setenv(key, value)
    return moto_s3


def test_a_young_object_does_not_stop_a_replicas_start(postgres, aws, tmp_path):
    """A fresh database and bucket: replica A has uploaded its first segment, not yet committed, when replica B
    starts. B starts (the object may be A's ingest) and leaves the object alone; past the grace the object is
    evidence of a lost index again, and the start is refused as before."""
    bucket = aws.bucket()
    db = postgres.new_database()
    pending = f"{RUN}/{'a' * 32}.arrow"
    with aws.fs().open_output_stream(f"{bucket}/segments/{pending}") as out:
        out.write(b"uploaded, about to be committed by another replica")
    settings = ServiceSettings(data_dir=tmp_path / "b", index_url=db, segments_url=f"s3://{bucket}/segments")
    store = open_store(settings)
    store.close()
    listed = S3Segments(aws.fs(), f"{bucket}/segments", "").paths()
    assert listed == [pending]
    time.sleep(0.2)  # older than the grace below (an order of events, not a timing assertion)
    with pytest.raises(IndexNeedsRebuild, match="reindex"):
        open_store(settings.model_copy(update={"orphan_grace_s": 0.1}))


def test_a_shared_data_directory_is_swept_past_the_grace_only(postgres, tmp_path):
    """Processes sharing a data directory and a PostgreSQL index: a segment file another one wrote and has not
    committed yet, and its unfinished `.tmp`, survive a second process's start; once older than the grace they
    are a crashed process's leftovers and the start-up sweep takes them (quarantine, delete) as on one process."""
    data = tmp_path / "data"
    settings = ServiceSettings(data_dir=data, index_url=postgres.new_database())
    first = open_store(settings)
    pipeline = IngestPipeline.over(first)
    experts = routes(np.random.default_rng(4), 8)
    pipeline.ingest(Rows(RowsMeta(RUN, "w", 0, QWEN3_SHAPE), ["r"], np.zeros(8, np.int32), np.arange(8, dtype=np.int32),
                      np.arange(8, dtype=np.int32), experts.reshape(8, -1), np.zeros(8, np.uint16)))
    pipeline.close()
    first.close()
    folder = data / "runs" / RUN
    written, unfinished = folder / f"{'b' * 32}.arrow", folder / f"{'c' * 32}.arrow.tmp"
    written.write_bytes(b"renamed into place, commit under way")
    unfinished.write_bytes(b"being written")
    second = open_store(settings)
    second.close()
    assert written.exists() and unfinished.exists()
    assert not second.swept.removed and not second.swept.quarantined
    old = time.time() - 2 * settings.orphan_grace_s
    for path in (written, unfinished):
        os.utime(path, (old, old))
    third = open_store(settings)
    third.close()
    assert not written.exists() and not unfinished.exists()
    assert third.swept.removed == [unfinished]
    assert (data / QUARANTINE_DIR / "runs" / RUN / written.name).exists()  # kept, never deleted
    assert len(list(folder.glob("*.arrow"))) == 1  # the committed segment stays
