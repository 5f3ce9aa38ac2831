"""Ranged reads of a segment (segment.md, "Blocks"): fetch and check only the blocks of rows a read asks for.

Contract: an uncompressed segment 2.4 on states a CRC32C per block of `BLOCK_ROWS` rows over the served columns
(`block_crcs`) and where those columns' buffers lie (`buffer_offsets`); `read_rows` and `read_blocks` fetch the
covering blocks through a `read_at` callable and serve rows only from blocks that pass (DamagedSegment otherwise).
`ranged_metadata` and `fill_offsets` make those keys. Format logic only: places.py fetches through it and write.py
writes with it; a segment without offsets (compressed, or before 2.4) is read whole.
Design: docs/design/store.md ("Ranged reads from a bucket").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import crc32c
import numpy as np
import pyarrow as pa

from replay_format import FormatError
from replay_format.core import decode_metadata, token_ids
from replay_format.segment import (
    BLOCK_CHECKSUM_KEY,
    BLOCK_ROWS,
    BUFFER_OFFSETS_KEY,
    LEGACY_OFFSETS_KEY,
    WEIGHT_VERSIONS_KEY,
    segment_versions,
)
from replay_format.weight_versions import WeightVersions
from replay_service.errors import DamagedSegment

#: the columns a ranged read returns (what a route read uses; the request ids are the index's business)
SERVED = ("position", "token_id", "experts", "flags")
#: the offsets' keys: the served columns' data buffers, the token ids' validity bitmap, and the row count
_OFFSET_KEYS = ("rows", "position", "token_id", "token_id_validity", "experts", "flags")
_PLACEHOLDER = 10**18  # wider than any offset: the real offsets, padded, take exactly the placeholder's bytes
TAIL_BYTES = 16 << 10  # fetched at once from a segment's end: its footer (schema, metadata) fits unless huge

ReadAt = Callable[[int, int], pa.Buffer]  # (offset, length) -> the object's bytes there


def _part(values: np.ndarray, dtype: str) -> pa.Buffer:
    """Little-endian bytes of `values`, contiguous."""
    return pa.py_buffer(np.ascontiguousarray(values, np.dtype(dtype) if dtype else values.dtype.newbyteorder("<")))


def block_crcs(batch: pa.RecordBatch, versions: WeightVersions | None = None) -> list[int]:
    """CRC32C of each block of `BLOCK_ROWS` rows of `batch` (its first row starts a block), over the served columns'
    content in segment.md's order: positions, token ids (null as -1), the ids flattened, flags; then, in a segment
    naming weight versions (2.6: `versions`, one per row of `batch`), each row's label index (int16, -1 unknown)
    and the segment's labels as a JSON list."""
    positions = batch.column("position").to_numpy(zero_copy_only=False)
    tokens = token_ids(batch.column("token_id"))
    experts = batch.column("experts").flatten().to_numpy(zero_copy_only=False)
    flags = batch.column("flags").to_numpy(zero_copy_only=False)
    width = batch.schema.field("experts").type.list_size
    labels = None if versions is None else pa.py_buffer(json.dumps(list(versions.labels)).encode())
    out = []
    for a in range(0, batch.num_rows, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, batch.num_rows)
        crc = 0
        for part in (_part(positions[a:b], "<i4"), _part(tokens[a:b], "<i4"), _part(experts[a * width:b * width], ""),
                     _part(flags[a:b], "<u2")):
            crc = crc32c.crc32c(part, crc)
        if versions is not None and labels is not None:
            crc = crc32c.crc32c(labels, crc32c.crc32c(_part(versions.index[a:b], "<i2"), crc))
        out.append(crc)
    return out


def ranged_metadata(batch: pa.RecordBatch) -> dict[str, str]:
    """`batch`'s metadata with its block checksums and a buffer offsets placeholder (`fill_offsets` replaces it)."""
    md = decode_metadata(batch.schema.metadata, "segment")
    versions = segment_versions(batch.schema.metadata, batch.num_rows)
    md[BLOCK_CHECKSUM_KEY] = "".join(f"{crc:08x}" for crc in block_crcs(batch, versions))
    md[BUFFER_OFFSETS_KEY] = json.dumps(dict.fromkeys(_OFFSET_KEYS, _PLACEHOLDER), separators=(",", ":"))
    return md


def buffer_offsets(image: pa.Buffer) -> dict[str, int | None]:
    """Where an uncompressed segment image's served buffers lie: offsets into `image` (read back zero-copy)."""
    batch = pa.ipc.open_file(pa.BufferReader(image)).get_batch(0)
    token_validity, token_values = batch.column("token_id").buffers()

    def offset(buf: pa.Buffer | None) -> int | None:
        if buf is None:
            return None
        at = buf.address - image.address
        if not 0 <= at <= image.size - buf.size:  # a copy (pyarrow realigning it), not a view: no offset to record
            raise ValueError(f"a segment buffer is not a view of its image (at {at})")
        return at

    return {"rows": batch.num_rows, "position": offset(batch.column("position").buffers()[1]),
            "token_id": offset(token_values), "token_id_validity": offset(token_validity),
            "experts": offset(batch.column("experts").buffers()[-1]),
            "flags": offset(batch.column("flags").buffers()[1])}


def fill_offsets(md: dict[str, str], first_image: pa.Buffer) -> dict[str, str]:
    """`md` with the buffer offsets of `first_image` (written with the placeholder) in the placeholder's exact width."""
    placeholder = md[BUFFER_OFFSETS_KEY]
    text = json.dumps(buffer_offsets(first_image), separators=(",", ":"))
    if len(text) > len(placeholder):
        raise ValueError("a segment's buffer offsets are wider than their placeholder")
    return {**md, BUFFER_OFFSETS_KEY: text.ljust(len(placeholder))}


@dataclass(frozen=True)
class BufferOffsets:
    """What a ranged read needs of one segment: its size, row count, buffers' offsets, blocks' CRC32C, ids' type."""

    size: int
    rows: int
    buffers: dict[str, int | None]  # served buffer -> its byte offset in the segment (None: no validity bitmap)
    crcs: list[int]
    experts_type: pa.FixedSizeListType
    versions: WeightVersions | None = None  # each row's weight version (segment 2.6), None: none named
    versions_text: bytes | None = None  # the segment's `weight_versions` value, carried by the rows read

    @classmethod
    def from_schema(cls, schema: pa.Schema, size: int) -> BufferOffsets | None:
        """The offsets a segment's schema states; None when it states none (before 2.4, or compressed).

        Under `buffer_offsets` (segment 2.5 on), or `layout` (a segment written by 2.4).
        """
        md = decode_metadata(schema.metadata, "segment")
        stated = md.get(BUFFER_OFFSETS_KEY, md.get(LEGACY_OFFSETS_KEY))
        if stated is None or BLOCK_CHECKSUM_KEY not in md:
            return None
        try:
            raw = json.loads(stated)
            if not isinstance(raw, dict) or set(raw) != set(_OFFSET_KEYS):
                raise ValueError
            offsets = {k: raw[k] for k in _OFFSET_KEYS}
            for key, value in offsets.items():
                if not ((value is None and key == "token_id_validity")
                        or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= size)):
                    raise ValueError
            text = md[BLOCK_CHECKSUM_KEY]
            crcs = [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]
        except (ValueError, RecursionError):
            raise FormatError("segment: schema metadata buffer_offsets or block_crc32c is malformed") from None
        rows = offsets.pop("rows")
        assert rows is not None
        if len(crcs) != -(-rows // BLOCK_ROWS) or len(text) != 8 * len(crcs):
            raise FormatError(f"segment: {len(text) // 8} block checksums for {rows} rows")
        experts_type = schema.field("experts").type
        if not pa.types.is_fixed_size_list(experts_type):
            raise FormatError(f"segment: column 'experts' has type {experts_type}")
        versions = segment_versions(schema.metadata, rows)
        stated_versions = None if versions is None else (schema.metadata or {})[WEIGHT_VERSIONS_KEY.encode()]
        return cls(size, rows, offsets, crcs, experts_type, versions, stated_versions)


def covering_rows(offsets: BufferOffsets, lo: int, hi: int, rel: str, where: str) -> tuple[int, int]:
    """The rows `[r0, r1)` of the whole blocks holding rows `[lo, hi)`; DamagedSegment when the segment lacks them."""
    if not 0 <= lo < hi <= offsets.rows:
        raise DamagedSegment(f"segment {where} holds {offsets.rows} rows, not rows {lo}..{hi - 1} its index names: "
                             "restore it from a backup", rel)
    return lo // BLOCK_ROWS * BLOCK_ROWS, min(-(-hi // BLOCK_ROWS) * BLOCK_ROWS, offsets.rows)


def read_rows(offsets: BufferOffsets, read_at: ReadAt, lo: int, hi: int, rel: str, where: str) -> pa.RecordBatch:
    """Rows `[lo, hi)` of a segment (columns `SERVED`), fetched through `read_at` by the blocks covering them."""
    r0, r1 = covering_rows(offsets, lo, hi, rel, where)
    return read_blocks(offsets, read_at, r0, r1, rel, where).slice(lo - r0, hi - lo)


def read_blocks(offsets: BufferOffsets, read_at: ReadAt, r0: int, r1: int, rel: str, where: str) -> pa.RecordBatch:
    """Rows `[r0, r1)` of a segment (whole blocks: `covering_rows`), columns `SERVED`, fetched through `read_at`.

    Every fetched block is checked against its CRC32C; DamagedSegment naming the segment and the rows when one
    fails (nothing of it is served), or when the bytes are not there. The batch's schema metadata carries the
    segment's `weight_versions` (2.6; over the segment's rows, not the batch's) when it names any.
    """
    first, last = r0 // BLOCK_ROWS, (r1 - 1) // BLOCK_ROWS
    n = r1 - r0
    width = offsets.experts_type.list_size
    id_type = offsets.experts_type.value_type
    id_bytes = id_type.bit_width // 8

    def fetch(key: str, start: int, length: int) -> pa.Buffer:
        offset = offsets.buffers[key]
        assert offset is not None
        got = read_at(offset + start, length)
        if got.size != length:
            raise DamagedSegment(f"segment {where} is damaged (its {key} bytes end early): its rows are not served; "
                                 "restore it from a backup", rel)
        return got

    validity = None
    if offsets.buffers["token_id_validity"] is not None:
        validity = fetch("token_id_validity", r0 // 8, -(-n // 8))  # BLOCK_ROWS is a multiple of 8: byte-aligned
    arrays = [
        pa.Array.from_buffers(pa.int32(), n, [None, fetch("position", 4 * r0, 4 * n)]),
        pa.Array.from_buffers(pa.int32(), n, [validity, fetch("token_id", 4 * r0, 4 * n)]),
        pa.FixedSizeListArray.from_arrays(
            pa.Array.from_buffers(id_type, n * width, [None, fetch("experts", r0 * width * id_bytes,
                                                                   n * width * id_bytes)]), width),
        pa.Array.from_buffers(pa.uint16(), n, [None, fetch("flags", 2 * r0, 2 * n)]),
    ]
    batch = pa.RecordBatch.from_arrays(arrays, names=list(SERVED))
    versions = None if offsets.versions is None else offsets.versions.take(slice(r0, r1))
    for block, (actual, stored) in enumerate(zip(block_crcs(batch, versions), offsets.crcs[first:last + 1],
                                                 strict=True)):
        if actual != stored:
            a = r0 + block * BLOCK_ROWS
            raise DamagedSegment(
                f"segment {where} is damaged (rows {a}..{min(a + BLOCK_ROWS, offsets.rows) - 1}: CRC32C {actual:08x}, "
                f"written {stored:08x}): its rows are not served; restore it from a backup; `replay-service verify` "
                "lists every damaged segment", rel)
    if offsets.versions_text is not None:
        batch = batch.replace_schema_metadata({WEIGHT_VERSIONS_KEY.encode(): offsets.versions_text})
    return batch


class TailFile:
    """A read-only file over `read_at` for pyarrow's IPC reader (`pa.PythonFile`), fetching the object's last
    `TAIL_BYTES` at once: the reader's two reads of the footer (its length, then it) cost one GET."""

    def __init__(self, read_at: ReadAt, size: int) -> None:
        self.read_at = read_at
        self.size = size
        self.pos = 0
        self.closed = False
        self._tail_at = max(0, size - TAIL_BYTES)
        self._tail: pa.Buffer | None = None

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, nbytes: int = -1) -> bytes:
        end = self.size if nbytes < 0 else min(self.size, self.pos + nbytes)
        start, self.pos = self.pos, max(self.pos, end)
        if start >= end:
            return b""
        if start >= self._tail_at:
            if self._tail is None:
                self._tail = self.read_at(self._tail_at, self.size - self._tail_at)
            return self._tail.slice(start - self._tail_at, end - start).to_pybytes()
        return self.read_at(start, end - start).to_pybytes()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def read_offsets(read_at: ReadAt, size: int) -> BufferOffsets | None:
    """A segment's buffer offsets from its footer (fetched through `read_at`); None when it states none."""
    with pa.PythonFile(TailFile(read_at, size), mode="r") as source:
        schema = pa.ipc.open_file(source).schema
    return BufferOffsets.from_schema(schema, size)
