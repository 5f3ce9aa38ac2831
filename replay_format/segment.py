"""Segment files: how the service stores one acknowledged row batch on disk or in a bucket (spec: segment.md).

A segment is one Arrow IPC *file* holding one record batch of the row batch's schema (rows.md) plus the keys
below in its schema metadata: enough to rebuild its index rows (`SegmentMeta`), its checksums, and where its
buffers lie for ranged reads. The service writes it (`replay_service.ingest.segment`), checks it when opening it
(`replay_service.store.segments.integrity`, `replay_service.store.segments.ranges`) and rebuilds its index from it
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
# 3.0 the ids by layer (ID_LAYOUT_KEY, `IdLayout.LAYERS`): a 2.x reader would find no `experts` column, so such a
# segment says 3.0 and 2.x readers refuse it; a segment in the rows layout is written as 2.6, which they read.
# Up to 2.4 this was the row batch's own version (rows.md): a body and a segment of 2.4 say the same.
VERSION = FormatVersion(3, 0)  # what this reader knows, and what a segment by layer says
ROWS_VERSION = FormatVersion(2, 6)  # what a segment in the rows layout says
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
# 3.0 (segment.md, "Ids by layer"): absent means `rows`
ID_LAYOUT_KEY = "id_layout"
#: the keys only a segment carries: a body's own keys by these names are not carried into its segment
KEYS = (DIGEST_KEY, WRITTEN_KEY, PADDING_KEY, CHECKSUM_KEY, BLOCK_CHECKSUM_KEY, BUFFER_OFFSETS_KEY,
        LEGACY_OFFSETS_KEY, WEIGHT_VERSIONS_KEY, ID_LAYOUT_KEY)
EXPERTS = "experts"


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


class IdLayout(StrEnum):
    """Where a segment keeps its expert ids (segment.md, "Ids by layer"); what the content is does not change."""

    ROWS = "rows"  # one `experts` column, a row's L*K ids together: zero-copy maps, byte ranges per block
    LAYERS = "layers"  # a column per MoE layer (`experts.<layer>`, K ids a row): a codec sees each layer's skew

    def for_codec(self, compression: SegmentCompression) -> IdLayout:
        """The layout a segment of `compression` is written in: by layer only under zstd (bench/compression.py:
        uncompressed it saves no byte and would cost the zero-copy and the ranged reads; lz4, no entropy coder,
        saves under 1% and reads slower)."""
        return self if compression is SegmentCompression.ZSTD else IdLayout.ROWS


def layer_column(layer: int) -> str:
    """The name of MoE layer `layer`'s column in a segment by layer."""
    return f"{EXPERTS}.{layer}"


def by_layers(batch: pa.RecordBatch, num_layers: int) -> pa.RecordBatch:
    """A segment batch in the rows layout with its `experts` column split into `num_layers` columns, one per MoE
    layer, in its place (metadata kept as it is: the caller's says the layout)."""
    at = batch.schema.get_field_index(EXPERTS)
    experts = batch.column(at)
    width = experts.type.list_size
    if width % num_layers:
        raise FormatError(f"segment: {width} ids a row do not split into {num_layers} layers")
    k = width // num_layers
    ids = experts.flatten().to_numpy(zero_copy_only=False)
    words = _row_words(ids, k)
    by_layer = np.ascontiguousarray(words.reshape(batch.num_rows, num_layers, words.shape[1]).transpose(1, 0, 2))
    id_type = experts.type.value_type
    columns = [pa.FixedSizeListArray.from_arrays(pa.array(by_layer[layer].view(ids.dtype).reshape(-1), id_type), k)
               for layer in range(num_layers)]
    fields = [pa.field(layer_column(layer), pa.list_(id_type, k), nullable=False) for layer in range(num_layers)]
    return _splice(batch, at, 1, columns, fields)


def _row_words(ids: np.ndarray, k: int) -> np.ndarray:
    """Flat `ids`, k to a row-layer, as one row of words per row-layer: the widest unsigned words (8, 4, 2 or 1
    bytes) a row-layer divides into, so numpy moves a layer's ids of a row as one word, not k (measured: joining
    48 layers of 8192 x top-8 uint8, 2.2 ms against 7.4)."""
    width = k * ids.dtype.itemsize
    unit = next(u for u in (8, 4, 2, 1) if width % u == 0)
    return np.ascontiguousarray(ids).view(f"<u{unit}").reshape(-1, width // unit)


def _splice(batch: pa.RecordBatch, at: int, count: int, arrays: list, fields: list[pa.Field]) -> pa.RecordBatch:
    """`batch` with its columns `[at, at + count)` replaced by `arrays` named by `fields`, metadata kept."""
    schema = pa.schema(list(batch.schema)[:at] + fields + list(batch.schema)[at + count :], batch.schema.metadata)
    return pa.RecordBatch.from_arrays(batch.columns[:at] + arrays + batch.columns[at + count :], schema=schema)


def as_stored(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A sealed segment batch (one `experts` column) in the layout its metadata names: what the file holds."""
    md = batch.schema.metadata or {}
    if md.get(ID_LAYOUT_KEY.encode()) != IdLayout.LAYERS.encode():
        return batch
    return by_layers(batch, int(md[b"num_moe_layers"]))


def by_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A segment batch as readers take it: one `experts` column whatever layout it was stored in (a segment by
    layer is joined back, one copy of its ids; one in the rows layout is returned as it is). FormatError when
    its metadata names an unknown layout or its columns are not the layout's."""
    md = batch.schema.metadata or {}
    layout = md.get(ID_LAYOUT_KEY.encode(), IdLayout.ROWS.encode()).decode("utf-8", "replace")
    if layout == IdLayout.ROWS:
        return batch
    if layout != IdLayout.LAYERS:
        raise FormatError(f"segment: {ID_LAYOUT_KEY} {layout!r} is not one of {', '.join(IdLayout)}")
    names = batch.schema.names
    first = names.index(layer_column(0)) if layer_column(0) in names else -1
    count = sum(1 for name in names if name.startswith(EXPERTS + "."))
    if first < 0 or EXPERTS in names or names[first : first + count] != [layer_column(i) for i in range(count)]:
        raise FormatError(f"segment: {ID_LAYOUT_KEY} {layout} without its columns {layer_column(0)}, ... in order")
    columns = batch.columns[first : first + count]
    k = columns[0].type.list_size
    if any(c.type != columns[0].type for c in columns):
        raise FormatError("segment: its layer columns differ in type")
    layers = [c.flatten().to_numpy(zero_copy_only=False) for c in columns]
    words = np.stack([_row_words(ids, k) for ids in layers], 1)
    id_type = columns[0].type.value_type
    experts = pa.FixedSizeListArray.from_arrays(pa.array(words.view(layers[0].dtype).reshape(-1), id_type), count * k)
    return _splice(batch, first, count, [experts], [pa.field(EXPERTS, pa.list_(id_type, count * k), nullable=False)])


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
    id_layout: IdLayout = IdLayout.ROWS  # 3.0: where the ids are (the key is written for LAYERS only)

    def to_metadata(self) -> dict[str, str]:
        """The segment's schema metadata (a body's unknown keys are not carried into segments)."""
        md = replace(self.rows, extra={}).to_metadata()
        md["format_version"] = str(VERSION if self.id_layout is IdLayout.LAYERS else ROWS_VERSION)
        md.update({DIGEST_KEY: self.digest, WRITTEN_KEY: str(self.written_ns)})
        if self.id_layout is IdLayout.LAYERS:
            md[ID_LAYOUT_KEY] = str(self.id_layout)
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
        # the row batch's keys as a 2.x row batch says them: from 3.0 a segment's major is its own
        rows_md = {k: v for k, v in md.items() if k not in KEYS}
        if version > ROWS_VERSION:
            rows_md["format_version"] = str(ROWS_VERSION)
        meta = RowsMeta.from_metadata(rows_md)
        try:
            padding = json.loads(md.get(PADDING_KEY, "{}"))
            if not isinstance(padding, dict) or not all(isinstance(v, int) for v in padding.values()):
                raise ValueError
            crc = int(md[CHECKSUM_KEY], 16) if CHECKSUM_KEY in md else None
        except (ValueError, RecursionError):
            raise FormatError(f"{what}: schema metadata padding or crc32c is malformed") from None
        versions = parse_versions(md[WEIGHT_VERSIONS_KEY]) if WEIGHT_VERSIONS_KEY in md else None
        try:
            layout = IdLayout(md.get(ID_LAYOUT_KEY, IdLayout.ROWS))
        except ValueError:
            raise FormatError(f"{what}: {ID_LAYOUT_KEY} {md[ID_LAYOUT_KEY]!r} is not one of "
                              f"{', '.join(IdLayout)}") from None
        return cls(meta, md[DIGEST_KEY], metadata_int(md, WRITTEN_KEY, what), padding, crc, versions, layout)


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
