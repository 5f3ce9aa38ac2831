"""The ingest pipeline: one batch through decode -> check -> segment -> commit.

    body --decode.py--> Rows --checks/check.py--> CheckedRows --segment.py--> Segment --commit.py--> IngestResult

Decoding happens before this (the API decodes the body it was sent; `decode.py`); `IngestPipeline.ingest`
runs the rest in order. A retry of a stored batch is answered after the check stage (its digest is
known then) and goes no further. `IngestPipeline.for_store` builds the pipeline a store is opened with
(`replay_service.app.open_store`); the store calls it through `store/ingest_stage.py`'s `BatchIngest`.
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
from replay_service.ingest.segment import SegmentWriter
from replay_service.ingest.stale_feed import StaleFeed
from replay_service.store import RouteStore
from replay_service.store.ingest_stage import IngestResult
from replay_service.store.runs import RunRegistry


class IngestPipeline:
    """The stages, wired to one store's run registry, segment writer, STALE table and committer."""

    def __init__(self, runs: RunRegistry, segments: SegmentWriter, committer: Committer, recent: RecentRows,
                 stale_min_entropy_bits: float, feed: StaleFeed | None = None) -> None:
        self.runs = runs
        self.segments = segments
        self.committer = committer
        self.recent = recent
        self.stale_min_entropy_bits = stale_min_entropy_bits
        self.feed = feed  # replicas: the rows the STALE check remembered, shared with the others (stale_feed.py)
        kernels.warm_up()  # compile the row checks and the STALE probe now, not in the first client's ingest
        recent_rows.warm_up()

    @classmethod
    def for_store(cls, store: RouteStore) -> IngestPipeline:
        """The pipeline of `store`, with the settings it was opened with (`RouteStore`'s `pipeline` argument)."""
        settings = store.settings
        staging = BufferPool(keep=settings.max_concurrent_ingests)  # segment images before they are written
        segments = SegmentWriter(store.segments, staging, fsync=settings.fsync, direct=settings.direct_io,
                                 compression=settings.segment_compression, id_layout=settings.segment_id_layout)
        recent = RecentRows(settings.stale_table_rows, settings.stale_table_file)
        feed = None
        if settings.stale_feed and settings.index_url is not None:  # replicas share a PostgreSQL index
            feed = StaleFeed(store.index, recent, recent.id, settings.stale_feed_interval_s,
                             settings.stale_feed_window_s).start()
        return cls(store.registry, segments, Committer(store.index, store.reader, segments, store.health,
                                                          settings.health_bucket_s),
                   recent, settings.stale_min_entropy_bits, feed)

    def ingest(self, rows: Rows) -> IngestResult:
        """Store one decoded batch; idempotent on (run_id, writer_id, seq)."""
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
                # Its folder went to the trash under this write (retention.py): the batch of a deleted run.
                raise RunDeleted(f"run {rows.meta.run_id!r} was deleted while this batch was being stored; "
                                 "nothing was stored (send it again to start a fresh run)") from None
            result = self.committer.commit(segment, run)  # deletes the segment itself when the commit fails
        if self.feed is not None and remembered is not None:
            self.feed.note(remembered.hashes, remembered.requests, remembered.positions, remembered.tokens)
        return result

    def close(self) -> None:
        """Publish what the STALE feed holds and stop it (a no-op without replicas)."""
        if self.feed is not None:
            self.feed.close()


# A full disk or quota: the segment's write or the index's commit failed, nothing is acknowledged.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


@contextmanager
def storage_full_refused() -> Iterator[None]:
    """Turn a full disk into `StorageFull` (507): the writer keeps the batch and retries once space returns.

    A full index disk is turned into StorageFull by the index backend itself (store/index_backends/).
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL_ERRNOS:
            raise
        raise StorageFull(f"the data directory's disk is full ({exc.strerror}): nothing was stored; retry once "
                          "space is freed") from exc
