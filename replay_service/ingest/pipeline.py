"""The ingest pipeline over one store: a decoded batch through check -> segment -> commit.

    Rows --checks/check.py--> CheckedRows --segment.py--> Segment --commit.py--> IngestResult

The app builds one over its store (`IngestPipeline.over`); the ingest endpoints, the engines' answers
(`uploads.py`) and the demo call `ingest`. Contract: a batch is acknowledged only once its segment is durable and
its index rows are committed; a retry of a stored batch is answered after the check stage and stores nothing.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from replay_format.rows import Rows
from replay_service.buffers import BufferPool
from replay_service.checks import kernels
from replay_service.checks import recent as recent_rows
from replay_service.checks.check import check, check_stale, content_check_applies
from replay_service.checks.recent import RecentRows
from replay_service.errors import RunDeleted, StorageFull
from replay_service.ingest.commit import Committer
from replay_service.ingest.result import IngestResult
from replay_service.ingest.segment import SegmentWriter
from replay_service.ingest.stale_feed import FeedCounter, StaleFeed
from replay_service.ownership import current_actor
from replay_service.store import RouteStore


class IngestPipeline:
    """The stages, wired to one store's run registry, segment writer, STALE table and committer."""

    def __init__(self, store: RouteStore, segments: SegmentWriter, committer: Committer, recent: RecentRows,
                 stale_min_entropy_bits: float, feed: StaleFeed | None = None) -> None:
        self.store = store
        self.runs = store.registry
        self.segments = segments
        self.committer = committer
        self.recent = recent
        self.stale_min_entropy_bits = stale_min_entropy_bits
        self.feed = feed  # replicas: the rows the STALE check remembered, shared with the others (stale_feed.py)
        kernels.warm_up()  # compile the row checks and the STALE probe now, not in the first client's ingest
        recent_rows.warm_up()

    @classmethod
    def over(cls, store: RouteStore, feed_counter: FeedCounter | None = None) -> IngestPipeline:
        """The pipeline over `store`, with the settings it was opened with; `feed_counter` counts the rows the
        STALE feed moves between replicas (the app's `replay_stale_feed_rows_total`)."""
        settings = store.settings
        staging = BufferPool(keep=settings.max_concurrent_ingests)  # segment images before they are written
        segments = SegmentWriter(store.segments, staging, fsync=settings.fsync, direct=settings.direct_io,
                                 compression=settings.segment_compression, id_layout=settings.segment_id_layout)
        recent = RecentRows(settings.stale_table_rows, settings.stale_table_file)
        feed = None
        if settings.stale_feed and settings.index_url is not None:  # replicas share a PostgreSQL index
            feed = StaleFeed(store.index, recent, recent.id, settings.stale_feed_interval_s,
                             settings.stale_feed_window_s)
            if feed_counter is not None:
                feed.counter = feed_counter
            feed.start()
        return cls(store, segments, Committer(store.index, store.reader, segments, store.health,
                                                          settings.health_bucket_s),
                   recent, settings.stale_min_entropy_bits, feed)

    def ingest(self, rows: Rows) -> IngestResult:
        """Store one decoded batch; idempotent on (run_id, writer_id, seq).

        Forbidden when the caller's token may not write the batch's run (checked before anything is stored); a
        batch of a new run creates it with the batch's shape, and the run's journal records its creation.
        """
        actor = current_actor()
        if actor is not None:  # an ingest body names its run inside: checked once decoded, before anything is stored
            actor.require_run(rows.meta.run_id)
        new_run = self.runs.get(rows.meta.run_id) is None
        if new_run:
            self.store.cache.revive_run(rows.meta.run_id)  # a deleted run's id again: a missing segment is damage
        result = self._stages(rows)
        if new_run:
            self.store.journal_run_created(rows.meta.run_id)
        return result

    def _stages(self, rows: Rows) -> IngestResult:
        run = self.runs.for_batch(rows.meta)  # a new run is created with this batch's shape
        checked = check(rows, run.shape)
        duplicate = self.committer.find_duplicate(checked)
        if duplicate is not None:
            return duplicate
        remembered = None
        if content_check_applies(run.shape, self.stale_min_entropy_bits):
            remembered = check_stale(checked, self.recent)
        with storage_full_refused():
            try:
                segment = self.segments.write(checked)
            except (FileNotFoundError, FileExistsError):
                if not run.deleted and self.runs.get(rows.meta.run_id) is not None:  # (deleted by another replica)
                    raise
                # Its folder went to the trash under this write (lifecycle/retention.py): a deleted run's batch.
                raise RunDeleted(f"run {rows.meta.run_id!r} was deleted while this batch was being stored; "
                                 "nothing was stored (send it again to start a fresh run)") from None
            result = self.committer.commit(segment, run)  # deletes the segment itself when the commit fails
        if result.stored:
            self.store.cache.check_later(segment.path)  # checked now, off the request path: a step's first read maps it
        if self.feed is not None and remembered is not None:
            self.feed.note(remembered.hashes, remembered.requests, remembered.positions, remembered.tokens)
        return result

    def close(self) -> None:
        """Publish what the STALE feed holds and stop it (a no-op without replicas); the store stays open."""
        if self.feed is not None:
            self.feed.close()


# A full disk or quota: the segment's write or the index's commit failed, nothing is acknowledged.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


@contextmanager
def storage_full_refused() -> Iterator[None]:
    """Turn a full disk into `StorageFull` (507): the writer keeps the batch and retries once space returns.

    A full index disk is turned into StorageFull by the index backend itself (store/index/backends/).
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL_ERRNOS:
            raise
        raise StorageFull(f"the data directory's disk is full ({exc.strerror}): nothing was stored; retry once "
                          "space is freed") from exc
