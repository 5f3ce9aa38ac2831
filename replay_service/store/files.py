"""The store's files on disk: where segments live, the start-up sweep, and memory-mapped reads.

Segments are written by the ingest pipeline (`replay_service.ingest.segment`): to `<name>.tmp`,
fsynced, renamed into place and the directory fsynced, before the index row that names them
commits. So a crash leaves at worst a `.tmp` file or a renamed file no index row names;
start-up deletes both (neither was acknowledged, the writer retries).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa

TMP_SUFFIX = ".tmp"
SEGMENT_SUFFIX = ".arrow"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_segment_path(run_id: str) -> str:
    """A fresh segment's path relative to the segment root: `<run_id>/<uuid>.arrow`."""
    return f"{run_id}/{uuid.uuid4().hex}{SEGMENT_SUFFIX}"


def sweep_unindexed(root: Path, indexed: set[str]) -> list[Path]:
    """Delete `.tmp` files and segments no index row names (never acknowledged)."""
    removed: list[Path] = []
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
        """The segment at `rel_path` (its one record batch), mapped on first use."""
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
