"""The route answer format (replay_format/route.md): builder and reader agree, versions are checked."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay_format import NO_TOKEN, FormatError, LayerAxis, RunShape
from replay_format.route import RequestRoute, RouteMeta, encode_routes, read_routes
from tests.support.data import routes
from tests.support.formats import with_metadata

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=300, moe_layers=(3, 4, 5))  # uint16 ids


def _body(meta: RouteMeta, items: list[RequestRoute]) -> bytearray:
    return bytearray(b"".join(bytes(p) for chunk in encode_routes(meta, items) for p in chunk))


def _route(rid: str, start: int, n: int, tokens: np.ndarray, seed: int = 0) -> RequestRoute:
    flags = np.zeros(n, np.uint16)
    flags[n // 2 :] = 32  # GAP rows
    return RequestRoute(rid, np.arange(start, start + n, dtype=np.int32), tokens.astype(np.int32),
                        routes(np.random.default_rng(seed), n, SHAPE), flags)


def test_round_trip_keeps_every_field_and_views_the_body():
    tokens = np.array([5, NO_TOKEN, 7, NO_TOKEN], np.int32)
    items = [_route("a", 10, 4, tokens), _route("b", 10, 0, tokens[:0], seed=1),
             _route("c", 10, 3, np.array([1, 2, 3]), seed=2)]
    meta = RouteMeta("run-1", SHAPE, requests=3, start=10, end=None)
    body = _body(meta, items)
    got_meta, got = read_routes(body)
    assert got_meta == meta and got_meta.shape.moe_layers == (3, 4, 5)
    assert [r.request_id for r in got] == ["a", "b", "c"]
    for want, have in zip(items, got):
        assert have.experts.shape == (want.num_rows, 3, 2) and have.experts.dtype == np.uint16
        assert have.experts.tobytes() == want.experts.tobytes()
        assert np.array_equal(have.positions, want.positions) and np.array_equal(have.flags, want.flags)
        assert have.token_ids.dtype == np.int32 and np.array_equal(have.token_ids, want.token_ids)
    # zero-copy, writable views of the received body
    base = np.frombuffer(body, np.uint8).ctypes.data
    assert got[2].experts.flags.writeable and base <= got[2].experts.ctypes.data < base + len(body)
    assert got[2].token_ids.flags.writeable and base <= got[2].token_ids.ctypes.data < base + len(body)


def test_unknown_token_is_null_on_the_wire():
    meta = RouteMeta("run-1", SHAPE, start=0, end=4)
    body = _body(meta, [_route("a", 0, 4, np.array([5, NO_TOKEN, 7, NO_TOKEN]))])
    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    assert table.column("token_id").to_pylist() == [5, None, 7, None]
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert md["format"] == "routing-replay.route" and md["format_version"] == "1.2"
    assert md["num_moe_layers"] == "3" and md["moe_layers"] == "[3, 4, 5]" and md["end"] == "4"
    assert md["layer_axis"] == "moe" and md["num_hidden_layers"] == "6"


def test_weight_versions_on_the_wire_null_where_unknown():
    """One answer, one schema: a route of unknown versions (every row a null, the fast path) beside one that names
    its versions; each reads back as it was sent."""
    from replay_format.weight_versions import WeightVersions

    tokens = np.array([5, 6, 7, 8], np.int32)
    known = _route("b", 0, 4, tokens, seed=1)
    known.weight_versions = WeightVersions(("v1", "v2"), np.array([0, -1, 1, 1], np.int16))
    body = _body(RouteMeta("run-1", SHAPE, requests=2, start=0, end=4), [_route("a", 0, 4, tokens), known])
    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    assert table.column("weight_version").to_pylist() == [None] * 4 + ["v1", None, "v2", "v2"]
    _, (unknown, named) = read_routes(body)
    assert unknown.versions().all_unknown and unknown.versions().per_row() == [None] * 4
    assert named.versions().per_row() == ["v1", None, "v2", "v2"]


def test_a_newer_major_version_is_refused_by_name():
    body = _body(RouteMeta("run-1", SHAPE), [_route("a", 0, 2, np.array([1, 2]))])
    assert read_routes(with_metadata(body, {"format_version": "1.7"}))[0].run_id == "run-1"
    with pytest.raises(FormatError, match=r"format_version 2\.0 is newer"):
        read_routes(with_metadata(body, {"format_version": "2.0"}))
    with pytest.raises(FormatError, match="expected 'routing-replay.route'"):
        read_routes(with_metadata(body, {"format": "routing-replay.rows"}))


def test_an_answer_from_an_older_service_is_still_read():
    """Before route.md: no format keys, `num_layers`, the batch read without moe_layers."""
    body = _body(RouteMeta("run-1", SHAPE), [_route("a", 0, 2, np.array([1, 2]))])
    old = with_metadata(body, {"format": None, "format_version": None, "num_moe_layers": None, "num_layers": "3",
                                "moe_layers": None, "num_hidden_layers": None, "requests": None, "start": None})
    meta, got = read_routes(old)
    assert meta.shape == RunShape(3, 2, 300) and got[0].experts.shape == (2, 3, 2)


def test_the_model_axis_carries_every_model_layer_and_says_so():
    """layer_axis=model: (n, num_hidden_layers, K), dense layers zero; the reader takes the column's width from it."""
    shape = RunShape(num_moe_layers=3, top_k=2, num_experts=300, moe_layers=(3, 4, 5), num_hidden_layers=7)
    moe = _route("a", 4, 5, np.arange(5))
    wide = RequestRoute("a", moe.positions, moe.token_ids, shape.to_model_axis(moe.experts), moe.flags)
    meta = RouteMeta("run-1", shape, start=4, end=9, layer_axis=LayerAxis.MODEL)
    assert meta.layers == tuple(range(7)) and meta.column_shape.row_width == 14
    body = _body(meta, [wide])
    got_meta, (got,) = read_routes(body)
    assert got_meta.layer_axis == LayerAxis.MODEL and got_meta.shape == shape
    assert got.experts.shape == (5, 7, 2) and got.experts.dtype == np.uint16
    assert got.experts.tobytes() == wide.experts.tobytes()
    assert not got.experts[:, [0, 1, 2, 6]].any() and got.experts[:, 3:6].tobytes() == moe.experts.tobytes()
    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    assert table.schema.field("experts").type == pa.list_(pa.uint16(), 14)
    assert table.schema.metadata[b"layer_axis"] == b"model" and table.schema.metadata[b"num_hidden_layers"] == b"7"


def test_a_reader_that_ignores_layer_axis_cannot_misread_a_model_axis_answer():
    """A 1.0 reader does not know layer_axis; the experts width then disagrees with num_moe_layers * top_k: refused."""
    shape = RunShape(num_moe_layers=3, top_k=2, num_experts=300, moe_layers=(3, 4, 5), num_hidden_layers=6)
    moe = _route("a", 0, 2, np.array([1, 2]))
    wide = RequestRoute("a", moe.positions, moe.token_ids, shape.to_model_axis(moe.experts), moe.flags)
    body = _body(RouteMeta("run-1", shape, layer_axis="model"), [wide])
    with pytest.raises(FormatError, match="expected 6 ids per row"):
        read_routes(with_metadata(body, {"layer_axis": None, "format_version": "1.0"}))
    with pytest.raises(FormatError, match="layer_axis='sideways' is not one of moe, model"):
        read_routes(with_metadata(body, {"layer_axis": "sideways"}))
