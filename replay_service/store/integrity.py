"""Segment integrity: each segment's CRC32C (rows.md, "Segment files"), sealed when written, checked when opened.

A segment is checked whole, once per open (the segment cache keeps it mapped afterwards), and by
`replay-service verify`. The checksum covers the rows' content and the segment's metadata, not the Arrow
file's layout, so it is the same whether computed on the batch about to be written or on the one mapped
back. A segment that fails it, or that Arrow cannot open, is *damaged*: `open_segment` raises
`DamagedSegment` naming it, and nothing of it is served. CRC32C is `google-crc32c`'s hardware
implementation (SSE4.2 / ARMv8 CRC): a few GB/s, small beside faulting the pages in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import pyarrow as pa

from replay_format import FormatError
from replay_format.core import decode_metadata, token_ids
from replay_format.rows import BLOCK_CHECKSUM_KEY, CHECKSUM_KEY
from replay_service.errors import DamagedSegment
from replay_service.store.ranges import block_crcs
from replay_service.store.segment_store import LocalSegments, SegmentStore


def _json(value: object) -> pa.Buffer:
    return pa.py_buffer(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _parts(batch: pa.RecordBatch, metadata: dict[str, str]) -> Iterator[pa.Buffer]:
    """What the checksum covers, in rows.md's order (each a read-only buffer: google-crc32c takes no memoryview)."""
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
        crc = google_crc32c.extend(crc, part)
    return crc


def seal(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with its checksum added to its metadata (the segment stage writes this)."""
    md = decode_metadata(batch.schema.metadata, "segment")
    return batch.replace_schema_metadata({**md, CHECKSUM_KEY: f"{segment_crc(batch, md):08x}"})


def open_segment(store: SegmentStore | Path, rel_path: str) -> pa.RecordBatch:
    """The segment at `rel_path` of `store` (a directory: `LocalSegments`), opened and checked; DamagedSegment if not.

    Local: memory-mapped. Object store: fetched whole (the check reads every byte). A segment without a checksum
    (written before rows 2.2) is served unchecked.
    """
    if isinstance(store, Path):
        store = LocalSegments(store)
    where = f"runs/{rel_path}" if isinstance(store, LocalSegments) else f"{store.url.rstrip('/')}/{rel_path}"
    try:
        batch = store.open_batch(rel_path)
        batch.validate()  # buffer sizes fit the rows: a damaged header must not make a read run off the map
        md = decode_metadata(batch.schema.metadata, "segment")
        stored = md.get(CHECKSUM_KEY)
        if stored is None:
            return batch
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
    blocks = md.get(BLOCK_CHECKSUM_KEY)  # rows 2.4 (ranges.py): what a ranged read checks must hold as well
    if blocks is not None and blocks != "".join(f"{crc:08x}" for crc in block_crcs(batch)):
        raise DamagedSegment(f"segment {where} is damaged (its block checksums do not match its rows, which its "
                             "CRC32C does): its rows are not served; restore it from a backup", rel_path)
    return batch


def segment_problem(store: SegmentStore | Path, rel_path: str) -> str | None:
    """Why the segment at `rel_path` is damaged, or None when it passes (`verify`)."""
    try:
        open_segment(store, rel_path)
    except DamagedSegment as exc:
        return exc.message
    return None


def verify_store(data_dir: Path, run_id: str | None = None, progress: Callable[[str], None] | None = None,
                 store: SegmentStore | None = None,
                 index_url: str | None = None) -> tuple[int, list[tuple[str, str]]]:
    """Check every segment of `store` (`<data_dir>/runs` when not given; of one run when given) and those its index
    names.

    Returns how many were checked and the damaged ones as `(relative path, why)`; a segment the index
    names that is not stored counts as damaged. Read-only: safe beside a running service. The index is
    `index_url` (PostgreSQL, REPLAY_INDEX_URL) when given, else `<data_dir>/index.sqlite` if there is one.
    """
    from replay_service.store.index import Index

    store = store or LocalSegments(Path(data_dir) / "runs")
    paths = set(store.paths(run_id))
    index_path = data_dir / "index.sqlite"
    if index_url is not None or index_path.exists():
        index = Index(index_url or index_path, fsync=False)
        try:
            paths |= index.indexed_paths()
        finally:
            index.close()
    if run_id is not None:
        paths = {p for p in paths if p.split("/", 1)[0] == run_id}
    damaged = []
    for rel in sorted(paths):
        if progress is not None:
            progress(rel)
        problem = segment_problem(store, rel)
        if problem is not None:
            damaged.append((rel, problem))
    return len(paths), damaged
