"""Segment compression through a real server (`REPLAY_SEGMENT_COMPRESSION`, segment.md "Compression").

One run written by three service starts, each with another codec (zstd, lz4, none): every request reads back
byte-equal on every read path (Arrow GET, .npy GET, the batch read, the trainer slice) while its own codec's
server runs and after the last start; `replay-service verify` passes, `export` writes the same ids, and a
reindex restores the same reads.
`bytes_per_id` in the run summary is the segment bytes over the stored ids, < 1 with zstd on skewed ids.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from replay_client.client import ReplayClient
from replay_format import RunShape
from replay_format.segment import SegmentCompression
from tests.support.data import batch_bytes, skewed_routes
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=16, top_k=8, num_experts=128)
ROWS = 600  # per request


def store_sent(client: ReplayClient, run: str, writer: str, requests: dict[str, np.ndarray]) -> None:
    """One batch of every request's rows (token ids: position + 7), then each request finished."""
    names = [r for r, ids in requests.items() for _ in range(len(ids))]
    positions = np.concatenate([np.arange(len(ids), dtype=np.int32) for ids in requests.values()])
    experts = np.concatenate(list(requests.values()))
    assert client.ingest(batch_bytes(run, writer, 0, names, positions, experts.reshape(len(names), -1),
                                     shape=SHAPE, token_ids=positions + 7)).stored
    for name, ids in requests.items():
        client.finish(run, name, len(ids) + 1)


def check_reads(client: ReplayClient, run: str, sent: dict[str, np.ndarray]) -> None:
    """Every read path answers the ids sent, byte for byte."""
    names = list(sent)
    for name in names:
        assert client.get_route(run, name).experts.tobytes() == sent[name].tobytes()
        assert client.get_route_npy(run, name).tobytes() == sent[name].tobytes()
    for name, route in zip(names, client.get_routes(run, names)):
        assert route.experts.tobytes() == sent[name].tobytes()
    batch = client.megatron_batch([(run, name) for name in names], packing="thd")
    valid = batch.valid.astype(bool)
    assert batch.experts[valid].tobytes() == np.concatenate([sent[n] for n in names]).tobytes()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`replay-service ARGS` in a subprocess, its output captured."""
    return subprocess.run([sys.executable, "-m", "replay_service.ops.cli", *args], capture_output=True, text=True,
                          timeout=120)


def reindex_from_segments(data: Path) -> None:
    """Delete the SQLite index and rebuild it from the segments (`replay-service reindex`), which must succeed."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{data / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    done = run_cli("reindex", "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_run_of_mixed_codecs_reads_back_equal_verifies_and_reindexes(tmp_path):
    data = tmp_path / "data"
    rng = np.random.default_rng(21)
    sent: dict[str, np.ndarray] = {}
    summaries = {}
    for codec in (SegmentCompression.ZSTD, SegmentCompression.LZ4, SegmentCompression.NONE):
        env = {"REPLAY_SEGMENT_COMPRESSION": codec.value, "REPLAY_FSYNC": "false"}
        with ServiceProcess(data, env=env) as service, ReplayClient(service.url) as client:
            mine = {f"{codec}-{i}": skewed_routes(rng, ROWS, SHAPE) for i in range(2)}
            store_sent(client, "mixed", f"writer-{codec}", mine)
            store_sent(client, f"only-{codec}", "w", mine)
            sent.update(mine)
            check_reads(client, "mixed", sent)  # this start's segments beside the earlier codecs'
            summaries[codec] = client.run(f"only-{codec}")
    for summary in summaries.values():
        ids = summary.rows * SHAPE.row_width
        assert summary.bytes_per_id == summary.bytes / ids
    assert summaries[SegmentCompression.ZSTD].bytes_per_id < 1 < summaries[SegmentCompression.NONE].bytes_per_id
    assert summaries[SegmentCompression.LZ4].bytes < summaries[SegmentCompression.NONE].bytes

    done = run_cli("verify", "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_cli("export", "mixed", "--to", str(tmp_path / "mixed.parquet"), "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    table = pq.read_table(tmp_path / "mixed.parquet")
    exported = {}
    for name, experts in zip(table.column("request").to_pylist(), table.column("experts").to_pylist()):
        exported.setdefault(name, []).append(experts)
    assert {k: np.asarray(v, SHAPE.dtype).tobytes() for k, v in exported.items()} == \
        {k: v.tobytes() for k, v in sent.items()}
    reindex_from_segments(data)
    with ServiceProcess(data) as service, ReplayClient(service.url) as client:
        check_reads(client, "mixed", sent)
        assert client.run("only-zstd").bytes_per_id == summaries[SegmentCompression.ZSTD].bytes_per_id


def test_the_run_summary_reports_bytes_per_id(shared_service):
    rng = np.random.default_rng(22)
    with ReplayClient(shared_service.url) as client:
        sent = {"a": skewed_routes(rng, 40, SHAPE), "b": skewed_routes(rng, 9, SHAPE)}
        store_sent(client, "bytes-per-id", "w", sent)
        summary = client.run("bytes-per-id")
    files = sorted((Path(shared_service.data_dir) / "runs" / "bytes-per-id").glob("*.arrow"))
    on_disk = sum(f.stat().st_size for f in files)
    assert summary.bytes == on_disk
    assert summary.bytes_per_id == on_disk / (49 * SHAPE.row_width)
    assert summary.bytes_per_id > 1  # uncompressed: one byte per id, the other columns and the framing on top
