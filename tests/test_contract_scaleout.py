"""The service contract suite on the issue's second combination: a PostgreSQL index and segments in S3.

The contract modules (round trips in every format, flags and strict reads, ingest and idempotent retries,
bad input, prefix-cache references, group commit) run on the `service`/`shared_service` fixtures, whose
backends `REPLAY_TEST_INDEX` and `REPLAY_TEST_SEGMENTS` choose (tests/conftest.py). The full suite runs them
on SQLite+local files as it always did; `test_the_contract_suite_on_postgresql_and_s3` runs them again in a
child pytest with a throwaway PostgreSQL cluster and a moto S3 server (both started by that child), so one
`pytest` run covers both combinations. Their slow tests (kill -9 rounds) start their own services on local
files and are not repeated there.

`test_the_fixtures_use_the_chosen_backends` runs in both: it shows where a fixture's service really keeps
its index and its segments, so the child's pass is not the default combination's pass again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from replay_client.client import ReplayClient
from tests.support.data import batch_bytes, routes

ROOT = Path(__file__).resolve().parent.parent

# The contract modules, run whole (each passes on PostgreSQL+S3; their slow tests are left out by -m).
CONTRACT = [
    "tests/test_service_roundtrip.py",
    "tests/test_service_flags.py",
    "tests/test_service_ingest.py",
    "tests/test_service_bad_input.py",
    "tests/test_service_references.py",
    "tests/test_service_group_commit.py",
    "tests/test_service_health.py",
]


def test_the_fixtures_use_the_chosen_backends(shared_service):
    """A batch sent to `shared_service` lands where REPLAY_TEST_INDEX and REPLAY_TEST_SEGMENTS say."""
    rng = np.random.default_rng(15)
    experts = routes(rng, 12)
    body = bytes(batch_bytes("scaleout-probe", "w", 0, ["probe"] * 12, np.arange(12), experts))
    client = ReplayClient(shared_service.url)
    assert client.ingest(body).stored
    assert client.get_route("scaleout-probe", "probe").experts.tobytes() == experts.tobytes()
    data = shared_service.data_dir
    local_segments = list((data / "runs" / "scaleout-probe").glob("*.arrow"))
    index_url = shared_service.env.get("REPLAY_INDEX_URL", "")
    segments_url = shared_service.env.get("REPLAY_SEGMENTS_URL", "")
    if os.environ.get("REPLAY_TEST_INDEX", "sqlite") == "postgresql":
        assert index_url.startswith("postgresql://") and not (data / "index.sqlite").exists()
    else:
        assert not index_url and (data / "index.sqlite").exists()
    if os.environ.get("REPLAY_TEST_SEGMENTS", "local") == "s3":
        assert segments_url.startswith("s3://") and not local_segments
        env = shared_service.env
        endpoint = env["AWS_ENDPOINT_URL"].split("://", 1)[1]
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region=env["AWS_REGION"],
                               access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"])
        base = segments_url.removeprefix("s3://").rstrip("/") + "/scaleout-probe"
        objects = fs.get_file_info(pafs.FileSelector(base, recursive=True))
        # one segment; beside it the run's journal events (journal.py), objects of their own in a bucket
        assert sum(o.base_name.endswith(".arrow") for o in objects) == 1
        assert all(o.base_name.endswith(".arrow") or "/journal" in o.path for o in objects), objects
    else:
        assert not segments_url and len(local_segments) == 1


def test_the_contract_suite_on_postgresql_and_s3():
    """The contract modules in a child pytest on a PostgreSQL index and an S3 bucket (slow: ~45 s)."""
    env = {**os.environ, "REPLAY_TEST_INDEX": "postgresql", "REPLAY_TEST_SEGMENTS": "s3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    probe = "tests/test_contract_scaleout.py::test_the_fixtures_use_the_chosen_backends"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           probe, *CONTRACT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout and " error" not in done.stdout
