"""Segment files: written whole with O_DIRECT, with buffered writes where it is refused."""

from __future__ import annotations

import errno
import os

import numpy as np
import pyarrow as pa
import pytest

from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows
from replay_service.buffers import BufferPool
from replay_service.store.segments import write as files

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)


def _batch(rows: int, seed: int) -> pa.RecordBatch:
    experts = np.random.default_rng(seed).integers(0, 128, (rows, 48, 8), dtype=np.uint8)
    return build_rows(RowsMeta("seg", "w", seed, SHAPE), [f"r{i % 3}" for i in range(rows)], np.arange(rows), experts)


def _read(path) -> pa.RecordBatch:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).get_batch(0)


@pytest.mark.parametrize("direct", [True, False])
def test_segments_read_back_equal_and_exact_size(tmp_path, direct):
    staging = BufferPool(keep=1)
    # Sizes around page boundaries, and a smaller batch after a larger one (the
    # reused staging buffer then holds stale bytes past the new image's end).
    for seed, rows in enumerate([1, 10, 4000, 3, 1000]):
        path = tmp_path / f"{seed}.arrow"
        batch = _batch(rows, seed)
        size = files.write_segment(path, batch, staging, direct=direct)
        assert path.stat().st_size == size
        assert _read(path).equals(batch)
    assert not list(tmp_path.glob("*.tmp"))


def test_filesystem_refusing_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    real_open, real_write = os.open, os.write
    refused = {"open": 0, "write": 0}

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT and refused["open"] == 0:
            refused["open"] += 1
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    batch = _batch(100, 1)
    files.write_segment(tmp_path / "a.arrow", batch, BufferPool(keep=1))
    assert refused["open"] == 1 and _read(tmp_path / "a.arrow").equals(batch)

    # Some filesystems take the flag at open and refuse the write instead.
    direct_fds = set()

    def open_tracking(path, flags, *args):
        fd = real_open(path, flags, *args)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)  # fd numbers are reused
        return fd

    def write_refusing_direct(fd, data):
        if fd in direct_fds:
            refused["write"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_tracking)
    monkeypatch.setattr(os, "write", write_refusing_direct)
    files.write_segment(tmp_path / "b.arrow", batch, BufferPool(keep=1))
    assert refused["write"] == 1 and _read(tmp_path / "b.arrow").equals(batch)
    assert (tmp_path / "b.arrow").stat().st_size == (tmp_path / "a.arrow").stat().st_size


def test_buffer_pool_reuses_and_stays_bounded():
    pool = BufferPool(keep=2)
    taken = [pool.take(3 << 20) for _ in range(3)]
    for buffer in taken:
        pool.give(buffer)
    assert len(pool._free) == 2
    again = pool.take(1 << 20)
    assert any(again is b for b in taken)  # reused, not fresh memory
    with pool.borrowed(5000) as view:
        assert len(view) == 5000 and not view.readonly
