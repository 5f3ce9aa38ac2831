"""Segment compression is lossless (segment.md, "Compression"): every id dtype the rows format allows (uint8 up to
256 experts, uint16 beyond) and every shape (top-1, top-8, one layer, many layers, an empty batch), through the
service's own writer (`write_segment`) and reader (`open_segment`: map, decompress, check the CRC32C).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows
from replay_format.segment import SegmentCompression, SegmentMeta
from replay_service.buffers import BufferPool
from replay_service.settings import ServiceSettings
from replay_service.store.segments.cache import SegmentCache, heap_bytes
from replay_service.store.segments.integrity import open_segment, seal, segment_crc
from replay_service.store.segments.write import write_segment

SHAPES = {
    "uint8 top-8 x48": RunShape(num_moe_layers=48, top_k=8, num_experts=128),
    "uint8 top-1 x1": RunShape(num_moe_layers=1, top_k=1, num_experts=256),
    "uint8 top-2 x2": RunShape(num_moe_layers=2, top_k=2, num_experts=8),
    "uint16 top-8 x3": RunShape(num_moe_layers=3, top_k=8, num_experts=65536),
    "uint16 top-1 x61": RunShape(num_moe_layers=61, top_k=1, num_experts=257),
}


def _segment(shape: RunShape, n: int, seed: int = 0) -> pa.RecordBatch:
    """A sealed segment batch: skewed ids over the dtype's full range (the largest id included), some tokens null."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.5, (n, shape.row_width)) - 1) % shape.num_experts
    if n:
        ids[0, 0] = shape.num_experts - 1
    tokens = rng.integers(0, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
    tokens[::7] = -1  # unknown: a null
    flags = np.zeros(n, np.uint16)
    flags[::5] = 8
    meta = SegmentMeta(RowsMeta("run", "w", 3, shape), "d" * 64, 1, {"r1": 2})
    requests = (["r0", "r1"], (np.arange(n) * 2 // max(n, 1)).astype(np.int32))
    return seal(build_rows(shape, requests, np.arange(n, dtype=np.int32), ids.astype(shape.dtype), tokens, flags,
                           meta.to_metadata()))


@pytest.mark.parametrize("codec", list(SegmentCompression))
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("rows", [0, 1, 300])
def test_a_segment_reads_back_equal_under_every_codec(tmp_path, codec, name, rows):
    batch = _segment(SHAPES[name], rows)
    write_segment(tmp_path / "s.arrow", batch, BufferPool(keep=1), fsync=False, compression=codec)
    got = open_segment(tmp_path, "s.arrow")  # the CRC32C is checked here, on the decompressed content
    assert got.equals(batch, check_metadata=True)
    assert got.column("experts").type == batch.column("experts").type
    ids = got.column("experts").flatten().to_numpy()
    assert ids.dtype == SHAPES[name].dtype and ids.tobytes() == batch.column("experts").flatten().to_numpy().tobytes()


def test_the_checksum_is_the_same_whatever_the_codec(tmp_path):
    batch = _segment(SHAPES["uint8 top-8 x48"], 2000)
    crcs, sizes = set(), {}
    for codec in SegmentCompression:
        sizes[codec] = write_segment(tmp_path / f"{codec}.arrow", batch, BufferPool(keep=1), fsync=False,
                                     compression=codec)
        crcs.add(segment_crc(open_segment(tmp_path, f"{codec}.arrow")))
    assert crcs == {segment_crc(batch)}
    # skewed ids: a compressing codec writes fewer bytes (what the file holds is compressed, not the logical bytes)
    assert sizes[SegmentCompression.ZSTD] < sizes[SegmentCompression.NONE]
    assert sizes[SegmentCompression.LZ4] < sizes[SegmentCompression.NONE]


@pytest.mark.parametrize("codec", list(SegmentCompression))
def test_only_a_compressed_segment_is_copied_into_memory(tmp_path, codec):
    batch = _segment(SHAPES["uint8 top-8 x48"], 1500)
    write_segment(tmp_path / "s.arrow", batch, BufferPool(keep=1), fsync=False, compression=codec)
    before = pa.total_allocated_bytes()
    got = open_segment(tmp_path, "s.arrow")
    held = pa.total_allocated_bytes() - before  # Arrow memory the opened segment holds (a map holds none)
    ids_bytes = got.column("experts").values.nbytes
    if codec is SegmentCompression.NONE:
        assert held < ids_bytes // 10  # the ids are views of the mapped file
    else:
        assert held >= ids_bytes  # decompressed on open


def test_the_setting_names_the_codec(monkeypatch):
    assert ServiceSettings().segment_compression is SegmentCompression.NONE
    monkeypatch.setenv("REPLAY_SEGMENT_COMPRESSION", "zstd")
    assert ServiceSettings().segment_compression is SegmentCompression.ZSTD
    monkeypatch.setenv("REPLAY_SEGMENT_COMPRESSION", "gzip")
    with pytest.raises(ValueError):
        ServiceSettings()


def test_the_segment_cache_bounds_what_it_holds_decompressed(tmp_path):
    batch = _segment(SHAPES["uint8 top-8 x48"], 500)
    for codec in (SegmentCompression.NONE, SegmentCompression.ZSTD):
        for i in range(3):
            write_segment(tmp_path / f"{codec}-{i}.arrow", batch, BufferPool(keep=1), fsync=False, compression=codec)
    held = heap_bytes(open_segment(tmp_path, "zstd-0.arrow"))
    assert held >= batch.column("experts").values.nbytes and heap_bytes(open_segment(tmp_path, "none-0.arrow")) == 0
    cache = SegmentCache(tmp_path, capacity=10, max_heap_bytes=2 * held)
    first = {name: cache.get(name) for name in ["none-0.arrow", "none-1.arrow", "none-2.arrow", "zstd-0.arrow",
                                                 "zstd-1.arrow"]}
    assert all(cache.get(name) is got for name, got in first.items())  # all kept: two decompressed fit
    cache.get("zstd-2.arrow")  # a third does not: the least recently used decompressed one goes
    assert cache.get("zstd-0.arrow") is not first["zstd-0.arrow"]  # opened (and checked) again
    assert all(cache.get(f"none-{i}.arrow") is first[f"none-{i}.arrow"] for i in range(3))  # maps cost nothing
