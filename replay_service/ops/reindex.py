"""`replay-service reindex`: rebuild the index from the segments (and the run journals), with the service stopped.

`reindex(data_dir, settings, restore=...)` commits every segment again through the ingest pipeline's own commit
stage, a run's segments in write order merged by time with the run's journal (`restore`: quarantined segments moved
back first): runs, requests, spans, segments, flags, references and counters come back; stored comparisons' index
rows do not, and damaged or pre-2.2 segments are listed and left in place (`ReindexReport`). SQLite: the new index is
written beside the old one and renamed into place, the old kept as `index.sqlite.before-reindex-<time>`. PostgreSQL
(`REPLAY_INDEX_URL`): the database must hold no run (else Conflict); stop every replica first.

Design: docs/design/operations.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from replay_format import FormatError
from replay_format.core import decode_metadata
from replay_format.durable import fsync_dir
from replay_format.journal import JournalEvent, ReferencesAdded, RequestEnded, RunCreated
from replay_format.rows import read_rows
from replay_format.segment import SegmentMeta
from replay_service.buffers import BufferPool
from replay_service.checks.check import check
from replay_service.errors import Conflict, DamagedSegment
from replay_service.ingest.commit import Committer
from replay_service.ingest.segment import Segment, SegmentWriter
from replay_service.settings import ServiceSettings
from replay_service.store.index import Index, RequestStatus
from replay_service.store.lifecycle.journal import open_journal, run_lines
from replay_service.store.requests.references import Resolver
from replay_service.store.requests.rows import RowReader
from replay_service.store.runs import RunRegistry
from replay_service.store.segments.cache import QUARANTINE_DIR, SegmentCache, quarantine_segment, segment_files
from replay_service.store.segments.integrity import open_segment
from replay_service.store.segments.places import LocalSegments, SegmentStore, open_segment_store
from replay_service.store.tables.health import HealthTables

INDEX_NAME = "index.sqlite"
SIDE_FILES = ("", "-wal", "-shm")  # SQLite's files of one database


@dataclass
class ReindexReport:
    """What a rebuild did."""

    runs: int = 0
    segments: int = 0  # committed
    rows: int = 0
    duplicates: list[str] = field(default_factory=list)  # segments repeating a stored (run, writer, seq): not indexed
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (segment, why): not indexed
    # (segment or journal line, why): a segment written before 2.2 or refused; a journal line not understood
    unusable: list[tuple[str, str]] = field(default_factory=list)
    events: int = 0  # journal events replayed
    restored: list[str] = field(default_factory=list)  # quarantined segments taken back
    old_index: Path | None = None  # where the replaced index was kept


class _KeepFiles(SegmentWriter):
    """The commit stage's segment writer for a rebuild: a segment the index does not take is left on disk."""

    def discard(self, segment: Segment) -> None:
        """Keep the file (in a rebuild it is the only copy of its rows)."""


@dataclass
class _Item:
    t: int
    order: tuple
    segment: tuple[str, SegmentMeta, int] | None = None  # (path, meta, size)
    event: JournalEvent | None = None


def restore_quarantine(data_dir: Path) -> list[str]:
    """Move quarantined segments back under `runs/` (their own names where free); returns their new paths."""
    quarantine = data_dir / QUARANTINE_DIR / "runs"
    root = data_dir / "runs"
    back = []
    for rel in segment_files(quarantine):
        back.append(quarantine_segment(quarantine / rel, root / rel).relative_to(root).as_posix())
    return back


def scan(store: SegmentStore | Path, report: ReindexReport,
         progress: Callable[[str], None]) -> dict[str, list[_Item]]:
    """Every usable segment of `store`, checked, grouped by run (damaged and pre-2.2 ones go to the report)."""
    store = LocalSegments(store) if isinstance(store, Path) else store
    runs: dict[str, list[_Item]] = {}
    for obj in store.objects():
        rel = obj.path
        progress(rel)
        try:
            batch = open_segment(store, rel)
            meta = SegmentMeta.from_metadata(decode_metadata(batch.schema.metadata, "segment"))
        except DamagedSegment as exc:
            report.damaged.append((rel, exc.message))
            continue
        except FormatError as exc:
            report.unusable.append((rel, str(exc)))
            continue
        size = obj.size
        runs.setdefault(meta.rows.run_id, []).append(
            _Item(meta.written_ns, (0, meta.rows.writer_id, meta.rows.seq, rel), segment=(rel, meta, size)))
    return runs


def reindex(data_dir: Path, settings: ServiceSettings | None = None, restore: bool = False,
            progress: Callable[[str], None] | None = None) -> ReindexReport:
    """Rebuild `data_dir`'s index from its segments and journals; the old index is kept aside.

    `restore`: first take quarantined segments back. `progress` is called once per segment scanned and once per
    segment committed.
    """
    settings = settings or ServiceSettings(data_dir=data_dir)
    progress = progress or (lambda _: None)
    report = ReindexReport()
    target = _empty_database(settings.index_url) if settings.index_url is not None else None
    try:
        if restore:
            report.restored = restore_quarantine(data_dir)
        root = data_dir / "runs"  # the runs' local journals (and local segments)
        segments = open_segment_store(data_dir, settings.segments_url)
        segments.check()
        runs = scan(segments, report, progress)
        journal = open_journal(segments, root, fsync=False)
        for run_id, items in runs.items():
            lines = run_lines(journal, root, run_id)
            report.unusable += [(bad.where, bad.why) for bad in lines.bad]
            items += [_Item(e.t, (1, n), event=e.event) for n, e in enumerate(lines.entries)]
            items.sort(key=lambda item: (item.t, item.order))
        if target is not None:
            _rebuild_into(target, segments, runs, settings, report, progress)
            return report
    finally:
        if target is not None:
            target.close()

    building = data_dir / (INDEX_NAME + ".rebuild")
    for suffix in SIDE_FILES:
        Path(f"{building}{suffix}").unlink(missing_ok=True)  # a rebuild that did not finish
    index = Index(building, fsync=False)  # made durable once, at the end
    try:
        _rebuild_into(index, segments, runs, settings, report, progress)
        index.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        index.close()
    with open(building, "rb+") as f:
        os.fsync(f.fileno())
    report.old_index = _put_in_place(data_dir, building)
    return report


def _empty_database(url: str) -> Index:
    """The PostgreSQL index to rebuild into (schema made when new); Conflict when it holds runs already."""
    index = Index(url)  # IndexUnreachable / IndexTooNew name REPLAY_INDEX_URL
    try:
        held = index.count_runs()
        if held:
            raise Conflict(f"reindex into PostgreSQL needs an empty database, and the one REPLAY_INDEX_URL names "
                           f"holds {held} runs: nothing was changed. Point REPLAY_INDEX_URL at a new database "
                           "(CREATE DATABASE), or drop and create this one, with every replica stopped")
    except BaseException:
        index.close()
        raise
    return index


def _rebuild_into(index: Index, segments: SegmentStore, runs: dict[str, list[_Item]], settings: ServiceSettings,
                  report: ReindexReport, progress: Callable[[str], None]) -> None:
    """Commit every run's items (sorted) into `index` through the ingest pipeline's commit stage."""
    cache = SegmentCache(segments, settings.open_segment_cache, settings.open_segment_cache_bytes)
    # Health buckets are counted at the time of the rebuild (a segment's ingest time is not recorded): the rebuilt
    # run's flag rates over time start at the reindex.
    committer = Committer(index, RowReader(index, cache), _KeepFiles(segments, BufferPool(keep=1), fsync=False),
                          HealthTables(index), settings.health_bucket_s)
    rebuild = _Rebuild(index, cache, committer, report, progress)
    for run_id in sorted(runs):
        rebuild.run(run_id, runs[run_id])


def _put_in_place(data_dir: Path, building: Path) -> Path | None:
    """Rename the rebuilt index into place, keeping an old one (and its WAL) aside; where the old one went."""
    current = data_dir / INDEX_NAME
    kept = None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in SIDE_FILES:
        old = Path(f"{current}{suffix}")
        if old.exists():
            aside = Path(f"{current}.before-reindex-{stamp}{suffix}")
            os.replace(old, aside)
            kept = kept or Path(f"{current}.before-reindex-{stamp}")
    for suffix in SIDE_FILES[1:]:
        Path(f"{building}{suffix}").unlink(missing_ok=True)  # checkpointed and closed: nothing left in them
    os.replace(building, current)
    fsync_dir(data_dir)
    return kept


class _Rebuild:
    """Commits one run's segments and journal events, in order, into the new index."""

    def __init__(self, index: Index, cache: SegmentCache, committer: Committer, report: ReindexReport,
                 progress: Callable[[str], None]) -> None:
        self.index = index
        self.cache = cache
        self.committer = committer
        self.registry = RunRegistry(index)
        self.report = report
        self.progress = progress

    def run(self, run_id: str, items: list[_Item]) -> None:
        """Rebuild one run from its items (sorted by time)."""
        created_at: float | None = None
        waiting: list[JournalEvent] = []  # events met before the run's first segment (its run row) was committed
        for item in items:
            if item.segment is not None:
                self._segment(*item.segment)
                for event in waiting:
                    self._event(run_id, event)
                waiting = []
            elif item.event is not None:
                if isinstance(item.event, RunCreated):
                    created_at = item.event.created_at
                elif self.registry.get(run_id) is None:
                    waiting.append(item.event)
                else:
                    self._event(run_id, item.event)
        if self.registry.get(run_id) is None:
            return  # no segment of it could be committed
        self.report.runs += 1
        first = min(i.t for i in items if i.segment is not None)
        self.index.set_created_at(run_id, created_at if created_at is not None else first / 1e9)

    def _segment(self, rel: str, meta: SegmentMeta, size: int) -> None:
        self.progress(rel)
        batch = self.cache.get(rel)
        try:
            run = self.registry.for_batch(meta.rows)
            rows = read_rows(pa.Table.from_batches([batch]), meta.rows)
            rows.weight_versions = meta.weight_versions  # segment 2.6 keeps them in its metadata, not a column
            checked = check(rows, run.shape)
        except (FormatError, Conflict) as exc:
            self.report.unusable.append((rel, str(exc)))
            return
        checked.flags = np.array(batch.column("flags").to_numpy(zero_copy_only=False), np.uint16)  # as stored
        checked.digest = meta.digest
        checked.padding_dropped = np.array([meta.padding.get(r, 0) for r in rows.request_ids], np.int64)
        try:
            result = self.committer.commit(Segment(checked, rel, size, meta.written_ns), run)
        except Conflict as exc:  # the same (run, writer, seq) with other rows: a writer bug kept on disk
            self.report.unusable.append((rel, exc.message))
            return
        if result.stored:
            self.report.segments += 1
            self.report.rows += result.rows
        else:
            self.report.duplicates.append(rel)

    def _event(self, run_id: str, event: JournalEvent) -> None:
        self.report.events += 1
        if isinstance(event, RequestEnded):
            with self.index.transaction() as tx:
                tx.set_final(run_id, event.request_id, event.num_tokens, RequestStatus(event.status.value))
        elif isinstance(event, ReferencesAdded):
            run = self.registry.require(run_id)
            with run.lock, self.index.transaction() as tx:
                Resolver(tx, self.committer.reader, run_id, run.shape).add(list(event.references))
