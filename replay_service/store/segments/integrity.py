"""Segment integrity: each segment's CRC32C (segment.md), sealed when written, checked when opened.

A segment is checked whole, once per open (the segment cache keeps it mapped afterwards), and by
`replay-service verify`. The checksum covers the rows' content and the segment's metadata, not the Arrow
file's layout, so it is the same whether computed on the batch about to be written or on the one mapped
back. A segment that fails it, or that Arrow cannot open, is *damaged*: `open_segment` raises
`DamagedSegment` naming it, and nothing of it is served. CRC32C is the `crc32c` package's hardware
implementation (SSE4.2 / ARMv8 CRC): about 20 GB/s on the bench VM, 3.3x google-crc32c's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pyarrow as pa

from replay_format import FormatError
from replay_format.core import decode_metadata, token_ids
from replay_format.segment import BLOCK_CHECKSUM_KEY, CHECKSUM_KEY, by_rows, segment_versions
from replay_format.weight_versions import WeightVersions
from replay_service.errors import DamagedSegment
from replay_service.store.segments.places import LocalSegments, SegmentStore
from replay_service.store.segments.ranges import block_crcs


def _json(value: object) -> pa.Buffer:
    return pa.py_buffer(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _parts(batch: pa.RecordBatch, metadata: dict[str, str]) -> Iterator[pa.Buffer]:
    """What the checksum covers, in segment.md's order (each a contiguous buffer)."""
    yield _json({k: v for k, v in metadata.items() if k != CHECKSUM_KEY})
    requests = batch.column("request_id")
    yield _json(requests.dictionary.to_pylist())
    yield pa.py_buffer(np.ascontiguousarray(requests.indices.to_numpy(zero_copy_only=False), "<i4"))
    yield pa.py_buffer(np.ascontiguousarray(batch.column("position").to_numpy(zero_copy_only=False), "<i4"))
    yield pa.py_buffer(np.ascontiguousarray(token_ids(batch.column("token_id")), "<i4"))
    experts = batch.column("experts").flatten().to_numpy(zero_copy_only=False)
    yield pa.py_buffer(np.ascontiguousarray(experts, experts.dtype.newbyteorder("<")))
    yield pa.py_buffer(np.ascontiguousarray(batch.column("flags").to_numpy(zero_copy_only=False), "<u2"))


def segment_crc(batch: pa.RecordBatch, metadata: dict[str, str] | None = None) -> int:
    """The CRC32C of a segment batch's content and metadata (`metadata`: the batch's own when not given)."""
    md = metadata if metadata is not None else decode_metadata(batch.schema.metadata, "segment")
    crc = 0
    for part in _parts(batch, md):
        crc = crc32c.crc32c(part, crc)
    return crc


def _versions_or_damaged(batch: pa.RecordBatch, where: str, rel_path: str) -> WeightVersions | None:
    """The segment's rows' weight versions (2.6), DamagedSegment when its metadata names them badly."""
    try:
        return segment_versions(batch.schema.metadata, batch.num_rows)
    except FormatError as exc:
        raise DamagedSegment(f"segment {where} cannot be read ({exc}): restore it from a backup", rel_path) from None


def seal(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with its checksum added to its metadata (the segment stage writes this)."""
    md = decode_metadata(batch.schema.metadata, "segment")
    return batch.replace_schema_metadata({**md, CHECKSUM_KEY: f"{segment_crc(batch, md):08x}"})


CHECKED_ATTR = "user.routing_replay.checked"  # a local segment's extended attribute: which pool checked which file


def open_segment(store: SegmentStore | Path, rel_path: str, pool: str | None = None) -> pa.RecordBatch:
    """The segment at `rel_path` of `store` (a directory: `LocalSegments`), opened and checked; DamagedSegment if not.

    Local: memory-mapped. Object store: fetched whole (the check reads every byte). A segment whose ids are stored
    by layer (3.0) comes back with one `experts` column, as every other. A segment without a checksum (written
    before segment 2.2) is served unchecked. `pool` (`placement.processes.pool_id`: this process, or the workers of
    one `serve`): a local file the pool checked, unchanged since (inode, size, modification time), is not
    checksummed again; a file this call checks is marked so (where the filesystem keeps extended attributes;
    elsewhere every open checks it).
    """
    if isinstance(store, Path):
        store = LocalSegments(store)
    where = f"runs/{rel_path}" if isinstance(store, LocalSegments) else f"{store.url.rstrip('/')}/{rel_path}"
    mark = _Mark(store.root / rel_path, pool) if pool is not None and isinstance(store, LocalSegments) else None
    try:
        checked = mark is not None and mark.found()
        batch = store.open_batch(rel_path)
        batch.validate()  # buffer sizes fit the rows: a damaged header must not make a read run off the map
        batch = by_rows(batch)  # segment 3.0: ids stored by layer are joined back (readers take one column)
        md = decode_metadata(batch.schema.metadata, "segment")
        stored = md.get(CHECKSUM_KEY)
        if stored is None:
            return batch
        if checked and mark is not None and mark.unchanged():
            return batch  # checked whole by another worker of this service, the same file since
        actual = segment_crc(batch, md)
    except FileNotFoundError:
        raise DamagedSegment(f"segment {where} is missing: restore it from a backup", rel_path) from None
    except (pa.ArrowException, OSError, FormatError, KeyError, ValueError, UnicodeDecodeError) as exc:
        raise DamagedSegment(f"segment {where} cannot be read ({exc}): restore it from a backup; "
                             "`replay-service verify` lists every damaged segment", rel_path) from None
    if f"{actual:08x}" != stored:
        raise DamagedSegment(f"segment {where} is damaged (CRC32C {actual:08x}, written {stored}): its rows "
                             "are not served; restore it from a backup; `replay-service verify` lists every damaged "
                             "segment", rel_path)
    versions = _versions_or_damaged(batch, where, rel_path)  # 2.6: readers then take them as they are
    blocks = md.get(BLOCK_CHECKSUM_KEY)  # segment 2.4 (ranges.py): what a ranged read checks must hold as well
    if blocks is not None and blocks != "".join(f"{crc:08x}" for crc in block_crcs(batch, versions)):
        raise DamagedSegment(f"segment {where} is damaged (its block checksums do not match its rows, which its "
                             "CRC32C does): its rows are not served; restore it from a backup", rel_path)
    if mark is not None:
        mark.set()
    return batch


class _Mark:
    """A local segment file's record of the pool that checked it whole, and of the file it checked."""

    def __init__(self, path: Path, pool: str) -> None:
        self.path, self.pool = path, pool
        self.stamp = self._stamp()

    def _stamp(self) -> str | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return f"{self.pool}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def found(self) -> bool:
        """Whether another worker of the pool checked this very file (taken before the file is opened)."""
        try:
            return self.stamp is not None and os.getxattr(self.path, CHECKED_ATTR) == self.stamp.encode()
        except OSError:
            return False

    def unchanged(self) -> bool:
        """Whether the file is still the one `found` saw (taken after it was mapped)."""
        return self.stamp is not None and self._stamp() == self.stamp

    def set(self) -> None:
        """Record that this pool checked the file as it was before it was opened (nothing where not supported)."""
        if self.stamp is None or not self.unchanged():
            return
        try:
            os.setxattr(self.path, CHECKED_ATTR, self.stamp.encode())
        except OSError:
            pass  # a filesystem without user extended attributes: each worker checks for itself
