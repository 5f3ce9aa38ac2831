"""The comparison formats (replay_format/compare.md): the compare body and the stored comparison file."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from replay_format import FormatError, RunShape
from replay_format.compare import (
    CompareFileMeta,
    RequestMismatch,
    ShapeMismatch,
    build_compare_body,
    encode_compare_file,
    read_compare_body,
    read_compare_file,
)
from tests.support.data import routes

SHAPE = RunShape(num_moe_layers=11, top_k=2, num_experts=16, moe_layers=tuple(range(1, 12)))


def _items(rng) -> list[RequestMismatch]:
    return [RequestMismatch("r0", np.array([0, 1, 5], np.int32), rng.random((3, 11)) < 0.5),
            RequestMismatch("r1", np.array([2], np.int32), np.ones((1, 11), np.bool_))]


def test_compare_body_round_trip_with_relaxed_metadata():
    rng = np.random.default_rng(0)
    experts = routes(rng, 5, SHAPE)
    body = build_compare_body(SHAPE, ["a"] * 5, np.arange(5), experts)  # no run_id: the URL names it
    rows = read_compare_body(body, "run-1", SHAPE)
    assert rows.meta.run_id == "run-1" and rows.meta.writer_id == "trainer" and rows.meta.seq == 0
    assert rows.experts.tobytes() == experts.tobytes() and rows.request_ids == ["a"]
    named = build_compare_body(SHAPE, ["a"], [0], experts[:1], run_id="run-2")
    with pytest.raises(FormatError, match="run_id='run-2'"):
        read_compare_body(named, "run-1", SHAPE)
    with pytest.raises(ShapeMismatch, match="4 layers"):
        read_compare_body(build_compare_body(RunShape(4, 2, 16), ["a"], [0], experts[:1, :4]), "run-1", SHAPE)
    with pytest.raises(FormatError, match=r"ids must be in 0\.\.15"):
        build_compare_body(SHAPE, ["a"], [0], experts[:1] + 16)


def test_stored_comparison_round_trip():
    items = _items(np.random.default_rng(1))
    meta = CompareFileMeta("run-1", "cmp-1", 11, ("r0", "r1"))
    data = encode_compare_file(meta, items)
    for item in items:
        got = read_compare_file(data, item.request_id, meta)
        assert np.array_equal(got.positions, item.positions) and np.array_equal(got.mismatch, item.mismatch)
    with pytest.raises(KeyError):
        read_compare_file(data, "r9", meta)
    with pytest.raises(FormatError, match="disagree"):
        read_compare_file(data, "r0", CompareFileMeta("run-1", "cmp-1", 12, ("r0", "r1")))


def test_a_file_written_before_the_format_had_a_version_is_read():
    """The bytes today's service wrote before compare.md: p<i> / m<i> only, the rest in the index."""
    items = _items(np.random.default_rng(2))
    buf = io.BytesIO()
    np.savez(buf, **{k: v for i, item in enumerate(items)
                     for k, v in ((f"p{i}", item.positions), (f"m{i}", np.packbits(item.mismatch, axis=1)))})
    index = CompareFileMeta("run-1", "cmp-old", 11, ("r0", "r1"))
    got = read_compare_file(buf.getvalue(), "r1", index)
    assert np.array_equal(got.positions, [2]) and got.mismatch.all() and got.mismatch.shape == (1, 11)


def test_a_newer_major_version_is_refused_by_name():
    meta = CompareFileMeta("run-1", "cmp-1", 11, ("r0", "r1"))
    items = _items(np.random.default_rng(3))
    with np.load(io.BytesIO(encode_compare_file(meta, items))) as data:
        arrays = {k: data[k] for k in data.files}
    doc = json.loads(str(arrays["meta"]))
    doc["format_version"] = "2.0"
    arrays["meta"] = np.array(json.dumps(doc))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with pytest.raises(FormatError, match=r"format_version 2\.0 is newer"):
        read_compare_file(buf.getvalue(), "r0", meta)
