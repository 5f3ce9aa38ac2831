"""Segment files: how the service stores one acknowledged row batch on disk or in a bucket (spec: segment.md).

A segment is one Arrow IPC *file* holding one record batch of the row batch's schema (rows.md) plus the keys
below in its schema metadata: enough to rebuild its index rows (`SegmentMeta`), its checksums, and where its
buffers lie for ranged reads. The service writes it (`replay_service.ingest.segment`), checks it when opening it
(`replay_service.store.integrity`, `replay_service.store.ranges`) and rebuilds its index from it
(`replay-service reindex`). Only the service reads segments.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import pyarrow as pa

from replay_format import rows
from replay_format.core import FormatError, FormatVersion, metadata_int, metadata_version
from replay_format.rows import RowsMeta
from replay_format.weight_versions import MAX_LABELS, UNKNOWN, WeightVersions, check_label

# A segment's `format` key names the row batch's format, as every segment written so far does: a segment is a
# row batch stored, and older readers read it as one. Its `format_version` is the segment's own (below).
FORMAT = rows.FORMAT
# 2.2 the keys that make it self-describing; 2.3 buffer compression; 2.4 block checksums and buffer offsets;
# 2.5 the offsets under BUFFER_OFFSETS_KEY (2.4 wrote them under LEGACY_OFFSETS_KEY, still read); 2.6 the rows'
# weight versions as runs under WEIGHT_VERSIONS_KEY (a segment without the key: every row's version unknown).
# Up to 2.4 this was the row batch's own version (rows.md): a body and a segment of 2.4 say the same.
VERSION = FormatVersion(2, 6)
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
# 2.6 (segment.md, "Weight versions"): the rows' versions as runs, not a column (measured: bytes per id unchanged)
WEIGHT_VERSIONS_KEY = "weight_versions"
#: the keys only a segment carries: a body's own keys by these names are not carried into its segment
KEYS = (DIGEST_KEY, WRITTEN_KEY, PADDING_KEY, CHECKSUM_KEY, BLOCK_CHECKSUM_KEY, BUFFER_OFFSETS_KEY,
        LEGACY_OFFSETS_KEY, WEIGHT_VERSIONS_KEY)


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
    # each row's weight version (2.6); None: not one is known (the key is left out)
    weight_versions: WeightVersions | None = field(default=None, compare=False)

    def to_metadata(self) -> dict[str, str]:
        """The segment's schema metadata (a body's unknown keys are not carried into segments)."""
        md = replace(self.rows, extra={}).to_metadata()
        md["format_version"] = str(VERSION)
        md.update({DIGEST_KEY: self.digest, WRITTEN_KEY: str(self.written_ns)})
        if self.padding:
            md[PADDING_KEY] = json.dumps(self.padding, sort_keys=True)
        if self.weight_versions is not None and not self.weight_versions.all_unknown:
            md[WEIGHT_VERSIONS_KEY] = versions_text(self.weight_versions)
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
        versions = parse_versions(md[WEIGHT_VERSIONS_KEY]) if WEIGHT_VERSIONS_KEY in md else None
        return cls(meta, md[DIGEST_KEY], metadata_int(md, WRITTEN_KEY, what), padding, crc, versions)


def versions_text(versions: WeightVersions) -> str:
    """The `weight_versions` value of a segment's rows: `{"labels": [...], "runs": [[label index, rows], ...]}`.

    Runs of one index over consecutive rows, in row order, covering every row; index -1 is unknown.
    """
    index = versions.index
    cut = (np.flatnonzero(index[1:] != index[:-1]) + 1).tolist()
    runs = [[int(index[lo]), hi - lo] for lo, hi in zip([0, *cut], [*cut, len(index)])] if len(index) else []
    return json.dumps({"labels": list(versions.labels), "runs": runs}, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def parse_versions(text: str) -> WeightVersions:
    """A segment's `weight_versions` value as one version per row; FormatError naming what is malformed.

    Cached (segments are immutable; readers take slices of the answer and never write to it).
    """
    what = f"segment: schema metadata {WEIGHT_VERSIONS_KEY}"
    try:
        doc = json.loads(text)
        labels, runs = doc["labels"], doc["runs"]
        if not (isinstance(labels, list) and isinstance(runs, list) and len(labels) <= MAX_LABELS
                and all(isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) for r in runs)):
            raise ValueError
        codes = np.array([r[0] for r in runs], np.int64)
        counts = np.array([r[1] for r in runs], np.int64)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        raise FormatError(f"{what} is malformed") from None
    for label in labels:
        check_label(label, what + " label")
    if len(set(labels)) != len(labels) or ((codes < UNKNOWN) | (codes >= len(labels))).any() or (counts < 1).any():
        raise FormatError(f"{what} names a label twice, a label index out of range or an empty run")
    index = np.repeat(codes.astype(np.int16), counts)
    index.flags.writeable = False
    return WeightVersions(tuple(labels), index)


def segment_versions(metadata: Mapping[bytes, bytes] | None, num_rows: int | None) -> WeightVersions | None:
    """The weight version of each of a segment's rows from its schema metadata (raw, as pyarrow holds it); None
    when it names none (before 2.6, or no row's version known). FormatError when the runs do not cover exactly
    `num_rows` rows (when given: the segment's row count)."""
    raw = (metadata or {}).get(WEIGHT_VERSIONS_KEY.encode())
    if raw is None:
        return None
    try:
        versions = parse_versions(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise FormatError(f"segment: schema metadata {WEIGHT_VERSIONS_KEY} is not UTF-8") from None
    if num_rows is not None and versions.num_rows != num_rows:
        raise FormatError(f"segment: schema metadata {WEIGHT_VERSIONS_KEY} covers {versions.num_rows} rows of "
                          f"{num_rows}")
    return versions
