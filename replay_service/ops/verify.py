"""`replay-service verify`: check every segment of a data directory against its checksum, beside a running service.

Each segment is opened and checked whole as a read would (`store/integrity.py`, `open_segment`); the segments the
store holds and those the index names are both checked, so a segment the index names that is not stored counts as
damaged. Read-only: nothing is changed, the index is opened without fsync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from replay_service.errors import DamagedSegment
from replay_service.store.index import Index
from replay_service.store.integrity import open_segment
from replay_service.store.segment_store import LocalSegments, SegmentStore


def segment_problem(store: SegmentStore | Path, rel_path: str) -> str | None:
    """Why the segment at `rel_path` is damaged, or None when it passes (`verify`)."""
    try:
        open_segment(store, rel_path)
    except DamagedSegment as exc:
        return exc.message
    return None


def verify_store(data_dir: Path, run_id: str | None = None, progress: Callable[[str], None] | None = None,
                 store: SegmentStore | None = None,
                 index_url: str | None = None) -> tuple[int, list[tuple[str, str]]]:
    """Check every segment of `store` (`<data_dir>/runs` when not given; of one run when given) and those its index
    names.

    Returns how many were checked and the damaged ones as `(relative path, why)`; a segment the index
    names that is not stored counts as damaged. Read-only: safe beside a running service. The index is
    `index_url` (PostgreSQL, REPLAY_INDEX_URL) when given, else `<data_dir>/index.sqlite` if there is one.
    """
    store = store or LocalSegments(Path(data_dir) / "runs")
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
    damaged = []
    for rel in sorted(paths):
        if progress is not None:
            progress(rel)
        problem = segment_problem(store, rel)
        if problem is not None:
            damaged.append((rel, problem))
    return len(paths), damaged
