"""The run journal: what the index knows that no segment says, appended per run so `reindex` can replay it.

Segments carry every row and its batch's identity (rows.md, "Segment files"). Three things reach only the
index: a run's creation time, request ends (`finish`, and route uploads that finish or extend a request)
and prefix-cache references. Each is appended, after its index transaction committed, as one JSON line to
`<data>/runs/<run_id>/journal.jsonl`:

    {"t": NS, "event": "run", "created_at": SECONDS}
    {"t": NS, "event": "end", "request_id": R, "num_tokens": T, "status": "finished"|"aborted"}
    {"t": NS, "event": "references", "references": [[R, START, END, SOURCE], ...]}

`t` is when it was appended (ns since the epoch): reindex merges a run's journal with its segments by time.
Every acknowledged call appends, a repeat too (replaying one is a no-op), so a crash between the index
commit and the append loses nothing a writer's retry does not append again. Lines are fsynced with the
service's `fsync` setting; a torn last line (a crash mid-append) is skipped on reading.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from replay_service.store.files import fsync_dir

if TYPE_CHECKING:
    from replay_service.store.references import Reference

JOURNAL_NAME = "journal.jsonl"


class RunJournal:
    """Appends index-only events to each run's journal file under the segment root."""

    def __init__(self, segments_root: Path, fsync: bool = True) -> None:
        self.root = segments_root
        self.fsync = fsync
        self._lock = threading.Lock()  # one append at a time: lines never interleave

    def run_created(self, run_id: str, created_at: float) -> None:
        """A run's creation time (its summary's `created_at`)."""
        self._append(run_id, {"event": "run", "created_at": created_at})

    def request_end(self, run_id: str, request_id: str, num_tokens: int, status: str) -> None:
        """A request's end as the index now records it (a later end of the same request replaces it)."""
        self._append(run_id, {"event": "end", "request_id": request_id, "num_tokens": num_tokens,
                              "status": str(status)})

    def references(self, run_id: str, references: list[Reference]) -> None:
        """Prefix-cache references received (known ones too: replaying them is a no-op)."""
        self._append(run_id, {"event": "references",
                              "references": [[r.request_id, r.start, r.end, r.source_request_id] for r in references]})

    def _append(self, run_id: str, event: dict) -> None:
        line = (json.dumps({"t": time.time_ns(), **event}, separators=(",", ":")) + "\n").encode()
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


def read_journal(path: Path) -> list[dict]:
    """A journal's events in the order appended; a line that does not parse (a torn last append) is skipped."""
    events: list[dict] = []
    if not path.exists():
        return events
    for line in path.read_bytes().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("t"), int):
            events.append(event)
    return events
