"""Deleting runs: one run on request (`DELETE /v1/runs/{run}`, `replay-service delete`), and retention's passes.

A delete is safe while the run is read or written:

1. the segment cache forgets the run (its mappings are dropped; a read that still names one of its
   segments after the files are gone answers RunDeleted, a 404, never "damaged");
2. under the run's commit lock, one index transaction deletes every row of it (runs, requests, spans,
   segments, row_flags, prefix_refs, compares): a read starting after it sees no run (404);
3. its folders (`runs/<run>/`, journal included, and `compares/<run>/`) are renamed into `<data>/trash/`
   and removed there, so a new run of the same id starts in an empty folder; a read already holding a
   segment keeps reading it (an unlinked file stays mapped on Linux) and its space is freed when it ends;
4. the run registry forgets it: the next batch of that id creates a fresh run.

With segments in an object store (segment_store.py) step 3 deletes the run's objects (listed under its prefix:
segments, and the journal's objects, journal.py); a read already holding a segment keeps its fetched copy. An
object uploaded by a batch racing the delete is refused at commit and deleted by its writer, or else left as an
orphan.

Orphans (`collect_orphans`): objects of an object store that no index row names, older than
`REPLAY_ORPHAN_GRACE_S`, are deleted by every retention pass and by `replay-service gc --orphans`. The listing
is taken before the index is read, so an object committed in between is seen as named; an object is
deleted only when older than the grace period, longer than any ingest, so never while one may still commit it
(its age is the store's LastModified). Local segments keep today's start-up quarantine instead (files.py).

A batch being written when its run is deleted is refused at commit (the index's `segments_of_a_run`
trigger: RunDeleted, nothing left behind). A crash between 2 and 3 leaves the segments unindexed: the next
start quarantines them (files.py), nothing is served.

Retention (settings `retention_max_bytes`, `retention_max_age_s`; 0 is off) deletes unpinned runs, the
least recently written first: those not written for longer than the age limit, then more until the
stored bytes are under the cap. A run's age is the time since its last stored batch (its creation when
none), so a run being written is the youngest and goes last.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from replay_service.errors import NotFound
from replay_service.store.segment_store import Freed, LocalSegments, SegmentStore

if TYPE_CHECKING:
    from replay_service.store import RouteStore
    from replay_service.store.index import Index, Row

log = logging.getLogger("replay_service")

TRASH_DIR = "trash"  # under the data directory: folders of deleted runs, removed at once (or at the next start)


@dataclass
class Removed:
    """What deleting one run freed."""

    run_id: str
    rows: int  # index rows deleted (every table)
    bytes: int  # bytes of files removed (segments, journal, comparison files)
    files: int
    reason: str = "requested"


def last_write(run: Row) -> float:
    """When a run was last written (Unix time): its last stored batch, or its creation."""
    return run["last_write"] if run["last_write"] is not None else run["created_at"]


def delete_run(store: RouteStore, run_id: str, reason: str = "requested") -> Removed:
    """Delete a run's index rows and files, safely beside reads and writes (module docstring); NotFound if none."""
    state = store.registry.require(run_id)
    store.cache.forget_run(run_id)
    with state.lock:
        # Marked before its index rows go: a read that saw them gone sees the mark after (RouteStore.read_route).
        state.deleted = True
        try:
            with store.index.transaction() as tx:
                tx.lock_runs([run_id])  # after any other replica's commit of this run (PostgreSQL)
                rows = tx.delete_run(run_id) + store.compares.delete_rows(tx, run_id)
                store.health.delete_rows(tx, run_id)  # not counted: a run of no rows has none either
                if rows == 0:
                    raise NotFound(f"run {run_id!r} not found")
        except BaseException:
            state.deleted = False
            raise
        objects = (store.segments.delete_run(run_id)  # an object store's; local ones go to the trash
                   + store.journal.delete_run(run_id)  # likewise (journal.py)
                   + store.compares.delete_objects(run_id))  # likewise (compares.py)
        trash = store.root / TRASH_DIR / uuid.uuid4().hex
        moved = [_to_trash(folder, trash) for folder in (store.segments_root / run_id, store.compares.root / run_id)]
    store.registry.forget(run_id)
    freed = _remove(trash) + objects
    removed = Removed(run_id, rows, freed.bytes, freed.files, reason)
    log.warning("deleted run %r (%s): %d index rows, %d files, %d bytes%s", run_id, reason, rows, freed.files,
                freed.bytes, "" if any(moved) or objects.files else " (it had no files)")
    return removed


def _to_trash(folder: Path, trash: Path) -> bool:
    """Rename `folder` into `trash` (one filesystem: atomic); False when it does not exist."""
    if not folder.exists():
        return False
    trash.mkdir(parents=True, exist_ok=True)
    folder.rename(trash / f"{folder.parent.name}-{folder.name}")
    return True


def _remove(folder: Path) -> Freed:
    """Remove a folder; what it held."""
    size = files = 0
    for path in folder.rglob("*"):
        if path.is_file():
            size += path.stat().st_size
            files += 1
    shutil.rmtree(folder, ignore_errors=True)
    return Freed(size, files)


def empty_trash(data_dir: Path) -> None:
    """Remove what a delete interrupted by a crash left in the trash (start-up)."""
    trash = Path(data_dir) / TRASH_DIR
    if trash.exists():
        for entry in trash.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.unlink(entry)


def due(runs: list[Row], max_bytes: int, max_age_s: float, now: float) -> list[tuple[str, str]]:
    """The runs retention deletes, in order, each with why: unpinned, least recently written first."""
    candidates = sorted((r for r in runs if not r["pinned"]), key=last_write)
    total = sum(r["bytes"] for r in runs)
    chosen = []
    for run in candidates:
        age = now - last_write(run)
        if max_age_s and age > max_age_s:
            reason = f"not written for {age:.0f} s (REPLAY_RETENTION_MAX_AGE_S={max_age_s:g})"
        elif max_bytes and total > max_bytes:
            reason = f"store holds {total} bytes (REPLAY_RETENTION_MAX_BYTES={max_bytes})"
        else:
            continue
        chosen.append((run["run_id"], reason))
        total -= run["bytes"]
    return chosen


def collect(store: RouteStore, max_bytes: int, max_age_s: float, now: float | None = None) -> list[Removed]:
    """One retention pass: delete the runs `due` names (a run deleted meanwhile is skipped), then old orphans."""
    removed = []
    for run_id, reason in due(store.index.runs(), max_bytes, max_age_s, time.time() if now is None else now):
        try:
            removed.append(delete_run(store, run_id, reason))
        except NotFound:
            continue
    collect_orphans(store.segments, store.index, store.settings.orphan_grace_s)  # logs each one it deletes
    return removed


@dataclass
class Orphans:
    """What one orphan pass found: objects deleted, and unnamed ones kept because they are younger than the grace."""

    deleted: list[str]
    young: list[str]
    bytes: int


def collect_orphans(segments: SegmentStore, index: Index, grace_s: float, now: float | None = None) -> Orphans:
    """Delete objects of an object store no index row names, older than `grace_s` (module docstring).

    Local segments: nothing (their start-up quarantine keeps them, files.py).
    """
    done = Orphans([], [], 0)
    if isinstance(segments, LocalSegments):
        return done
    listed = segments.objects()  # before the index is read: an object committed meanwhile is named in it
    named = index.indexed_paths()
    now = time.time() if now is None else now
    for obj in listed:
        if obj.path in named:
            continue
        if now - obj.mtime <= grace_s:
            done.young.append(obj.path)  # an ingest may still commit it
            continue
        segments.delete(obj.path)
        done.deleted.append(obj.path)
        done.bytes += obj.size
        log.warning("deleted orphan segment %s/%s: named by no index row, %.0f s old (REPLAY_ORPHAN_GRACE_S=%g)",
                    segments.url.rstrip("/"), obj.path, now - obj.mtime, grace_s)
    return done
