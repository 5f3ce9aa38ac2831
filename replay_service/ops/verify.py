"""`replay-service verify`: check every segment of a data directory against its checksum, and every line of its run
journals, beside a running service.

Each segment is opened and checked whole as a read would (`store/segments/integrity.py`, `open_segment`): those the
store holds and those the index names, so a named segment that is not stored counts as damaged. Each run's journal
is read as `reindex` reads it (replay_format/journal.md): a line it could not replay (a newer major, a damaged
line) is named, found before the index is lost. Read-only: nothing is changed, the index is opened without fsync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from replay_format.journal import BadLine, JournalLines
from replay_service.errors import DamagedSegment
from replay_service.store.index import Index
from replay_service.store.lifecycle.journal import open_journal, run_lines
from replay_service.store.segments.integrity import open_segment
from replay_service.store.segments.places import LocalSegments, SegmentStore


@dataclass
class Verification:
    """What `verify` found."""

    segments: int = 0  # checked
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (relative path, why)
    journal_lines: int = 0  # read and understood
    unreadable: list[BadLine] = field(default_factory=list)  # journal lines reindex could not replay

    @property
    def clean(self) -> bool:
        """Nothing damaged, nothing unreadable."""
        return not self.damaged and not self.unreadable


def segment_problem(store: SegmentStore | Path, rel_path: str) -> str | None:
    """Why the segment at `rel_path` is damaged, or None when it passes (`verify`)."""
    try:
        open_segment(store, rel_path)
    except DamagedSegment as exc:
        return exc.message
    return None


def verify_store(data_dir: Path, run_id: str | None = None, progress: Callable[[str], None] | None = None,
                 store: SegmentStore | None = None,
                 index_url: str | None = None) -> Verification:
    """Check every segment of `store` (`<data_dir>/runs` when not given; of one run when given) and those its index
    names, and the journals of their runs.

    A segment the index names that is not stored counts as damaged. Read-only: safe beside a running service. The
    index is `index_url` (PostgreSQL, REPLAY_INDEX_URL) when given, else `<data_dir>/index.sqlite` if there is one.
    """
    root = Path(data_dir) / "runs"
    store = store or LocalSegments(root)
    paths = set(store.paths(run_id))
    index_path = data_dir / "index.sqlite"
    if index_url is not None or index_path.exists():
        index = Index(index_url or index_path, fsync=False)
        try:
            paths |= index.indexed_paths()
        finally:
            index.close()
    if run_id is not None:
        paths = {p for p in paths if p.split("/", 1)[0] == run_id}
    found = Verification(segments=len(paths))
    for rel in sorted(paths):
        if progress is not None:
            progress(rel)
        problem = segment_problem(store, rel)
        if problem is not None:
            found.damaged.append((rel, problem))
    journal = open_journal(store, root, fsync=False)
    lines = JournalLines()
    for run in sorted({p.split("/", 1)[0] for p in paths} if run_id is None else {run_id}):
        lines += run_lines(journal, root, run)
    found.journal_lines, found.unreadable = len(lines.entries), lines.bad
    return found
