"""Ranged reads from a bucket (segment 2.4, "Blocks"): a route read fetches only the blocks of its rows, each checked.

A real S3 HTTP endpoint (moto server) underneath the store; the bytes a read fetched are counted at the store
(`S3Segments.bytes_fetched`, every ranged GET's body). A large segment (15 blocks) is written by the service's
own object writer (`object_image`): reading one request's rows fetches about one block and the footer, far less
than the object, and returns exactly what a whole-object read returns. A byte flipped in the bucket object inside
a requested block is refused (DamagedSegment naming the segment and the rows), never served, while rows in
other blocks still are. Segments without block checksums (before 2.4, or compressed) are read whole, as before;
one written by 2.4 (its buffer offsets under the key `layout`, before 2.5's `buffer_offsets`) range-reads as a new one.
Through a real service on the bucket: routes read byte-equal, a damaged block answers 503 naming the segment.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from replay_client.client import ReplayClient
from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows
from replay_format.segment import (
    BLOCK_ROWS,
    BUFFER_OFFSETS_KEY,
    CHECKSUM_KEY,
    LEGACY_OFFSETS_KEY,
    SegmentCompression,
    SegmentMeta,
)
from replay_service.errors import DamagedSegment
from replay_service.store.segments.cache import SegmentCache
from replay_service.store.segments.integrity import open_segment, seal
from replay_service.store.segments.places import S3Segments
from replay_service.store.segments.ranges import SERVED, TAIL_BYTES, buffer_offsets, ranged_metadata
from replay_service.store.segments.write import object_image, segment_image
from tests.support.data import batch_bytes, routes
from tests.support.s3 import MotoS3
from tests.support.service import ServiceProcess

SHAPE = RunShape(8, 8, 128)  # 64 one-byte ids per row
REQUESTS, LENGTH = 100, 600  # 60,000 rows: 15 blocks of 4096
ROW_BYTES = 4 + 4 + SHAPE.row_width + 2  # position, token id, ids, flags (the token ids' validity: 1/8 more)


@pytest.fixture(scope="module")
def s3():
    server = MotoS3().start()
    yield server
    server.stop()


def _batch(format_version: str | None = None):
    """A large unsealed segment batch: REQUESTS requests of LENGTH rows, some token ids unknown, some rows flagged."""
    rng = np.random.default_rng(15)
    n = REQUESTS * LENGTH
    ids = rng.integers(0, SHAPE.num_experts, (n, SHAPE.row_width), dtype=np.uint8)
    tokens = rng.integers(0, 150_000, n).astype(np.int32)
    tokens[::7] = -1
    flags = np.zeros(n, np.uint16)
    flags[::97] = 8
    md = SegmentMeta(RowsMeta("ranges", "w", 0, SHAPE), "d" * 32, 1).to_metadata()
    if format_version is not None:
        md["format_version"] = format_version
    requests = ([f"req-{i}" for i in range(REQUESTS)], np.repeat(np.arange(REQUESTS, dtype=np.int32), LENGTH))
    positions = np.tile(np.arange(LENGTH, dtype=np.int32), REQUESTS)
    return build_rows(SHAPE, requests, positions, ids, tokens, flags, md)


@pytest.fixture(scope="module")
def bucket(s3):
    """A bucket holding the large segment, written as the service writes one (uncompressed): (fs, base, rel, image)."""
    name = s3.bucket()
    image = object_image(_batch())
    rel = "ranges/large.arrow"
    S3Segments(s3.fs(), f"{name}/segments", "").put(rel, image)
    return s3.fs(), f"{name}/segments", rel, image


def _store(fs, base: str) -> S3Segments:
    """A fresh store on the bucket (nothing fetched or kept yet)."""
    return S3Segments(fs, base, f"s3://{base}")


def _assert_same_rows(got, whole, lo: int, hi: int) -> None:
    expected = whole.slice(lo, hi - lo)
    assert got.num_rows == hi - lo
    for name in SERVED:
        assert got.column(name).equals(expected.column(name)), name
    assert (got.column("experts").flatten().to_numpy().tobytes()
            == expected.column("experts").flatten().to_numpy().tobytes())


@pytest.mark.parametrize(("lo", "hi", "blocks"), [
    (30_000, 30_600, 1),  # one request, inside block 7
    (2 * BLOCK_ROWS - 100, 2 * BLOCK_ROWS + 500, 2),  # a request across a block boundary
    (0, 1, 1),  # the first row
    (REQUESTS * LENGTH - 5, REQUESTS * LENGTH, 1),  # the last, short block
])
def test_a_read_fetches_only_the_blocks_of_its_rows(bucket, lo, hi, blocks):
    fs, base, rel, image = bucket
    store = _store(fs, base)
    got = store.read_rows(rel, lo, hi)
    assert got is not None
    fetched = store.bytes_fetched
    assert fetched <= TAIL_BYTES + blocks * BLOCK_ROWS * (ROW_BYTES + 1)  # the footer, and only the covering blocks
    assert fetched < image.size / 6  # far less than the object (4.7 MB)
    again = store.read_rows(rel, lo, hi)  # the checked blocks are kept: nothing travels again
    assert store.bytes_fetched == fetched
    other = _store(fs, base)  # another replica: its first read of the segment fetches the footer too
    other.read_rows(rel, 0, 1)
    if lo >= BLOCK_ROWS:
        before = other.bytes_fetched
        other.read_rows(rel, lo, hi)  # the buffer offsets are kept: only the blocks travel
        assert other.bytes_fetched - before <= blocks * BLOCK_ROWS * (ROW_BYTES + 1)
    whole = open_segment(store, rel)  # the whole-object read, its CRC32C checked
    _assert_same_rows(got, whole, lo, hi)
    _assert_same_rows(again, whole, lo, hi)


def test_the_buffer_offsets_are_the_objects_own(bucket):
    """The offsets the writer found by reading its image back are those of the object in the bucket."""
    fs, base, rel, image = bucket
    with fs.open_input_stream(f"{base}/{rel}") as source:
        stored = source.read()
    assert stored == image.to_pybytes()
    batch = open_segment(_store(fs, base), rel)
    assert batch.num_rows == REQUESTS * LENGTH
    offsets = buffer_offsets(image)
    assert offsets["rows"] == batch.num_rows and offsets["token_id_validity"] is not None  # some tokens unknown


@pytest.mark.parametrize("column", ["experts", "position", "token_id", "token_id_validity", "flags"])
def test_a_flipped_byte_in_a_requested_block_is_never_served(s3, bucket, column):
    fs, base, rel, image = bucket
    offset = buffer_offsets(image)[column]
    assert offset is not None
    block, row = 7, 7 * BLOCK_ROWS + 1000  # a row of request 49 (rows 29,400..29,999)
    per_row = {"experts": SHAPE.row_width, "position": 4, "token_id": 4, "flags": 2}
    at = offset + (row // 8 if column == "token_id_validity" else row * per_row[column])
    if column == "token_id":
        at = offset + (row - row % 7 + 1) * 4  # a known token id (every 7th is null: its bytes are not content)
    damaged = bytearray(image.to_pybytes())
    damaged[at] ^= 0x5A
    victim = f"{base}/ranges/damaged-{column}.arrow"
    with fs.open_output_stream(victim) as out:
        out.write(bytes(damaged))
    store = _store(fs, base)
    rel = f"ranges/damaged-{column}.arrow"
    with pytest.raises(DamagedSegment) as refused:
        store.read_rows(rel, 29_400, 30_000)
    first = block * BLOCK_ROWS
    assert refused.value.path == rel and refused.value.newly_found
    assert f"s3://{base}/{rel}" in refused.value.message
    assert f"rows {first}..{first + BLOCK_ROWS - 1}" in refused.value.message
    with pytest.raises(DamagedSegment) as again:  # refused on every read, counted once
        store.read_rows(rel, 29_400, 30_000)
    assert not again.value.newly_found
    whole = _store(fs, base).open_batch("ranges/large.arrow")
    other = store.read_rows(rel, 3_000, 3_600)  # rows in block 0: not damaged, still served
    assert other is not None
    _assert_same_rows(other, whole, 3_000, 3_600)
    with pytest.raises(DamagedSegment):  # and the whole-object check (verify, a whole read) finds it too
        open_segment(store, rel)


def test_wide_ids_and_every_token_known(s3):
    """uint16 ids (more than 256 experts) and a token column without a validity bitmap read the same way."""
    shape = RunShape(4, 6, 512)
    n = 3 * BLOCK_ROWS + 11
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 512, (n, shape.row_width)).astype(np.uint16)
    md = SegmentMeta(RowsMeta("wide", "w", 0, shape), "d" * 32, 1).to_metadata()
    batch = build_rows(shape, ["only"] * n, np.arange(n, dtype=np.int32), ids, np.arange(n, dtype=np.int32),
                       None, md)
    image = object_image(batch)
    assert buffer_offsets(image)["token_id_validity"] is None
    base = f"{s3.bucket()}/segments"
    store = _store(s3.fs(), base)
    store.put("wide/w.arrow", image)
    got = store.read_rows("wide/w.arrow", BLOCK_ROWS - 3, n)
    assert got is not None
    _assert_same_rows(got, open_segment(store, "wide/w.arrow"), BLOCK_ROWS - 3, n)
    assert got.column("experts").flatten().to_numpy().tobytes() == ids[BLOCK_ROWS - 3:].tobytes()


@pytest.mark.parametrize("kind", ["2.3 segment", "zstd segment"])
def test_segments_without_block_checksums_are_read_whole(s3, kind):
    """A segment written before 2.4, or a compressed one, has no block checksums: fetched whole and checked whole."""
    fs, base = s3.fs(), f"{s3.bucket()}/segments"
    if kind == "2.3 segment":
        sealed = seal(_batch(format_version="2.3"))
        image = segment_image(sealed)
    else:
        image = object_image(_batch(), SegmentCompression.ZSTD)
        sealed = None
    rel = "ranges/old.arrow"
    store = _store(fs, base)
    store.put(rel, image)
    assert store.read_rows(rel, 30_000, 30_600) is None  # no ranged read: the reader opens it whole
    footer = store.bytes_fetched
    assert footer <= TAIL_BYTES
    cache = SegmentCache(store, capacity=4)
    whole = cache.get(rel).slice(30_000, 600)
    assert store.bytes_fetched - footer == image.size  # the whole object, once
    assert store.read_rows(rel, 0, 10) is None and store.bytes_fetched - footer == image.size  # known: not re-read
    expected = _batch()
    _assert_same_rows(whole, expected, 30_000, 30_600)
    if sealed is not None:
        assert open_segment(store, rel).equals(sealed)


def _image_as_2_4_wrote_it(batch: pa.RecordBatch) -> pa.Buffer:
    """An uncompressed object image as a 2.4 service wrote it: the buffer offsets under `layout`, format_version 2.4.

    The 2.4 writer's steps (`object_image` then): block checksums and an offsets placeholder, a first image, the
    offsets found in it and padded to the placeholder's width, sealed, a second image whose offsets are the same.
    """
    md = {**ranged_metadata(batch), "format_version": "2.4"}
    md = {LEGACY_OFFSETS_KEY if k == BUFFER_OFFSETS_KEY else k: v for k, v in md.items()}
    first = segment_image(batch.replace_schema_metadata({**md, CHECKSUM_KEY: "0" * 8}))
    md[LEGACY_OFFSETS_KEY] = json.dumps(buffer_offsets(first), separators=(",", ":")).ljust(len(md[LEGACY_OFFSETS_KEY]))
    image = segment_image(seal(batch.replace_schema_metadata(md)))
    assert json.loads(md[LEGACY_OFFSETS_KEY]) == buffer_offsets(image)
    return image


def test_a_segment_written_with_the_old_offsets_key_still_range_reads(s3):
    """A 2.4 segment (offsets under `layout`) is read by its blocks, as a 2.5 one (`buffer_offsets`) is, and new
    segments are written under `buffer_offsets` only."""
    fs, base = s3.fs(), f"{s3.bucket()}/segments"
    store = _store(fs, base)
    old = _image_as_2_4_wrote_it(_batch())
    store.put("ranges/written-by-2.4.arrow", old)
    new_md = pa.ipc.open_file(pa.BufferReader(object_image(_batch()))).schema.metadata
    assert BUFFER_OFFSETS_KEY.encode() in new_md and LEGACY_OFFSETS_KEY.encode() not in new_md
    got = store.read_rows("ranges/written-by-2.4.arrow", 30_000, 30_600)
    assert got is not None  # a ranged read, not a whole-object one
    assert store.bytes_fetched <= TAIL_BYTES + BLOCK_ROWS * (ROW_BYTES + 1)
    _assert_same_rows(got, open_segment(store, "ranges/written-by-2.4.arrow"), 30_000, 30_600)


def _body(n_requests: int, length: int, seq: int = 0) -> tuple[bytes, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seq)
    full = {f"req-{i}": routes(rng, length, SHAPE) for i in range(n_requests)}
    ids = [rid for rid in full for _ in range(length)]
    positions = np.tile(np.arange(length), n_requests)
    experts = np.concatenate(list(full.values()))
    return bytes(batch_bytes("svc", "w", seq, ids, positions, experts, shape=SHAPE)), full


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_service_on_the_bucket_serves_ranges_and_refuses_a_damaged_block(s3, tmp_path, compression):
    """Three requests of 9,000 rows in one segment (7 blocks): every route reads back byte-equal. Uncompressed, a
    byte flipped in the middle request's own block: a replica that had not read it yet answers 503 naming the
    segment, and still serves the other two requests (other blocks)."""
    name = s3.bucket()
    body, full = _body(3, 9_000)
    env = {**s3.env(name), "REPLAY_SEGMENT_COMPRESSION": compression}
    data = tmp_path / "data"
    with ServiceProcess(data, env=env) as service:
        client = ReplayClient(service.url)
        assert client.ingest(body).stored
        for rid in full:
            client.finish("svc", rid, 9_001)
        for rid, expected in full.items():
            route = client.get_route("svc", rid, strict=True)
            assert route.experts.tobytes() == expected.tobytes()
            part = client.get_route("svc", rid, start=4_000, end=4_100)
            assert part.experts.tobytes() == expected[4_000:4_100].tobytes()
    if compression != "none":
        return
    fs = s3.fs()
    (obj,) = _store(fs, f"{name}/segments").objects()
    key = f"{name}/segments/{obj.path}"
    with fs.open_input_stream(key) as source:
        image = bytearray(source.read())
    at = buffer_offsets(pa.py_buffer(bytes(image)))["experts"]
    assert at is not None
    image[at + (3 * BLOCK_ROWS + 5) * SHAPE.row_width] ^= 0xFF  # row 12,293: req-1 (rows 9,000..17,999) only
    with fs.open_output_stream(key) as out:
        out.write(bytes(image))
    with ServiceProcess(data, env=env) as service:  # restarted: nothing of the segment read or kept yet
        client = ReplayClient(service.url)
        refused = client.http.get("/v1/runs/svc/requests/req-1/routes", params={"start": 3_000, "end": 3_500})
        assert refused.status_code == 503, refused.text
        assert refused.json()["segment"] == obj.path and obj.path in refused.json()["detail"]
        for rid in ("req-0", "req-2"):  # rows in blocks 0-2 and 4-6: served, unchanged
            assert client.get_route("svc", rid, strict=True).experts.tobytes() == full[rid].tobytes()
