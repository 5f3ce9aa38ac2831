"""Segments by layer (segment.md, "Ids by layer", 3.0; `REPLAY_SEGMENT_ID_LAYOUT`).

A compressed segment keeps its ids in a column per MoE layer, so the codec sees each layer's skew: fewer bytes
per id on skewed routes, the same content. What is shown: the file is a plain Arrow file of one column per
layer and says 3.0 (a 2.x reader refuses it), the service's reader joins the layers back into the `experts` every
reader takes, the checksum still covers the content (a flipped byte, a missing layer or an unknown layout is a
damaged segment), uncompressed segments stay rows (zero-copy maps, ranged bucket reads), and one run written in
both layouts, locally and in a bucket, reads back byte-equal on every path, verifies and reindexes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from replay_client.client import ReplayClient
from replay_format import FormatError, RunShape
from replay_format.core import FormatVersion, decode_metadata
from replay_format.rows import RowsMeta, build_rows
from replay_format.segment import (
    ID_LAYOUT_KEY,
    IdLayout,
    SegmentCompression,
    SegmentMeta,
    as_stored,
    by_layers,
    by_rows,
    layer_column,
)
from replay_service.buffers import BufferPool
from replay_service.errors import DamagedSegment
from replay_service.store.segments.cache import SegmentCache
from replay_service.store.segments.integrity import open_segment, seal
from replay_service.store.segments.places import S3Segments
from replay_service.store.segments.write import object_image, write_segment
from tests.support.data import skewed_routes
from tests.support.service import ServiceProcess
from tests.test_service_compression import SHAPE, check_reads, reindex_from_segments, run_cli, store_sent

ROWS = 2000


def _sealed(ids: np.ndarray, layout: IdLayout) -> pa.RecordBatch:
    """A sealed segment batch of `ids` (requests of 500 rows) whose metadata names `layout`."""
    n = len(ids)
    requests = np.arange(n, dtype=np.int32) // 500
    meta = SegmentMeta(RowsMeta("layers", "w", 0, SHAPE), "0" * 64, time.time_ns(), id_layout=layout)
    return seal(build_rows(SHAPE, ([f"r{i}" for i in range(int(requests.max()) + 1)], requests),
                           np.arange(n, dtype=np.int32) % 500, ids.reshape(n, -1),
                           token_ids=np.arange(n, dtype=np.int32) + 3, metadata=meta.to_metadata()))


def _write(folder: Path, name: str, ids: np.ndarray, layout: IdLayout,
           compression: SegmentCompression = SegmentCompression.ZSTD) -> Path:
    path = folder / name
    write_segment(path, as_stored(_sealed(ids, layout)), BufferPool(keep=1), fsync=False, compression=compression)
    return path


def _raw(path: Path) -> pa.RecordBatch:
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return skewed_routes(np.random.default_rng(31), ROWS, SHAPE)


def test_a_segment_by_layer_is_a_column_per_layer_and_reads_back_as_rows(tmp_path, ids):
    path = _write(tmp_path, "layers.arrow", ids, IdLayout.LAYERS)
    raw = _raw(path)
    layers = [layer_column(layer) for layer in range(SHAPE.num_moe_layers)]
    assert raw.schema.names == ["request_id", "position", "token_id", *layers, "flags"]
    for layer, name in enumerate(layers):
        assert raw.column(name).type == pa.list_(pa.uint8(), SHAPE.top_k)
        assert raw.column(name).flatten().to_numpy().tobytes() == ids[:, layer].tobytes()
    md = decode_metadata(raw.schema.metadata, "segment")
    assert (md["format_version"], md[ID_LAYOUT_KEY]) == ("3.0", "layers")
    assert SegmentMeta.from_metadata(md).id_layout is IdLayout.LAYERS
    with pytest.raises(FormatError, match="newer than this reader knows"):  # what a 2.x reader says of it
        FormatVersion.parse(md["format_version"], "segment").check("segment", FormatVersion(2, 6))

    got = open_segment(tmp_path, "layers.arrow")  # joined back, then checked against the content's CRC32C
    rows = open_segment(tmp_path, _write(tmp_path, "rows.arrow", ids, IdLayout.ROWS).name)
    assert got.schema.names == rows.schema.names
    assert got.column("experts").flatten().to_numpy().tobytes() == ids.tobytes()
    for name in ("request_id", "position", "token_id", "experts", "flags"):
        assert got.column(name).equals(rows.column(name)), name
    rows_md = decode_metadata(_raw(tmp_path / "rows.arrow").schema.metadata, "segment")
    assert rows_md["format_version"] == "2.6" and ID_LAYOUT_KEY not in rows_md  # what 2.x readers read


@pytest.mark.parametrize("shape", [RunShape(3, 6, 512), RunShape(5, 1, 16), RunShape(4, 3, 300), RunShape(2, 2, 8)])
def test_layers_split_and_join_back_for_every_id_width(shape):
    """uint16 ids, row-layers of 12, 1, 6 and 2 bytes (the word a layer's row is moved as differs): lossless."""
    n = 37 if shape.top_k > 1 else 0  # and a segment of no rows
    ids = np.random.default_rng(33).integers(0, shape.num_experts, (n, shape.row_width)).astype(shape.dtype)
    rows = build_rows(shape, ([f"r{i}" for i in range(n)], np.arange(n, dtype=np.int32)),
                      np.zeros(n, np.int32), ids)
    split = by_layers(rows, shape.num_moe_layers)
    for layer in range(shape.num_moe_layers):
        got = split.column(layer_column(layer)).flatten().to_numpy()
        assert got.tobytes() == ids.reshape(n, shape.num_moe_layers, shape.top_k)[:, layer].tobytes()
    md = {**(split.schema.metadata or {}), ID_LAYOUT_KEY.encode(): b"layers"}
    assert by_rows(split.replace_schema_metadata(md)).column("experts").equals(rows.column("experts"))


def test_by_layer_stores_fewer_bytes_on_skewed_routes_and_only_under_a_codec(tmp_path, ids):
    size = {(layout, codec): _write(tmp_path, f"{layout}-{codec}.arrow", ids, layout, codec).stat().st_size
            for layout in IdLayout for codec in (SegmentCompression.ZSTD, SegmentCompression.NONE)}
    zstd = {layout: size[layout, SegmentCompression.ZSTD] for layout in IdLayout}
    assert zstd[IdLayout.LAYERS] < 0.95 * zstd[IdLayout.ROWS] < size[IdLayout.ROWS, SegmentCompression.NONE]
    assert IdLayout.LAYERS.for_codec(SegmentCompression.NONE) is IdLayout.ROWS  # what the writer stores then
    assert IdLayout.LAYERS.for_codec(SegmentCompression.LZ4) is IdLayout.ROWS  # lz4 gains nothing by layer
    assert IdLayout.LAYERS.for_codec(SegmentCompression.ZSTD) is IdLayout.LAYERS


def _rewrite(path: Path, batch: pa.RecordBatch) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


def test_a_damaged_segment_by_layer_is_never_served(tmp_path, ids):
    stored = as_stored(_sealed(ids, IdLayout.LAYERS))
    at = stored.schema.get_field_index(layer_column(5))
    flipped = stored.column(at).flatten().to_numpy().copy()
    flipped[77] ^= 1
    column = pa.FixedSizeListArray.from_arrays(pa.array(flipped), SHAPE.top_k)
    _rewrite(tmp_path / "flipped.arrow", stored.set_column(at, stored.schema.field(at), column))
    with pytest.raises(DamagedSegment, match="damaged"):
        open_segment(tmp_path, "flipped.arrow")

    _rewrite(tmp_path / "missing.arrow", stored.remove_column(at))
    with pytest.raises(DamagedSegment, match="without its columns"):
        open_segment(tmp_path, "missing.arrow")

    md = {**stored.schema.metadata, ID_LAYOUT_KEY.encode(): b"diagonal"}
    _rewrite(tmp_path / "unknown.arrow", stored.replace_schema_metadata(md))
    with pytest.raises(DamagedSegment, match="'diagonal' is not one of rows, layers"):
        open_segment(tmp_path, "unknown.arrow")


def test_a_bucket_segment_by_layer_is_fetched_whole_and_joined(moto_s3, ids):
    name = moto_s3.bucket()
    store = S3Segments(moto_s3.fs(), f"{name}/segments", f"s3://{name}/segments")
    sealed = _sealed(ids, IdLayout.LAYERS)
    unsealed = sealed.replace_schema_metadata({k: v for k, v in sealed.schema.metadata.items() if k != b"crc32c"})
    image = object_image(unsealed, SegmentCompression.ZSTD)
    assert layer_column(0) in pa.ipc.open_file(pa.BufferReader(image)).schema.names
    store.put("layers/one.arrow", image)
    assert store.read_rows("layers/one.arrow", 100, 200) is None  # no block checksums: opened whole
    got = SegmentCache(store, capacity=2).get("layers/one.arrow")
    assert got.column("experts").flatten().to_numpy().tobytes() == ids.tobytes()


def test_a_run_written_in_both_layouts_reads_back_equal_verifies_and_reindexes(tmp_path):
    data = tmp_path / "data"
    rng = np.random.default_rng(32)
    sent: dict[str, np.ndarray] = {}
    summaries = {}
    for layout in (IdLayout.ROWS, IdLayout.LAYERS):  # the second start is the default: by layer under zstd
        env = {"REPLAY_SEGMENT_COMPRESSION": "zstd", "REPLAY_FSYNC": "false"}
        if layout is IdLayout.ROWS:
            env["REPLAY_SEGMENT_ID_LAYOUT"] = "rows"
        with ServiceProcess(data, env=env) as service, ReplayClient(service.url) as client:
            mine = {f"{layout}-{i}": skewed_routes(rng, 700, SHAPE) for i in range(2)}
            store_sent(client, "both", f"writer-{layout}", mine)
            store_sent(client, f"only-{layout}", "w", mine)
            sent.update(mine)
            check_reads(client, "both", sent)
            summaries[layout] = client.run(f"only-{layout}")
    files = {layout: [_raw(p) for p in (data / "runs" / f"only-{layout}").glob("*.arrow")] for layout in IdLayout}
    assert all("experts" in batch.schema.names for batch in files[IdLayout.ROWS])
    assert all(layer_column(0) in batch.schema.names for batch in files[IdLayout.LAYERS])
    assert summaries[IdLayout.LAYERS].bytes_per_id < summaries[IdLayout.ROWS].bytes_per_id

    done = run_cli("verify", "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    reindex_from_segments(data)
    with ServiceProcess(data) as service, ReplayClient(service.url) as client:
        check_reads(client, "both", sent)
