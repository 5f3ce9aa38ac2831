"""Segment files: how the service stores one acknowledged row batch on disk or in a bucket (spec: segment.md).

A segment is one Arrow IPC *file* holding one record batch of the row batch's schema (rows.md) plus the keys
below in its schema metadata: enough to rebuild its index rows (`SegmentMeta`), its checksums, and where its
buffers lie for ranged reads. The service writes it (`replay_service.ingest.segment`), checks it when opening it
(`replay_service.store.integrity`, `replay_service.store.ranges`) and rebuilds its index from it
(`replay-service reindex`). Only the service reads segments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum

import pyarrow as pa

from replay_format import rows
from replay_format.core import FormatError, FormatVersion, metadata_int, metadata_version
from replay_format.rows import RowsMeta

# A segment's `format` key names the row batch's format, as every segment written so far does: a segment is a
# row batch stored, and older readers read it as one. Its `format_version` is the segment's own (below).
FORMAT = rows.FORMAT
# 2.2 the keys that make it self-describing; 2.3 buffer compression; 2.4 block checksums and buffer offsets;
# 2.5 the offsets under BUFFER_OFFSETS_KEY (2.4 wrote them under LEGACY_OFFSETS_KEY, still read).
# Up to 2.4 this was the row batch's own version (rows.md): a body and a segment of 2.4 say the same.
VERSION = FormatVersion(2, 5)
# The first version whose segments carry what their index rows say: an older one cannot be reindexed.
SELF_DESCRIBING_VERSION = FormatVersion(2, 2)

DIGEST_KEY = "digest"
WRITTEN_KEY = "written_ns"
PADDING_KEY = "padding"
CHECKSUM_KEY = "crc32c"
# 2.4 (segment.md, "Blocks"): rows are checked in blocks of BLOCK_ROWS, so a read of a few rows checks only theirs
BLOCK_ROWS = 4096
BLOCK_CHECKSUM_KEY = "block_crc32c"
BUFFER_OFFSETS_KEY = "buffer_offsets"  # 2.5
LEGACY_OFFSETS_KEY = "layout"  # 2.4's name for the buffer offsets: read, never written
#: the keys only a segment carries: a body's own keys by these names are not carried into its segment
KEYS = (DIGEST_KEY, WRITTEN_KEY, PADDING_KEY, CHECKSUM_KEY, BLOCK_CHECKSUM_KEY, BUFFER_OFFSETS_KEY,
        LEGACY_OFFSETS_KEY)


class SegmentCompression(StrEnum):
    """Arrow IPC buffer compression of a segment file (segment.md, "Compression"); Arrow readers undo it unasked."""

    NONE = "none"  # memory-mapped reads are zero-copy views of the page cache
    LZ4 = "lz4"  # Arrow's LZ4_FRAME
    ZSTD = "zstd"  # Arrow's ZSTD, level 1 (bench/compression.py: level 3 saved no byte more on routes)

    def ipc_options(self) -> pa.ipc.IpcWriteOptions:
        """The IPC write options that apply this compression."""
        codec = {SegmentCompression.NONE: None, SegmentCompression.LZ4: pa.Codec("lz4"),
                 SegmentCompression.ZSTD: pa.Codec("zstd", compression_level=1)}[self]
        return pa.ipc.IpcWriteOptions(compression=codec)


@dataclass(frozen=True)
class SegmentMeta:
    """What a segment file says beside its rows (segment.md, "Metadata"): enough to rebuild its index rows."""

    rows: RowsMeta
    digest: str  # the batch's digest: a retry of (run, writer, seq) must match it
    written_ns: int  # ns since the epoch, when written: reindex commits a run's segments in this order
    padding: dict[str, int] = field(default_factory=dict)  # request id -> writer padding rows dropped, where not 0
    crc32c: int | None = None  # the checksum (segment.md says over what); None before it is computed

    def to_metadata(self) -> dict[str, str]:
        """The segment's schema metadata (a body's unknown keys are not carried into segments)."""
        md = replace(self.rows, extra={}).to_metadata()
        md["format_version"] = str(VERSION)
        md.update({DIGEST_KEY: self.digest, WRITTEN_KEY: str(self.written_ns)})
        if self.padding:
            md[PADDING_KEY] = json.dumps(self.padding, sort_keys=True)
        if self.crc32c is not None:
            md[CHECKSUM_KEY] = f"{self.crc32c:08x}"
        return md

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> SegmentMeta:
        """Parse a segment's metadata; FormatError when it was written before 2.2 or a key is bad."""
        what = "segment"
        version = metadata_version(md, what, VERSION, rows.LEGACY_VERSION)
        if version < SELF_DESCRIBING_VERSION or DIGEST_KEY not in md:
            raise FormatError(f"{what}: format_version {version} carries no run, writer and seq (written before "
                              f"{SELF_DESCRIBING_VERSION}); its index rows cannot be rebuilt from it")
        meta = RowsMeta.from_metadata({k: v for k, v in md.items() if k not in KEYS})
        try:
            padding = json.loads(md.get(PADDING_KEY, "{}"))
            if not isinstance(padding, dict) or not all(isinstance(v, int) for v in padding.values()):
                raise ValueError
            crc = int(md[CHECKSUM_KEY], 16) if CHECKSUM_KEY in md else None
        except (ValueError, RecursionError):
            raise FormatError(f"{what}: schema metadata padding or crc32c is malformed") from None
        return cls(meta, md[DIGEST_KEY], metadata_int(md, WRITTEN_KEY, what), padding, crc)
