"""Ingest stage 3, segment: a checked batch becomes one durable segment file (the bytes: store/segments/write.py).

The file is written and its data fsynced before the run's lock is taken, so concurrent ingests overlap their
writes and fsyncs; its folder's fsync (the rename) is left to the commit stage, which syncs each run folder once
per group of batches (commit.py). A segment is acknowledged once the commit stage's index rows name it. In a
bucket (`REPLAY_SEGMENTS_URL`) the image is one upload, complete when it returns: nothing left to sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from replay_format.segment import IdLayout, SegmentCompression
from replay_service.buffers import BufferPool
from replay_service.checks.check import CheckedRows
from replay_service.errors import SegmentStoreUnreachable
from replay_service.store.segments.places import LocalSegments, S3Segments, SegmentStore
from replay_service.store.segments.write import object_image, sealed_batch, segment_batch, segment_meta, write_segment

log = logging.getLogger("replay_service")


@dataclass
class Segment:
    """A checked batch written durably: what the commit stage records in the index."""

    rows: CheckedRows
    path: str  # relative to the segment root: `<run_id>/<uuid>.arrow`
    size: int  # bytes
    written_ns: int = 0  # when written (segment metadata `written_ns`): the run's last write
    folder_unsynced: bool = False  # renamed into its folder, not fsynced yet: the commit does, once per group


class SegmentWriter:
    """Writes segments into `store` (a directory: local files) with the service's durability settings."""

    def __init__(self, store: SegmentStore | Path, staging: BufferPool, fsync: bool = True, direct: bool = True,
                 compression: SegmentCompression = SegmentCompression.NONE,
                 id_layout: IdLayout = IdLayout.ROWS) -> None:
        self.store = LocalSegments(store) if isinstance(store, Path) else store
        self.staging = staging  # segment images before they are written (buffers.py says why reused)
        self.fsync = fsync
        self.direct = direct
        self.compression = compression
        self.id_layout = id_layout.for_codec(compression)  # by layer under a codec only (segment.md)

    def write(self, checked: CheckedRows) -> Segment:
        """The batch's rows with the service's flags, as a new segment file."""
        path = self.store.new_path(checked.rows.meta.run_id)
        meta = segment_meta(checked, self.id_layout)
        if isinstance(self.store, S3Segments):  # one upload, complete when it returns
            image = object_image(segment_batch(checked, meta), self.compression)
            self.store.put(path, image)
            return Segment(checked, path, image.size, meta.written_ns)
        assert isinstance(self.store, LocalSegments)
        batch = sealed_batch(checked, meta)
        size = write_segment(self.store.root / path, batch, self.staging, fsync=self.fsync, direct=self.direct,
                             compression=self.compression, sync_folder=False)
        return Segment(checked, path, size, meta.written_ns, folder_unsynced=self.fsync)

    def discard(self, segment: Segment) -> None:
        """Delete a segment the index will not name (a concurrent retry won, or the commit failed).

        An object store that does not answer keeps it: no index row names it, so the orphan collector deletes it
        after its grace period (store/lifecycle/retention.py); the batch's own answer is not changed by a failed
        cleanup.
        """
        try:
            self.store.delete(segment.path)
        except SegmentStoreUnreachable as exc:
            log.warning("could not delete the unindexed segment %s (%s); orphan collection will", segment.path, exc)
