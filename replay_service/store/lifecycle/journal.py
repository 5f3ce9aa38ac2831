"""The run journal: what only the index knows (run creation, request ends, references), appended per run for reindex.

Contract: each event is appended after its index transaction committed, on every acknowledged call (a repeat too:
replaying one is a no-op), as one versioned JSON line (`replay_format/journal.md`) whose `t` orders it against the
run's segments. `RunJournal` appends to `<data>/runs/<run_id>/journal.jsonl` (one O_APPEND write a line, fsynced with
the `fsync` setting); `BucketJournal` puts one object per event under `<run_id>/journal/` in the segments' bucket;
`open_journal` picks the one beside the segments. `events` reads a run's lines back; `delete_run` removes a bucket's
objects (a local journal leaves with its run folder).
Design: docs/design/store.md ("The run journal").
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from replay_format.durable import fsync_dir
from replay_format.journal import (
    JournalEntry,
    JournalEvent,
    JournalLines,
    ReferencesAdded,
    RequestEnded,
    RunCreated,
    encode_entry,
    parse_journal,
)
from replay_format.request_notes import FinishStatus, Reference
from replay_service.store.segments.places import Freed, S3Segments, SegmentStore, StoredObject

JOURNAL_NAME = "journal.jsonl"
JOURNAL_DIR = "journal"  # under a run's prefix in an object store: one object per event
JOURNAL_SUFFIX = ".jsonl"


class RunJournal:
    """Appends index-only events to each run's journal file under the segment root."""

    def __init__(self, segments_root: Path, fsync: bool = True) -> None:
        self.root = segments_root
        self.fsync = fsync
        self._lock = threading.Lock()  # one append at a time: lines never interleave

    def run_created(self, run_id: str, created_at: float) -> None:
        """A run's creation time (its summary's `created_at`)."""
        self._append(run_id, RunCreated(created_at))

    def request_end(self, run_id: str, request_id: str, num_tokens: int, status: str) -> None:
        """A request's end as the index now records it (a later end of the same request replaces it)."""
        self._append(run_id, RequestEnded(request_id, num_tokens, FinishStatus(str(status))))

    def references(self, run_id: str, references: list[Reference]) -> None:
        """Prefix-cache references received (known ones too: replaying them is a no-op)."""
        self._append(run_id, ReferencesAdded(tuple(references)))

    def _append(self, run_id: str, event: JournalEvent) -> None:
        t = time.time_ns()
        self._write(run_id, t, encode_entry(JournalEntry(t, event)))

    def events(self, run_id: str) -> JournalLines:
        """A run's events in the order appended, and the lines refused (reindex)."""
        return read_journal(self.root, run_id)

    def delete_run(self, run_id: str) -> Freed:
        """Delete a run's journal where it is not in its local run folder; what that freed.

        The file goes with the run's folder, which retention.py moves to the trash whole.
        """
        return Freed()

    def _write(self, run_id: str, t: int, line: bytes) -> None:
        path = self.root / run_id / JOURNAL_NAME
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if new and self.fsync:
                fsync_dir(path.parent)


class BucketJournal(RunJournal):
    """A run's journal as one object per event in the segments' bucket (module docstring): every replica's events
    in one place, durable when the PUT returned."""

    def __init__(self, segments: S3Segments) -> None:
        super().__init__(Path(), fsync=False)
        self.segments = segments

    def _write(self, run_id: str, t: int, line: bytes) -> None:
        # SegmentStoreUnreachable (503) when the store fails: the writer's retry appends it again
        self.segments.put(f"{run_id}/{JOURNAL_DIR}/{t:020d}-{uuid.uuid4().hex[:16]}{JOURNAL_SUFFIX}", line)

    def _objects(self, run_id: str) -> list[StoredObject]:
        return self.segments.other_objects(f"{run_id}/{JOURNAL_DIR}", JOURNAL_SUFFIX)

    def events(self, run_id: str) -> JournalLines:
        lines = JournalLines()
        for obj in self._objects(run_id):  # sorted by name: by time appended
            try:
                lines += parse_journal(self.segments.read_bytes(obj.path), obj.path)
            except FileNotFoundError:
                continue  # deleted since listed (its run is being deleted)
        return lines

    def delete_run(self, run_id: str) -> Freed:
        objects = self._objects(run_id)
        for obj in objects:
            self.segments.delete(obj.path)
        return Freed.of(objects)


def open_journal(segments: SegmentStore, segments_root: Path, fsync: bool = True) -> RunJournal:
    """The journal beside the segments: in their bucket, or files under the local segment root."""
    if isinstance(segments, S3Segments):
        return BucketJournal(segments)
    return RunJournal(segments_root, fsync=fsync)


def read_journal(root: Path, run_id: str) -> JournalLines:
    """A run's journal file under a local segment root (journal.md); nothing when it has none."""
    path = root / run_id / JOURNAL_NAME
    return parse_journal(path.read_bytes(), f"{run_id}/{JOURNAL_NAME}") if path.exists() else JournalLines()


def run_lines(journal: RunJournal, root: Path, run_id: str) -> JournalLines:
    """Every line of a run's journal (reindex, verify): where `journal` keeps it and, beside a bucket's, what was
    appended to the local file under `root` before journals moved to buckets."""
    lines = journal.events(run_id)
    if isinstance(journal, BucketJournal):
        lines += read_journal(root, run_id)
    return lines
