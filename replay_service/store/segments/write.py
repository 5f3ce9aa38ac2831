"""The segment file's writers: a checked batch as a sealed Arrow IPC file, on local disk or as a bucket object.

Contract (segment.md): a segment carries what its index rows say (run, writer, seq, shape, digest, when written,
padding dropped per request, weight-version runs) and a CRC32C over all of it and the rows (`integrity.seal`),
checked whenever it is opened. `write_segment` is atomic: the file exists whole under its name or not at all;
with fsync its data is durable before the rename. A bucket object carries block checksums and buffer offsets
(`object_image`, ranges.py) so that reads fetch only the rows they serve.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from replay_format.durable import fsync_dir
from replay_format.segment import BUFFER_OFFSETS_KEY, CHECKSUM_KEY, IdLayout, SegmentCompression, SegmentMeta, as_stored
from replay_service.buffers import PAGE, BufferPool
from replay_service.checks.check import CheckedRows
from replay_service.store.segments.durable import tmp_path
from replay_service.store.segments.integrity import seal
from replay_service.store.segments.ranges import buffer_offsets, fill_offsets, ranged_metadata


def segment_meta(checked: CheckedRows, id_layout: IdLayout = IdLayout.ROWS) -> SegmentMeta:
    """What the segment of `checked` says beside its rows (everything its index rows record)."""
    rows = checked.rows
    padding = {rows.request_ids[i]: int(checked.padding_dropped[i]) for i in np.flatnonzero(checked.padding_dropped)}
    return SegmentMeta(rows.meta, checked.digest, time.time_ns(), padding, weight_versions=rows.weight_versions,
                       id_layout=id_layout)


def segment_batch(checked: CheckedRows, meta: SegmentMeta) -> pa.RecordBatch:
    """The unsealed record batch of a segment: the rows with the service's flags, `meta` as its schema metadata.

    The rows' weight versions are in `meta` (runs, segment.md "Weight versions"), not a `weight_version` column.
    """
    return replace(checked.rows, weight_versions=None).to_record_batch(checked.flags, meta.to_metadata())


def sealed_batch(checked: CheckedRows, meta: SegmentMeta) -> pa.RecordBatch:
    """The record batch a local segment file holds: `segment_batch` sealed, in its stored layout."""
    return as_stored(seal(segment_batch(checked, meta)))


def segment_image(batch: pa.RecordBatch, compression: SegmentCompression = SegmentCompression.NONE) -> pa.Buffer:
    """`batch` as a whole Arrow IPC file image in memory (an object store's upload)."""
    sink = pa.BufferOutputStream()
    _write_ipc_file(sink, batch, compression.ipc_options())
    return sink.getvalue()


def object_image(batch: pa.RecordBatch, compression: SegmentCompression = SegmentCompression.NONE) -> pa.Buffer:
    """An unsealed segment batch sealed, as the whole image an object store holds.

    Uncompressed, it also carries its block checksums and its buffers' offsets (segment.md, "Blocks";
    store/segments/ranges.py), so a read fetches only the blocks of the rows it asks for. Finding the offsets takes a
    second image build (a copy of the batch in memory, small beside the upload); local segments, read through a
    memory map, carry neither.
    """
    if compression is not SegmentCompression.NONE:  # compressed buffers have no byte range per row
        return segment_image(as_stored(seal(batch)), compression)
    md = ranged_metadata(batch)
    first = segment_image(batch.replace_schema_metadata({**md, CHECKSUM_KEY: "0" * 8}))  # the checksum's width
    md = fill_offsets(md, first)
    image = segment_image(seal(batch.replace_schema_metadata(md)))
    if json.loads(md[BUFFER_OFFSETS_KEY]) != buffer_offsets(image):  # same widths, same places: checked, never assumed
        raise RuntimeError("a segment's buffers moved between its two image builds")
    return image


def write_segment(path: Path, batch: pa.RecordBatch, staging: BufferPool, fsync: bool = True,
                  direct: bool = True, compression: SegmentCompression = SegmentCompression.NONE,
                  sync_folder: bool = True) -> int:
    """Write `batch` as an Arrow IPC file at `path` atomically; returns its size in bytes.

    With `fsync`, the file's data is fsynced before its rename, and its folder after it unless
    `sync_folder` is False (the ingest commit syncs each run folder once per group: commit.py).

    The file image is built in a reused staging buffer and, with `direct`, written
    with O_DIRECT: the bytes go to disk without first being copied into freshly
    allocated page cache (measured: most of the write's CPU on the bench VM, see
    buffers.py). Reads later fault the pages in from disk. A filesystem without
    O_DIRECT (tmpfs) gets an ordinary buffered write. With `compression` (segment.md,
    "Compression") the image is encoded and compressed once, then copied into the staging buffer.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    options = compression.ipc_options()
    compressed = None
    if compression is SegmentCompression.NONE:
        counter = pa.MockOutputStream()  # sized first, then written straight into the staging buffer
        _write_ipc_file(counter, batch, options)
        size = counter.size()
    else:  # compressing twice (size, then image) would double the codec's cost
        sink = pa.BufferOutputStream()
        _write_ipc_file(sink, batch, options)
        compressed = sink.getvalue()
        size = compressed.size
    padded = -(-size // PAGE) * PAGE  # O_DIRECT writes whole aligned blocks; truncated back below
    try:
        with staging.borrowed(padded) as image:
            if compressed is None:
                _write_ipc_file(pa.FixedSizeBufferWriter(pa.py_buffer(image)), batch, options)
            else:
                image[:size] = memoryview(compressed).cast("B")
            fd, direct = _open_new(tmp, direct)
            try:
                try:
                    _write_all(fd, image if direct else image[:size])
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    os.close(fd)  # the filesystem took O_DIRECT at open but not on write
                    fd, direct = _open_new(tmp, direct=False)
                    _write_all(fd, image[:size])
                if direct:
                    os.ftruncate(fd, size)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) leaves no partial file; the API answers 507
        raise
    if fsync and sync_folder:
        fsync_dir(path.parent)
    return size


def _open_new(path: Path, direct: bool) -> tuple[int, bool]:
    """A new file for writing, and whether it is open with O_DIRECT."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, data: memoryview) -> None:
    while data:  # a regular file takes it in one call; a short write is still no reason to lose bytes
        data = data[os.write(fd, data):]


def _write_ipc_file(sink, batch: pa.RecordBatch, options: pa.ipc.IpcWriteOptions) -> None:
    with pa.ipc.new_file(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
