"""Stored comparisons with replicas (replay_service/store/tables/compares.py): on PostgreSQL + a bucket any replica
reads what another stored.

Before, the mismatch file stayed in the storing replica's `<data>/compares/` while its index row was shared, so
another replica named the comparison in its list and then failed to read it. Two real replicas (separate data
directories) on one PostgreSQL database and one moto S3 bucket.
"""

from __future__ import annotations

import numpy as np
import pyarrow.fs as pafs

from replay_client.client import ReplayClient
from tests.support.data import QWEN3_SHAPE, store_requests
from tests.support.service import ServiceProcess, calls

LENGTHS = {"c-a": 65, "c-b": 33}


def test_a_comparison_stored_on_one_replica_reads_on_another(tmp_path, postgres, moto_s3):
    bucket = moto_s3.bucket()
    env = {"REPLAY_INDEX_URL": postgres.new_database(), **moto_s3.env(bucket)}
    with ServiceProcess(tmp_path / "a", env=env) as a, ServiceProcess(tmp_path / "b", env=env) as b:
        first, second = ReplayClient(a.url), ReplayClient(b.url)
        full = store_requests(first, "cmp", LENGTHS, seed=4)
        trainer = full["c-a"].copy()
        trainer[10, 2, 0] = np.setdiff1d(np.arange(QWEN3_SHAPE.num_experts), full["c-a"][10, 2])[0]  # out of the set
        result = first.compare("cmp", ["c-a"] * 64, np.arange(64), trainer, label="x")
        assert result["token_mismatch"] == 1 / 64
        assert second.compares("cmp")[0]["compare_id"] == result["compare_id"]
        here = first.compare_request("cmp", result["compare_id"], "c-a", start=9, end=12)
        there = second.compare_request("cmp", result["compare_id"], "c-a", start=9, end=12)
        assert there == here and there["mismatch"][1][2] == 1  # position 10, layer 2
        fs = moto_s3.fs()
        assert _npz(fs, bucket) == [f"{bucket}/segments/cmp/compares/{result['compare_id']}.npz"]
        assert not (tmp_path / "a" / "compares" / "cmp").exists()  # nothing of it kept on the storing machine
        assert calls.delete(f"{b.url}/v1/runs/cmp").status_code == 200
        assert _npz(fs, bucket) == []


def _npz(fs: pafs.FileSystem, bucket: str) -> list[str]:
    return [i.path for i in fs.get_file_info(pafs.FileSelector(bucket, recursive=True)) if i.path.endswith(".npz")]
