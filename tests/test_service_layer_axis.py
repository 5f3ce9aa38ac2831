"""The model-layer axis on every read, the run's `num_hidden_layers`, and layer lists that are never guessed.

vLLM's `routed_experts` is `(rows, num_hidden_layers, K)`: the capturer's buffer is sized by
`model_config.get_total_num_hidden_layers()` and each router writes at its `layer_id`
(vllm/model_executor/layers/fused_moe/routed_experts_capturer.py, `_get_routed_experts_shape` and
`capture`), zero-initialised, so dense layers read 0. SGLang sizes its capturer by
`hf_text_config.num_hidden_layers` (sglang/srt/.../routed_experts capturer). A read with
`layer_axis=model` must give back exactly that array. Everything here runs against a real server.
"""

from __future__ import annotations

import base64
import io
import sqlite3

import numpy as np
import pytest

from replay_client.client import ReplayClient, ReplayError
from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream, read_rows, read_stream
from replay_service.api.models import RouteJson
from replay_service.app import open_store
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from tests.support.data import routes
from tests.support.formats import with_metadata
from tests.support.service import calls

# DeepSeek-V3-like, small: 8 model layers, the first 3 dense (first_k_dense_replace=3), top-8 of 64.
DEEPSEEK = RunShape(num_moe_layers=5, top_k=8, num_experts=64, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)
ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


def vllm_output(rng, n: int, shape: RunShape = DEEPSEEK) -> np.ndarray:
    """vLLM's `routed_experts`: `(n, num_hidden_layers, K)`, MoE layers at their layer id, dense ones zero."""
    return shape.to_model_axis(routes(rng, n, shape))


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def test_model_axis_reads_are_vllms_routed_experts_byte_for_byte(client, shared_service):
    rng = np.random.default_rng(1)
    engine = vllm_output(rng, 40)
    client.upload_vllm_output("ax-ds", "r0", engine, num_experts=64, moe_layers=DEEPSEEK.moe_layers)
    run = client.run("ax-ds")
    assert run.num_hidden_layers == 8 and run.moe_layers == (3, 4, 5, 6, 7)

    model = client.get_route("ax-ds", "r0", strict=True, layer_axis="model")
    assert model.experts.shape == (40, 8, 8) and model.layers == tuple(range(8)) and model.layer_axis == "model"
    assert model.experts.tobytes() == engine.astype(np.uint8).tobytes()
    moe = client.get_route("ax-ds", "r0", strict=True)  # the default stays the MoE axis
    assert moe.experts.shape == (40, 5, 8) and moe.layers == (3, 4, 5, 6, 7) and moe.num_hidden_layers == 8
    assert moe.experts.tobytes() == np.ascontiguousarray(engine[:, 3:]).astype(np.uint8).tobytes()

    array = client.get_route_npy("ax-ds", "r0", start=10, end=30, layer_axis="model")
    assert array.shape == (20, 8, 8) and array.tobytes() == engine[10:30].astype(np.uint8).tobytes()
    answer = calls.get(f"{shared_service.url}/v1/runs/ax-ds/requests/r0/routes",
                       params={"format": "npy", "layer_axis": "model"})
    assert answer.headers["x-route-layer-axis"] == "model"

    doc = calls.get(f"{shared_service.url}/v1/runs/ax-ds/requests/r0/routes",
                    params={"format": "json", "layer_axis": "model", "end": 3}).json()
    RouteJson.model_validate(doc)
    assert doc["layer_axis"] == "model" and doc["layers"] == list(range(8)) and doc["num_hidden_layers"] == 8
    assert np.array(doc["rows"][2]["experts"]).tolist() == engine[2].tolist()

    for axis, want in (("model", engine), ("moe", engine[:, 3:])):
        (got,) = client.get_routes("ax-ds", ["r0"], layer_axis=axis)
        assert got.layer_axis == axis and got.experts.tobytes() == np.ascontiguousarray(want).astype(np.uint8).tobytes()
    bad = calls.get(f"{shared_service.url}/v1/runs/ax-ds/requests/r0/routes", params={"layer_axis": "dense"})
    assert bad.status_code == 422


def test_gap_rows_are_zero_on_every_model_layer(client):
    rng = np.random.default_rng(2)
    shape = RunShape(3, 2, 16, (1, 3, 4), 6)
    ex = routes(rng, 5, shape)
    client.ingest(encode_stream(build_rows(RowsMeta("ax-gap", "w", 0, shape), ["g"] * 4, np.array([0, 1, 3, 4]),
                                           ex[[0, 1, 3, 4]])))
    got = client.get_route("ax-gap", "g", layer_axis="model")
    assert got.flags.tolist() == [0, 0, 32, 0, 0]
    assert got.experts.shape == (5, 6, 2) and not got.experts[2].any()
    assert not got.experts[:, [0, 2, 5]].any() and got.experts[[0, 1, 3, 4]][:, [1, 3, 4]].tolist() == \
        ex[[0, 1, 3, 4]].tolist()


def test_a_top1_layer_that_always_chose_expert_0_is_never_dropped(client, shared_service):
    """The old rule kept "not all zero" layers: a real top-1 MoE layer routing every row to expert 0 vanished."""
    rng = np.random.default_rng(3)
    shape = RunShape(4, 1, 8, (0, 1, 2, 3))
    ex = routes(rng, 30, shape).astype(np.int32)
    ex[:, 2] = 0  # MoE layer 2: top-1, expert 0 for every token (a router with one hot expert)
    url = f"{shared_service.url}/v1/runs/ax-top1/requests/t0/routes"
    # A new run without a list: which of the layers are MoE layers is ambiguous, so it is refused, not guessed.
    refused = calls.post(url, content=npy(ex), params={"num_experts": 8}, headers={"content-type": NPY_MEDIA_TYPE})
    assert refused.status_code == 422 and "layers [2] of the array are all zero" in refused.json()["detail"]
    assert "pass moe_layers" in refused.json()["detail"]
    assert calls.get(f"{shared_service.url}/v1/runs/ax-top1").status_code == 404  # nothing stored
    # With the list, every layer is kept.
    stored = calls.post(url, content=npy(ex), params={"num_experts": 8, "moe_layers": "0,1,2,3"},
                        headers={"content-type": NPY_MEDIA_TYPE})
    assert stored.status_code == 200, stored.text
    assert client.get_route("ax-top1", "t0").experts.tolist() == ex.tolist()
    # The run now knows its layers: a later upload on the MoE axis with a zero layer needs no list (was a 409).
    ex2 = routes(rng, 12, shape).astype(np.int32)
    ex2[:, 2] = 0
    again = calls.post(f"{shared_service.url}/v1/runs/ax-top1/requests/t1/routes", content=npy(ex2),
                       headers={"content-type": NPY_MEDIA_TYPE})
    assert again.status_code == 200, again.text
    assert client.get_route("ax-top1", "t1").experts.tolist() == ex2.tolist()


def test_an_existing_run_says_which_axis_an_array_is_on(client):
    rng = np.random.default_rng(4)
    client.upload_vllm_output("ax-run", "a", vllm_output(rng, 6), num_experts=64, moe_layers=DEEPSEEK.moe_layers)
    wide = vllm_output(rng, 7)
    narrow = np.ascontiguousarray(wide[:, 3:])
    client.upload_vllm_output("ax-run", "b", wide)  # 8 layers: the model axis
    client.upload_vllm_output("ax-run", "c", narrow)  # 5 layers: the MoE axis
    for rid in ("b", "c"):
        assert client.get_route("ax-run", rid, layer_axis="model").experts.tobytes() == wide.astype(np.uint8).tobytes()
    with pytest.raises(ReplayError, match="neither") as other:  # 6 layers: neither axis of this run
        client.upload_vllm_output("ax-run", "d", np.zeros((3, 6, 8), np.int32) + 1)
    assert other.value.status == 409
    off_by_one = wide.copy()
    off_by_one[:, 2] = 9  # a "dense" layer holding ids: the list does not describe this array
    with pytest.raises(ReplayError, match=r"layers \[2\] are not in moe_layers .* non-zero ids") as bad:
        client.upload_vllm_output("ax-run", "e", off_by_one)
    assert bad.value.status == 422
    with pytest.raises(ReplayError, match="stores rows of 5 layers") as conflict:  # another list than the run's
        client.upload_vllm_output("ax-run", "f", narrow, moe_layers=(2, 4, 5, 6, 7))
    assert conflict.value.status == 409


def test_sglang_json_on_either_axis(client):
    rng = np.random.default_rng(5)
    engine = vllm_output(rng, 9).astype(np.int32)
    payload = base64.b64encode(engine.tobytes()).decode()
    client.upload_sglang_output("ax-sgl", "s0", payload, num_layers=8, top_k=8, num_experts=64,
                                moe_layers=DEEPSEEK.moe_layers)
    assert client.get_route("ax-sgl", "s0", layer_axis="model").experts.astype(np.int32).tolist() == engine.tolist()
    # The MoE layers alone, with the model's layer count beside them.
    client.upload_sglang_output("ax-sgl2", "s0", base64.b64encode(np.ascontiguousarray(engine[:, 3:])).decode(),
                                num_layers=5, top_k=8, num_experts=64, moe_layers=DEEPSEEK.moe_layers,
                                num_hidden_layers=8)
    assert client.run("ax-sgl2").num_hidden_layers == 8
    assert client.get_route("ax-sgl2", "s0", layer_axis="model").experts.astype(np.int32).tolist() == engine.tolist()


def _hidden_batch(run: str, seq: int, shape: RunShape, stated: bool = True) -> bytes:
    rng = np.random.default_rng(seq)
    body = encode_stream(build_rows(RowsMeta(run, "w", seq, shape), ["h"] * 2, np.arange(2 * seq, 2 * seq + 2),
                                    routes(rng, 2, shape)))
    return bytes(with_metadata(body, {} if stated else {"num_hidden_layers": None, "format_version": "2.0"}))


def test_a_run_learns_its_model_layer_count_once(client, shared_service):
    """max(moe_layers) + 1 is what a writer that did not know says; a larger stated count is learnt, then kept."""
    derived = RunShape(2, 2, 16, (1, 3))  # num_hidden_layers unknown: 4
    client.ingest(_hidden_batch("ax-learn", 0, derived, stated=False))
    assert client.run("ax-learn").num_hidden_layers == 4
    assert client.get_route("ax-learn", "h", layer_axis="model").experts.shape == (2, 4, 2)
    client.ingest(_hidden_batch("ax-learn", 1, RunShape(2, 2, 16, (1, 3), 6)))  # a writer that knows: 6 layers
    assert client.run("ax-learn").num_hidden_layers == 6
    assert client.get_route("ax-learn", "h", layer_axis="model").experts.shape == (4, 6, 2)
    client.ingest(_hidden_batch("ax-learn", 2, derived))  # the derived count agrees with any
    client.ingest(_hidden_batch("ax-learn", 3, derived, stated=False))
    with pytest.raises(ReplayError, match="model of 6 layers .* says 7") as conflict:
        client.ingest(_hidden_batch("ax-learn", 4, RunShape(2, 2, 16, (1, 3), 7)))
    assert conflict.value.status == 409
    assert client.run("ax-learn").num_hidden_layers == 6 and client.request("ax-learn", "h").rows == 8
    # An upload wider than the derived count is the model axis of a larger model, learnt the same way.
    client.ingest(_hidden_batch("ax-learn2", 0, derived, stated=False))
    wide = RunShape(2, 2, 16, (1, 3), 5).to_model_axis(routes(np.random.default_rng(9), 3, derived))
    client.upload_vllm_output("ax-learn2", "u", wide)
    assert client.run("ax-learn2").num_hidden_layers == 5
    assert client.get_route("ax-learn2", "u", layer_axis="model").experts.tobytes() == wide.tobytes()


def test_an_index_without_num_hidden_layers_reads_it_as_derived(tmp_path):
    data = tmp_path / "data"
    store = open_store(ServiceSettings(data_dir=data, fsync=False))
    shape = RunShape(2, 2, 16, (2, 5), 9)
    ex = routes(np.random.default_rng(6), 3, shape)
    table, md = read_stream(encode_stream(build_rows(RowsMeta("old", "w", 0, shape), ["a"] * 3, np.arange(3), ex)))
    IngestPipeline.over(store).ingest(read_rows(table, RowsMeta.from_metadata(md)))
    assert store.run_summary("old").shape.num_hidden_layers == 9
    store.close()
    with sqlite3.connect(data / "index.sqlite") as conn:  # as the previous release left it
        conn.execute("ALTER TABLE runs DROP COLUMN num_hidden_layers")
        conn.execute("PRAGMA user_version = 1")
    again = open_store(ServiceSettings(data_dir=data, fsync=False))
    assert again.run_summary("old").shape.num_hidden_layers == 6  # unknown: max(moe_layers) + 1
    assert again.run_shape("old").num_hidden_layers == 6
    assert again.read_route("old", "a").num_rows == 3
    again.close()
