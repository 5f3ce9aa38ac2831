"""Opened segments and the start-up sweep: checked reads of the segment store, and what a crash left behind.

Contract: `SegmentCache.get` serves a segment only once checked whole (integrity.py); a damaged one is refused,
unread, until its file changes, and a missing segment of a deleted run is RunDeleted, not damage. It keeps at most
`capacity` segments, those held in memory (decompressed or fetched) within `max_heap_bytes`. At start,
`require_index` refuses segments beside an index that names none, and `sweep_unindexed` deletes `.tmp` files and
moves unindexed local segments into `<data>/quarantine/` (never deleting them).
Design: docs/design/store.md ("Crash safety and the start-up sweep", "The segment cache").
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from replay_format.durable import fsync_dir
from replay_service.errors import DamagedSegment, IndexNeedsRebuild, RunDeleted
from replay_service.placement import on_loop
from replay_service.store.segments.durable import TMP_SUFFIX
from replay_service.store.segments.integrity import open_segment
from replay_service.store.segments.places import SEGMENT_SUFFIX, FileStamp, LocalSegments, SegmentStore

log = logging.getLogger("replay_service")

QUARANTINE_DIR = "quarantine"  # under the data directory, beside `runs/`


def segment_files(root: Path) -> list[str]:
    """Every complete segment under a local segment root, as paths relative to it, sorted."""
    return LocalSegments(root).paths()


def require_index(store: SegmentStore | Path, indexed: set[str], data_dir: Path, grace_s: float = 0.0,
                  shared_index: bool = False) -> None:
    """IndexNeedsRebuild when `store` holds segments but the index names none of them (missing or empty).

    Starting would make every segment look unacknowledged; the index is rebuilt from them instead.
    `grace_s` (a shared index): segments younger than it do not count, they may be another replica's first
    ingest, uploaded and not yet committed (a fresh database beside a fresh bucket must not refuse the second
    replica's start). The cost: a database lost within the grace of its first segments is not noticed at start;
    any older segment is. `shared_index`: the index is the PostgreSQL database REPLAY_INDEX_URL names.
    """
    store = LocalSegments(store) if isinstance(store, Path) else store
    if indexed:
        return
    now = time.time()
    if not any(now - o.mtime > grace_s for o in store.objects()):
        return
    index = "the PostgreSQL index REPLAY_INDEX_URL names" if shared_index else f"the index {data_dir / 'index.sqlite'}"
    into = " into it (REPLAY_INDEX_URL set, every replica stopped)" if shared_index else ""
    raise IndexNeedsRebuild(
        f"{index} is missing or empty, but {store.url} holds segments: the service does not start on it (every "
        f"stored row would look unacknowledged). Rebuild the index from the segments with `replay-service reindex "
        f"--data {data_dir}`{into}, then start again.")


@dataclass
class Sweep:
    """What the start-up sweep did: `.tmp` files deleted, unindexed segments moved to quarantine (old -> new)."""

    removed: list[Path] = field(default_factory=list)
    quarantined: list[tuple[Path, Path]] = field(default_factory=list)


def sweep_unindexed(root: Path, indexed: set[str], quarantine: Path, grace_s: float = 0.0) -> Sweep:
    """Delete `.tmp` files; move complete segments no index row names into `quarantine` (never delete them).

    `grace_s`: leave files younger than it. Several processes sharing the data directory (a PostgreSQL index)
    may be writing or committing them this moment; a crashed one's leftovers are swept by the next start past
    the grace (REPLAY_ORPHAN_GRACE_S, longer than any ingest). 0 (one process, SQLite): every file.
    """
    done = Sweep()
    if not root.exists():
        return done
    now = time.time()
    for path in sorted(root.rglob("*")):
        try:
            if not path.is_file() or grace_s and now - path.stat().st_mtime <= grace_s:
                continue
        except FileNotFoundError:
            continue  # renamed or deleted by another process meanwhile
        rel = path.relative_to(root).as_posix()
        if path.name.endswith(TMP_SUFFIX):
            path.unlink()
            done.removed.append(path)
        elif path.suffix == SEGMENT_SUFFIX and rel not in indexed:
            done.quarantined.append((path, quarantine_segment(path, quarantine / root.name / rel)))
    for path in done.removed:
        log.warning("start-up: deleted unfinished segment write %s", path)
    for path, target in done.quarantined:
        log.warning("start-up: segment %s is named by no index row (a batch a crash kept from being acknowledged, "
                    "or the index is older than the segments): moved to %s; `replay-service reindex "
                    "--restore-quarantine` takes it back", path, target)
    return done


def quarantine_segment(path: Path, target: Path) -> Path:
    """Move `path` to `target` (a free name beside it when taken), durably; returns where it went."""
    target.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    while target.exists():
        n += 1
        target = target.with_name(f"{target.stem}.{n}{target.suffix}")
    shutil.move(path, target)  # one filesystem (both under the data directory): a rename
    fsync_dir(target.parent)
    fsync_dir(path.parent)
    return target


@dataclass(frozen=True)
class _Damage:
    """A segment found damaged: the file as it was then (None: missing), and why."""

    stamp: FileStamp | None
    why: str


def _run_of(rel_path: str) -> str:
    """The run a segment path (relative to the segment root) belongs to."""
    return rel_path.split("/", 1)[0]


def heap_bytes(batch: pa.RecordBatch) -> int:
    """Bytes of `batch` held in process memory rather than in a memory-mapped file.

    0 for an uncompressed segment (every buffer a slice of the map: it has a parent); a compressed one's
    buffers are decompressed into memory Arrow allocated (no parent), which the page cache cannot reclaim.
    """
    held = 0
    for column in batch.columns:
        arrays = [column, column.dictionary] if pa.types.is_dictionary(column.type) else [column]
        held += sum(b.size for a in arrays for b in a.buffers() if b is not None and b.parent is None)
    return held


class SegmentCache:
    """LRU of opened, checked segments; local reads are zero-copy views into the page cache.

    A compressed segment (segment.md, "Compression") is held decompressed in memory, and a segment fetched from an
    object store is held whole: those count against `max_heap_bytes`, so the cache's memory stays bounded
    whatever the codec and the store.
    """

    def __init__(self, store: SegmentStore | Path, capacity: int, max_heap_bytes: int = 1 << 30,
                 indexed: Callable[[str, str], bool] | None = None, pool: str | None = None) -> None:
        self.store = LocalSegments(store) if isinstance(store, Path) else store
        self.pool = pool  # processes sharing one check of a file (integrity.open_segment); None: each open checks
        # (run, path) -> whether the index still names the segment: a missing file it no longer names was deleted
        # with its run (a run of the same id may have been created since), not damaged
        self.indexed = indexed
        self.capacity = max(1, capacity)
        self.max_heap_bytes = max_heap_bytes
        self._heap: dict[str, int] = {}  # path -> heap_bytes of the open segments that hold any
        self._open: OrderedDict[str, pa.RecordBatch] = OrderedDict()
        self._damaged: dict[str, _Damage] = {}  # path -> the file when found damaged, and why
        self._deleted: set[str] = set()  # runs deleted (retention.py): a missing segment of one is not damage
        self._opening: dict[str, threading.Event] = {}  # path -> set once the read opening it is done
        self._lock = threading.Lock()
        self._to_check: list[str] = []  # new local segments the background checker has not checked yet
        self._checking = threading.Condition(self._lock)
        self._checker: threading.Thread | None = None
        self._closed = False

    def check_later(self, rel_path: str) -> None:
        """Check a newly stored local segment whole in a background thread, and record the check on its file for
        this cache's pool (integrity.open_segment): its first read then maps it without checksumming it, from the
        page cache. Not kept opened (a file damaged after this check has another stamp and is checked whole on
        first open). Nothing for a bucket's segments (reads fetch their blocks) or without a pool."""
        if self.pool is None or not isinstance(self.store, LocalSegments):
            return
        with self._checking:
            if self._closed:
                return
            self._to_check.append(rel_path)
            if self._checker is None:
                self._checker = threading.Thread(target=self._check_queued, name="segment-checker", daemon=True)
                self._checker.start()
            self._checking.notify_all()

    def checked_all(self, timeout: float | None = None) -> bool:
        """Wait until every segment given to `check_later` so far is checked; False if `timeout` passed first."""
        with self._checking:
            return self._checking.wait_for(lambda: not self._to_check, timeout)

    def close(self) -> None:
        """Stop the background checker (what it has not checked yet is checked on first open instead)."""
        with self._checking:
            self._closed = True
            self._to_check.clear()
            self._checking.notify_all()
            checker = self._checker
        if checker is not None:
            checker.join(timeout=30)

    def _check_queued(self) -> None:
        while True:
            with self._checking:
                self._checking.wait_for(lambda: self._to_check or self._closed)
                if self._closed:
                    return
                rel_path = self._to_check[0]
            try:
                open_segment(self.store, rel_path, self.pool)
            except DamagedSegment:
                pass  # gone with its run, or damaged: its first read says which (and logs damage once), as before
            except Exception:  # never ends the checker: the segment is checked on first open instead
                log.exception("background check of segment %s failed", rel_path)
            with self._checking:
                if self._to_check and self._to_check[0] == rel_path:
                    self._to_check.pop(0)
                self._checking.notify_all()

    def forget_run(self, run_id: str) -> None:
        """A run is being deleted: unmap its segments and answer RunDeleted for those a read still names.

        A read already holding a segment keeps its mapping (an unlinked file stays readable on Linux).
        """
        prefix = run_id + "/"
        with self._lock:
            self._deleted.add(run_id)
            for path in [p for p in self._open if p.startswith(prefix)]:
                del self._open[path]
                self._heap.pop(path, None)
            for path in [p for p in self._damaged if p.startswith(prefix)]:
                del self._damaged[path]

    def revive_run(self, run_id: str) -> None:
        """A run of this id was created again: a missing segment of it is damage again."""
        with self._lock:
            self._deleted.discard(run_id)

    def _stat(self, rel_path: str) -> FileStamp | None:
        return self.store.stat(rel_path)

    def _unnamed(self, rel_path: str) -> bool:
        """The index no longer names this segment: its run was deleted, then perhaps created again (`revive_run`)."""
        return self.indexed is not None and not self.indexed(_run_of(rel_path), rel_path)

    def get(self, rel_path: str) -> pa.RecordBatch:
        """The segment at `rel_path` (its one record batch), mapped and checked on first use.

        DamagedSegment when it fails its checksum: refused again, unread, until its file changes. On the event
        loop (placement/on_loop.py) a segment not opened yet is WouldWait: opening it reads and checks the whole file.
        """
        while True:
            with self._lock:
                batch = self._open.get(rel_path)
                if batch is not None:
                    self._open.move_to_end(rel_path)
                    return batch
                opening = self._opening.get(rel_path)
            on_loop.refuse(f"segment {rel_path} is not opened yet")
            if opening is not None:
                opening.wait()  # another read opens it: one open and one checksum pass per segment, not one each
                continue
            with self._lock:
                if rel_path not in self._opening and rel_path not in self._open:
                    self._opening[rel_path] = threading.Event()
                    break
        try:
            return self._open_and_keep(rel_path)
        finally:
            with self._lock:
                self._opening.pop(rel_path).set()

    def _open_and_keep(self, rel_path: str) -> pa.RecordBatch:
        """Open and check a segment no read holds opened, and keep it opened (unless its run was deleted)."""
        with self._lock:
            known = self._damaged.get(rel_path)
            deleted = _run_of(rel_path) in self._deleted
        if deleted and self._stat(rel_path) is None:
            raise RunDeleted.during_read(_run_of(rel_path))
        if known is not None and known.stamp == self._stat(rel_path):
            raise DamagedSegment(known.why, rel_path)
        stat = self._stat(rel_path)
        try:
            batch = open_segment(self.store, rel_path, self.pool)
        except DamagedSegment as exc:
            if self._stat(rel_path) is None:
                with self._lock:
                    deleted = _run_of(rel_path) in self._deleted
                # unlinked between the check above and the open, or its run deleted and created again since the
                # read took the path (`revive_run`): not damage. The index is asked outside the lock, on this rare path.
                if deleted or self._unnamed(rel_path):
                    raise RunDeleted.during_read(_run_of(rel_path)) from None
            with self._lock:
                exc.newly_found = rel_path not in self._damaged
                self._damaged[rel_path] = _Damage(stat, exc.message)
            if exc.newly_found:
                log.error("%s", exc.message)
            raise
        with self._lock:
            self._damaged.pop(rel_path, None)
            if _run_of(rel_path) in self._deleted:
                return batch  # served to this read only: kept mapped, a deleted file's space would not be freed
            self._open[rel_path] = batch
            held = batch.get_total_buffer_size() if self.store.in_memory else heap_bytes(batch)
            if held:
                self._heap[rel_path] = held
            while len(self._open) > self.capacity:
                self._heap.pop(self._open.popitem(last=False)[0], None)
            # then the least recently used decompressed ones (never the newest: the read that opened it uses it)
            while len(self._heap) > 1 and sum(self._heap.values()) > self.max_heap_bytes:
                victim = next(p for p in self._open if p in self._heap)
                del self._open[victim], self._heap[victim]
        return batch
