"""The trainer query (replay_format/trainer_query.md): one typed shape the client sends and the service plans from."""

from __future__ import annotations

import json

import pytest

from replay_client.trainer import megatron_query, verl_query
from replay_format import LayerAxis
from replay_format.trainer_query import MegatronQuery, SequenceRef, StageLayers, VerlQuery, VersionPolicy
from replay_format.trainer_slice import Convention, MissingPolicy, Packing, TotalPad
from replay_service.api import trainer as api

SEQS = [("r", "a"), {"run": "r", "request": "b", "start": 3, "num_tokens": 5}]


def test_a_megatron_query_writes_the_body_keys_in_order():
    query = megatron_query(SEQS, "thd", convention="slime", cp_size=2, cp_rank=1, tp_size=2, model_layer_range=(2, 5),
                           layer_axis="model")
    assert query.sequences == (SequenceRef("r", "a"), SequenceRef("r", "b", 3, 5))
    assert query.layers == StageLayers(None, (2, 5), LayerAxis.MODEL) and query.missing is MissingPolicy.STRICT
    assert json.dumps(query.to_json()) == json.dumps({
        "sequences": [{"run": "r", "request": "a"}, {"run": "r", "request": "b", "start": 3, "num_tokens": 5}],
        "packing": "thd", "cp_split": "zigzag", "cp_size": 2, "cp_rank": 1, "tp_size": 2, "tp_rank": 0,
        "sequence_parallel": True, "convention": "slime", "model_layer_range": [2, 5], "layer_axis": "model",
        "missing": "strict",
    })


def test_a_verl_query_writes_the_body_keys_in_order():
    query = verl_query(SEQS, [1, 2], 4, 6, moe_ordinals=[0, 1], strict=False)
    assert query.missing is MissingPolicy.FILLER and query.strict is None  # the client sends missing only
    assert json.dumps(query.to_json()) == json.dumps({
        "sequences": [{"run": "r", "request": "a"}, {"run": "r", "request": "b", "start": 3, "num_tokens": 5}],
        "prompt_lengths": [1, 2], "prompt_width": 4, "response_width": 6, "moe_ordinals": [0, 1],
        "layer_axis": "moe", "missing": "filler",
    })


@pytest.mark.parametrize("query", [
    megatron_query(SEQS),
    megatron_query(SEQS, "bshd", seq_length=64, cp_size=2, cp_rank=1, sequence_parallel=False, missing="router"),
    megatron_query(SEQS, convention=Convention.VERL, fp8_padding=True, tp_size=4, tp_rank=3, layer_axis="model"),
    megatron_query(SEQS, pad_multiple=8, total_multiple=64, total_pad=TotalPad.TAIL, cp_split="contiguous",
                   moe_ordinals=(1, 2), data_pad_size_multiplier=None),
    MegatronQuery(sequences=(SequenceRef("r", "a"),), packing=Packing.BSHD, strict=True),  # an older client's alias
    verl_query(SEQS, [1, 2], 4, 6, layer_axis="model", model_layer_range=(0, 3)),
    megatron_query(SEQS, versions="single"),
    verl_query(SEQS, [1, 2], 4, 6, versions=VersionPolicy.SINGLE),
    VerlQuery(sequences=(SequenceRef("r", "a", 2),), prompt_lengths=(3,), prompt_width=3, response_width=1),
], ids=lambda q: type(q).__name__)
def test_the_api_model_turns_the_body_back_into_the_same_query(query):
    model = api.MegatronQueryBody if isinstance(query, MegatronQuery) else api.VerlQueryBody
    assert model.model_validate(query.to_json()).query() == query


def test_a_sequence_with_an_unknown_field_is_refused_before_it_is_sent():
    with pytest.raises(ValueError, match="num_token"):
        megatron_query([{"run": "r", "request": "a", "num_token": 4}])


def test_versions_is_sent_only_when_single():
    """An older service refuses an unknown key: the default (`any`) stays out of the body, `single` goes in."""
    assert "versions" not in megatron_query(SEQS).to_json()
    assert megatron_query(SEQS, versions="single").to_json()["versions"] == "single"
    assert verl_query(SEQS, [1, 2], 4, 6, versions="single").to_json()["versions"] == "single"
    assert [v.value for v in VersionPolicy] == ["any", "single"]
    with pytest.raises(ValueError):
        megatron_query(SEQS, versions="one")
