"""Deleting runs and retention's choices: the trash folder, which runs are due, and a bucket's orphans.

Contract: a run's folders go to `<data>/trash/` by one rename and are removed there, so a new run of the same id
starts empty (`to_trash`, `empty_trash` at start-up); `due` picks unpinned runs, least recently written first, past
the age limit and then until the bytes are under the cap; `collect_orphans` deletes bucket objects no index row
names once older than the grace. `RouteStore.delete_run` does a delete's steps in order. Design:
docs/design/store.md ("Deleting a run").
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from replay_service.store.index import Index, Row
from replay_service.store.segments.places import Freed, LocalSegments, SegmentStore

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


def to_trash(data_dir: Path, folders: list[Path]) -> Path:
    """Rename each of `folders` that exists into one new folder of the trash (atomic on one filesystem); that
    folder (`removed` empties it)."""
    trash = data_dir / TRASH_DIR / uuid.uuid4().hex
    for folder in folders:
        _to_trash(folder, trash)
    return trash


def removed(run_id: str, rows: int, trash: Path, objects: Freed, reason: str) -> Removed:
    """Empty a deleted run's trash folder; what deleting it freed (with `objects`, removed from a bucket), logged."""
    freed = _remove(trash) + objects
    log.warning("deleted run %r (%s): %d index rows, %d files, %d bytes%s", run_id, reason, rows, freed.files,
                freed.bytes, "" if freed.files else " (it had no files)")
    return Removed(run_id, rows, freed.bytes, freed.files, reason)


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


@dataclass
class Orphans:
    """What one orphan pass found: objects deleted, and unnamed ones kept because they are younger than the grace."""

    deleted: list[str]
    young: list[str]
    bytes: int


def collect_orphans(segments: SegmentStore, index: Index, grace_s: float, now: float | None = None) -> Orphans:
    """Delete objects of an object store no index row names, older than `grace_s` (module docstring).

    Local segments: nothing (their start-up quarantine keeps them, segments/cache.py).
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
