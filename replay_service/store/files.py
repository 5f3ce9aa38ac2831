"""Durable segment files: one Arrow IPC file per acknowledged ingest batch.

A segment is written to `<name>.tmp` (O_DIRECT where the filesystem allows),
fsynced, renamed into place and the directory fsynced, in that order, before the index row that names it commits.
So a crash leaves at worst a `.tmp` file or a renamed file no index row names;
start-up deletes both (neither was acknowledged, the writer retries).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa

from replay_service.buffers import PAGE, BufferPool

TMP_SUFFIX = ".tmp"
SEGMENT_SUFFIX = ".arrow"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_segment(path: Path, batch: pa.RecordBatch, staging: BufferPool, fsync: bool = True,
                  direct: bool = True) -> int:
    """Write `batch` as an Arrow IPC file at `path` atomically; returns its size in bytes.

    The file image is built in a reused staging buffer and, with `direct`, written
    with O_DIRECT: the bytes go to disk without first being copied into freshly
    allocated page cache (measured: most of the write's CPU on the bench VM, see
    buffers.py). Reads later fault the pages in from disk. A filesystem without
    O_DIRECT (tmpfs) gets an ordinary buffered write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    counter = pa.MockOutputStream()
    _write_ipc_file(counter, batch)
    size = counter.size()
    padded = -(-size // PAGE) * PAGE  # O_DIRECT writes whole aligned blocks; truncated back below
    with staging.borrowed(padded) as image:
        _write_ipc_file(pa.FixedSizeBufferWriter(pa.py_buffer(image)), batch)
        fd, direct = _open_new(tmp, direct)
        try:
            try:
                _write_all(fd, image if direct else image[:size])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                os.close(fd)  # the filesystem took O_DIRECT at open but not on write
                fd, direct = _open_new(tmp, direct=False)
                _write_all(fd, image[:size])
            if direct:
                os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
    return size


def _open_new(path: Path, direct: bool) -> tuple[int, bool]:
    """A new file for writing, and whether it is open with O_DIRECT."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, data: memoryview) -> None:
    while data:  # a regular file takes it in one call; a short write is still no reason to lose bytes
        data = data[os.write(fd, data):]


def _write_ipc_file(sink, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


def sweep_unindexed(root: Path, indexed: set[str]) -> list[Path]:
    """Delete `.tmp` files and segments no index row names (never acknowledged)."""
    removed = []
    if not root.exists():
        return removed
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if path.name.endswith(TMP_SUFFIX) or (path.suffix == SEGMENT_SUFFIX and rel not in indexed):
            path.unlink()
            removed.append(path)
    return removed


class SegmentCache:
    """LRU of memory-mapped segments; reads are zero-copy views into the page cache."""

    def __init__(self, root: Path, capacity: int) -> None:
        self.root = root
        self.capacity = max(1, capacity)
        self._open: OrderedDict[str, pa.RecordBatch] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rel_path: str) -> pa.RecordBatch:
        with self._lock:
            batch = self._open.get(rel_path)
            if batch is not None:
                self._open.move_to_end(rel_path)
                return batch
        source = pa.memory_map(str(self.root / rel_path), "r")
        batch = pa.ipc.open_file(source).get_batch(0)
        with self._lock:
            self._open[rel_path] = batch
            while len(self._open) > self.capacity:
                self._open.popitem(last=False)
        return batch
