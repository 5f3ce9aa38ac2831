"""The trainer-slice format (replay_format/trainer_slice.md): builder and reader agree, versions are checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from replay_format import FormatError, FormatVersion, LayerAxis, UndecodableError
from replay_format.trainer_slice import (
    Convention,
    CpSplit,
    LayoutKind,
    MissingPolicy,
    Packing,
    SliceLayout,
    SliceMeta,
    TotalPad,
    build_slice,
    read_slice,
)
from tests.support.formats import with_metadata

M = 6
THD = SliceLayout(LayoutKind.MEGATRON, tokens=M, total_tokens=12, seq_length=12, sequences=2, cu_seqlens=[0, 5, 11],
                  cu_seqlens_padded=[0, 6, 12], packing=Packing.THD, cp_size=2, cp_rank=1)
VERL = SliceLayout(LayoutKind.VERL, tokens=M, total_tokens=M, seq_length=3, sequences=2, prompt_width=2,
                   response_width=1, prompt_lengths=[1, 2])


def _arrays(meta: SliceMeta, seed: int = 0):
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, meta.num_experts, (M, meta.row_width)).astype(meta.dtype)
    valid = np.array([1, 1, 0, 1, 0, 0], np.uint8)
    sequence = np.array([0, 0, 0, 1, 1, -1], np.int32)
    position = np.array([3, 4, 5, 0, 1, -1], np.int32)
    return experts, valid, sequence, position


def _body(meta: SliceMeta, arrays) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in build_slice(meta, *arrays)))


@pytest.mark.parametrize("layout,num_experts", [(THD, 128), (VERL, 300)])
def test_round_trip_keeps_every_field_and_views_the_body(layout, num_experts):
    meta = SliceMeta(top_k=2, num_experts=num_experts, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=layout)
    arrays = _arrays(meta)
    body = _body(meta, arrays)
    got = read_slice(body)
    assert got.meta == meta and got.layout == layout and got.meta.num_moe_layers == 2
    assert got.moe_ordinals == [1, 2] and got.moe_layers == [5, 7] and got.num_experts == num_experts
    assert got.experts.shape == (M, 2, 2) and got.experts.dtype == meta.dtype
    assert got.experts.tobytes() == arrays[0].tobytes()
    for have, want in zip((got.valid, got.sequence, got.position), arrays[1:]):
        assert have.dtype == want.dtype and np.array_equal(have, want)
    # every array is a writable view of the received body: no copy on the trainer either
    base = np.frombuffer(body, np.uint8).ctypes.data
    for array in (got.experts, got.valid, got.sequence, got.position, got.fallback):
        assert array.flags.writeable and base <= array.ctypes.data < base + len(body)


def test_the_builder_hands_the_arrays_own_buffers_to_the_writer():
    meta = SliceMeta(top_k=8, num_experts=128, moe_ordinals=list(range(48)), moe_layers=list(range(48)), layout=THD)
    experts, *rest = _arrays(meta)
    parts = build_slice(meta, experts, *rest)
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), experts) for p in parts)


def test_metadata_keys_and_packing_spelled_as_in_the_spec():
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[0, 3], moe_layers=[3, 9], layout=THD)
    md = meta.to_metadata()
    assert md["format"] == "routing-replay.trainer-slice" and md["format_version"] == "1.2"
    assert md["num_moe_layers"] == "2" and json.loads(md["moe_ordinals"]) == [0, 3]
    assert json.loads(md["moe_layers"]) == [3, 9]
    layout = json.loads(md["layout"])
    assert layout["kind"] == "megatron" and layout["packing"] == "thd" and "prompt_width" not in layout
    verl = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[0], moe_layers=[0], layout=VERL).to_metadata()
    assert "packing" not in json.loads(verl["layout"]) and json.loads(verl["layout"])["prompt_lengths"] == [1, 2]
    assert Packing("bshd") is Packing.BSHD and json.dumps(Packing.THD) == '"thd"'


@pytest.mark.parametrize("patch,words", [
    ({"format_version": "2.0"}, "newer than this reader"),
    ({"format_version": None}, "lacks format_version"),
    ({"format": "routing-replay.route"}, "expected 'routing-replay.trainer-slice'"),
    ({"num_moe_layers": "3"}, "moe_ordinals lists 2"),
    ({"moe_ordinals": "[1, x]"}, "moe_ordinals"),
    ({"layout": json.dumps({"kind": "megatron", "tokens": M})}, "lacks"),
    ({"layout": json.dumps({**THD.to_dict(), "packing": "sbhd"})}, "packing"),
    ({"layout": json.dumps({**THD.to_dict(), "tokens": M + 1})}, "layout says 7 tokens"),
    ({"layout": json.dumps({**THD.to_dict(), "kind": "deepspeed"})}, "kind 'deepspeed'"),
])
def test_reader_names_what_breaks_the_spec(patch, words):
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD)
    body = with_metadata(_body(meta, _arrays(meta)), patch)
    with pytest.raises(FormatError, match=words.replace("[", r"\[")):
        read_slice(body)
    assert read_slice(with_metadata(_body(meta, _arrays(meta)), {"format_version": "1.7"})).meta.version.minor == 7


def test_reader_refuses_a_body_that_is_not_arrow_and_ids_of_the_wrong_width():
    with pytest.raises(UndecodableError):
        read_slice(bytearray(b"not arrow at all"))
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD)
    body = with_metadata(_body(meta, _arrays(meta)), {"num_experts": "300"})  # uint16 expected, uint8 sent
    with pytest.raises(FormatError, match="300 experts means uint16"):
        read_slice(body)
    with pytest.raises(FormatError, match="contiguous rows"):
        build_slice(meta, *_arrays(SliceMeta(top_k=2, num_experts=300, moe_ordinals=[1, 2], moe_layers=[5, 7],
                                             layout=THD)))


# ---- 1.1: the model-layer axis, the missing-row policy, the fallback column, the packing fields -----------


def _without_column(body: bytearray, name: str) -> bytearray:
    """The stream with one column dropped (a 1.0 writer did not have it)."""
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    table = table.drop_columns([name])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytearray(sink.getvalue().to_pybytes())


MODEL_THD = SliceLayout(LayoutKind.MEGATRON, tokens=M, total_tokens=256, seq_length=256, sequences=2,
                        cu_seqlens=[0, 5, 11], cu_seqlens_padded=[0, 5, 11], packing=Packing.THD, cp_size=2,
                        cp_rank=1, tp_size=2, tp_rank=0, cp_split=CpSplit.CONTIGUOUS, pad_multiple=1,
                        total_multiple=512, total_pad=TotalPad.TAIL, convention=Convention.SLIME)


def test_a_model_axis_slice_holds_dense_layers_and_says_which_policy_built_it():
    meta = SliceMeta(top_k=2, num_experts=16, moe_ordinals=[0, 1], moe_layers=[3, 5], layout=MODEL_THD,
                     layer_axis=LayerAxis.MODEL, layers=[2, 3, 4, 5], num_hidden_layers=8,
                     missing=MissingPolicy.ROUTER)
    assert meta.num_layers == 4 and meta.row_width == 8 and meta.moe_positions == [1, 3]
    experts, valid, sequence, position = _arrays(meta)
    fallback = np.array([0, 0, 1, 0, 0, 0], np.uint8)
    got = read_slice(_body_with(meta, (experts, valid, sequence, position), fallback))
    assert got.meta == meta and got.layer_axis is LayerAxis.MODEL and got.layers == [2, 3, 4, 5]
    assert got.missing is MissingPolicy.ROUTER and got.experts.shape == (M, 4, 2)
    assert np.array_equal(got.fallback, fallback) and got.experts.tobytes() == experts.tobytes()
    md = meta.to_metadata()
    assert md["layer_axis"] == "model" and json.loads(md["layers"]) == [2, 3, 4, 5]
    assert md["num_hidden_layers"] == "8" and md["missing"] == "router"
    layout = json.loads(md["layout"])
    assert (layout["cp_split"], layout["total_pad"], layout["convention"]) == ("contiguous", "tail", "slime")
    assert layout["total_multiple"] == 512 and layout["sequence_parallel"] is True


def _body_with(meta, arrays, fallback) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in build_slice(meta, *arrays, fallback)))


def test_a_1_0_slice_still_reads_as_the_moe_axis_filler_without_fallback():
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD)
    body = _body(meta, _arrays(meta))
    old_layout = {k: v for k, v in THD.to_dict().items()
                  if k not in {"sequence_parallel", "cp_split", "pad_multiple", "total_multiple", "total_pad",
                               "convention"}}
    old = with_metadata(_without_column(body, "fallback"),
                        {"format_version": "1.0", "layer_axis": None, "layers": None, "num_hidden_layers": None,
                         "missing": None, "layout": json.dumps(old_layout)})
    got = read_slice(old)
    assert got.meta.version == FormatVersion(1, 0) and got.layer_axis is LayerAxis.MOE and got.layers == [5, 7]
    assert got.missing is MissingPolicy.FILLER and not got.fallback.any() and got.fallback.shape == (M,)
    assert got.layout.cp_split is CpSplit.ZIGZAG and got.layout.total_pad is TotalPad.LAST_SEQUENCE
    assert got.layout.total_multiple == 1 and got.layout.sequence_parallel and got.layout.convention is None


@pytest.mark.parametrize("patch,words", [
    ({"missing": "maybe"}, "missing='maybe' is not one of strict, router, filler"),
    ({"layer_axis": "dense"}, "layer_axis='dense' is not one of moe, model"),
    ({"layers": "[2, 3]"}, "on the moe axis the layers held are the MoE layers"),
    ({"layer_axis": "model", "layers": "[2, 3]"}, "are not among the layers held"),
    ({"layer_axis": "model", "layers": "[5, 7]", "num_hidden_layers": "6"}, "below num_hidden_layers=6"),
    ({"layout": json.dumps({**THD.to_dict(), "total_pad": "middle"})}, "total_pad"),
    ({"layout": json.dumps({**THD.to_dict(), "sequence_parallel": 1})}, "sequence_parallel"),
])
def test_reader_names_a_bad_1_1_key(patch, words):
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD)
    with pytest.raises(FormatError, match=words.replace("[", r"\[")):
        read_slice(with_metadata(_body(meta, _arrays(meta)), patch))


def test_enums_are_spelled_as_in_the_spec():
    assert [p.value for p in MissingPolicy] == ["strict", "router", "filler"]
    assert [c.value for c in CpSplit] == ["zigzag", "contiguous"]
    assert [t.value for t in TotalPad] == ["last_sequence", "tail"]
    assert [c.value for c in Convention] == ["verl", "slime", "miles"]


# ---- 1.2: each token's weight version ------------------------------------------------------------------


def test_each_token_carries_the_version_of_its_row_and_filler_none():
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD,
                     weight_versions=["step-7", "step-8"])
    experts, valid, sequence, position = _arrays(meta)
    version = np.array([0, 1, -1, 1, -1, -1], np.int16)
    body = bytearray(b"".join(bytes(p) for p in build_slice(meta, experts, valid, sequence, position, None, version)))
    got = read_slice(body)
    assert got.meta == meta and got.weight_versions == ["step-7", "step-8"]
    assert got.versions() == ["step-7", "step-8", None, "step-8", None, None]
    assert np.array_equal(got.weight_version, version) and got.weight_version.dtype == np.int16
    base = np.frombuffer(body, np.uint8).ctypes.data
    assert base <= got.weight_version.ctypes.data < base + len(body)  # a view, as the other columns
    assert json.loads(meta.to_metadata()["weight_versions"]) == ["step-7", "step-8"]
    # a 1.1 slice (no column, no key) reads as every version unknown
    old = with_metadata(_without_column(body, "weight_version"), {"format_version": "1.1", "weight_versions": None})
    got = read_slice(old)
    assert got.weight_versions == [] and got.versions() == [None] * M and got.weight_version.shape == (M,)
    # without versions, the builder writes unknown
    plain = read_slice(_body(SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD),
                             (experts, valid, sequence, position)))
    assert (plain.weight_version == -1).all()


@pytest.mark.parametrize("patch,words", [
    ({"weight_versions": '["a"]'}, "holds indices -1..1, but weight_versions lists 1 labels"),
    ({"weight_versions": '["a", "a"]'}, "not a JSON list of distinct labels"),
    ({"weight_versions": '["a", "b c"]'}, "'b c' is not a valid label"),
    ({"weight_versions": "{}"}, "not a JSON list"),
])
def test_reader_names_bad_versions(patch, words):
    meta = SliceMeta(top_k=2, num_experts=8, moe_ordinals=[1, 2], moe_layers=[5, 7], layout=THD,
                     weight_versions=["a", "b"])
    version = np.array([0, 1, -1, 1, -1, -1], np.int16)
    body = bytearray(b"".join(bytes(p) for p in build_slice(meta, *_arrays(meta), None, version)))
    with pytest.raises(FormatError, match=words.replace("[", r"\[")):
        read_slice(with_metadata(body, patch))
    with pytest.raises(FormatError, match="holds indices 0..2"):
        build_slice(meta, *_arrays(meta), None, np.array([0, 1, 2, 0, 0, 0], np.int16))
