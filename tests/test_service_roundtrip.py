"""Clean rows go in and come back byte-equal, in every format, through a real server."""

from __future__ import annotations

import base64
import io
import ssl

import numpy as np
import pyarrow as pa
import pytest

from replay_client.client import ReplayClient, ReplayError
from replay_format import NO_TOKEN, RunShape
from replay_service.api.models import RouteJson
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes
from tests.support.service import calls


@pytest.fixture(scope="module")
def stored(shared_service):
    """Run 'rt': three requests, rows split over two writers' batches, finished."""
    rng = np.random.default_rng(1)
    lengths = {"req-a": 300, "req-b": 41, "req-c": 1000}
    full = {rid: routes(rng, n) for rid, n in lengths.items()}
    tokens = {rid: rng.integers(0, 150000, n) for rid, n in lengths.items()}
    client = ReplayClient(shared_service.url)
    # Prefill chunk of every request in one batch, the rest in another (as steps arrive).
    cut = {rid: n // 2 for rid, n in lengths.items()}
    for seq, part in enumerate((lambda rid: slice(0, cut[rid]), lambda rid: slice(cut[rid], lengths[rid]))):
        ids, pos, ex, tok = [], [], [], []
        for rid in lengths:
            s = part(rid)
            p = np.arange(lengths[rid])[s]
            ids += [rid] * len(p)
            pos.append(p)
            ex.append(full[rid][s])
            tok.append(tokens[rid][s])
        answer = client.ingest(batch_bytes("rt", f"w{seq}", 0, ids, np.concatenate(pos), np.concatenate(ex),
                                           token_ids=np.concatenate(tok)))
        assert answer.stored and answer.flagged == {}
    for rid, n in lengths.items():
        client.finish("rt", rid, n + 1)
    return client, full, tokens


def test_arrow_round_trip_is_byte_equal(stored):
    client, full, tokens = stored
    for rid, expected in full.items():
        route = client.get_route("rt", rid, strict=True)
        assert route.experts.dtype == np.uint8
        assert route.experts.tobytes() == expected.tobytes()
        assert np.array_equal(route.positions, np.arange(len(expected)))
        assert np.array_equal(route.token_ids, tokens[rid])
        assert route.clean


def test_npy_and_json_round_trip(stored, shared_service):
    client, full, _ = stored
    array = client.get_route_npy("rt", "req-b", strict=True)
    assert array.shape == (41, 48, 8) and array.dtype == np.uint8
    assert array.tobytes() == full["req-b"].tobytes()
    doc = calls.get(f"{shared_service.url}/v1/runs/rt/requests/req-a/routes",
                    params={"start": 10, "end": 20}, headers={"accept": "application/json"}).json()
    assert [r["position"] for r in doc["rows"]] == list(range(10, 20))
    assert np.array(doc["rows"][0]["experts"], np.uint8).tobytes() == full["req-a"][10].tobytes()
    assert all(r["flags"] == [] for r in doc["rows"])


def test_ranges_and_batch(stored):
    client, full, _ = stored
    part = client.get_route("rt", "req-c", start=450, end=700)
    assert part.experts.tobytes() == full["req-c"][450:700].tobytes()
    assert part.positions[0] == 450
    many = client.get_routes("rt", ["req-c", "req-a", "req-b"])
    assert [r.request_id for r in many] == ["req-c", "req-a", "req-b"]
    for route in many:
        assert route.experts.tobytes() == full[route.request_id].tobytes()
    tail = client.get_routes("rt", ["req-a", "req-c"], start=200)
    assert tail[0].experts.tobytes() == full["req-a"][200:].tobytes()
    assert tail[1].experts.tobytes() == full["req-c"][200:].tobytes()


def test_arrays_are_views_and_torch_shares_memory(stored):
    torch = pytest.importorskip("torch")
    client, full, _ = stored
    route = client.get_route("rt", "req-a")
    assert route.experts.flags.writeable and route.experts.base is not None
    tensor = route.torch()
    assert tensor.data_ptr() == route.experts.ctypes.data
    assert torch.equal(tensor, torch.from_numpy(full["req-a"].copy()))


def test_summaries_and_listing(stored, shared_service):
    client, full, _ = stored
    run = client.run("rt")
    assert run.requests == 3 and run.rows == sum(len(v) for v in full.values())
    assert all(v == 0 for v in run.flagged.values())
    assert [r.request_id for r in client.requests("rt", page_size=2)] == ["req-a", "req-b", "req-c"]
    summary = client.request("rt", "req-c")
    assert summary.status == "finished" and summary.num_tokens == 1001 and summary.clean
    load = client.expert_load("rt")
    counts = np.array(load.counts)
    expected = np.zeros((48, 128), np.int64)
    for ex in full.values():
        for layer in range(48):
            expected[layer] += np.bincount(ex[:, layer].reshape(-1), minlength=128)
    assert np.array_equal(counts, expected)
    assert load.rows == run.rows


def test_vllm_routed_experts_upload_keeps_moe_layers(shared_service):
    """vLLM's routed_experts carries every model layer; dense ones are zeros and are dropped (given the MoE list)."""
    rng = np.random.default_rng(2)
    shape = RunShape(num_moe_layers=4, top_k=8, num_experts=64)
    moe = routes(rng, 99, shape)
    engine = np.zeros((99, 6, 8), np.int32)  # layers 0 and 1 dense (like DeepSeek-V3's first layers)
    engine[:, 2:] = moe
    client = ReplayClient(shared_service.url)
    with pytest.raises(ReplayError, match="pass moe_layers") as refused:  # zero layers: never guessed
        client.upload_vllm_output("vllm-out", "r0", engine, num_experts=64)
    assert refused.value.status == 422
    client.upload_vllm_output("vllm-out", "r0", engine, num_experts=64, moe_layers=[2, 3, 4, 5])
    route = client.get_route("vllm-out", "r0", strict=True)
    assert route.moe_layers == (2, 3, 4, 5)
    assert route.experts.tobytes() == moe.astype(np.uint8).tobytes()
    assert client.request("vllm-out", "r0").num_tokens == 100
    # The same upload again is idempotent; the run now knows its layers, so no list is needed.
    assert client.upload_vllm_output("vllm-out", "r0", engine, num_experts=64, moe_layers=[2, 3, 4, 5]).duplicate
    assert client.upload_vllm_output("vllm-out", "r0", engine).duplicate
    assert client.get_route("vllm-out", "r0", layer_axis="model").experts.tobytes() == engine.astype(np.uint8).tobytes()


def test_sglang_base64_upload(shared_service):
    rng = np.random.default_rng(3)
    shape = RunShape(num_moe_layers=3, top_k=4, num_experts=300)  # > 256 experts: stored as uint16
    ids = routes(rng, 57, shape).astype(np.int32)
    payload = base64.b64encode(ids.tobytes()).decode()
    client = ReplayClient(shared_service.url)
    tokens = rng.integers(0, 1000, 58)
    client.upload_sglang_output("sglang", "s0", payload, num_layers=3, top_k=4, num_experts=300, token_ids=tokens)
    route = client.get_route("sglang", "s0", strict=True)
    assert route.experts.dtype == np.uint16
    assert np.array_equal(route.experts.astype(np.int32), ids)
    assert np.array_equal(route.token_ids, tokens[:57])


def test_arrow_stream_body_is_the_documented_schema(stored, shared_service):
    body = calls.get(f"{shared_service.url}/v1/runs/rt/requests/req-b/routes").content
    table = pa.ipc.open_stream(io.BytesIO(body)).read_all()
    assert table.schema.field("experts").type == pa.list_(pa.uint8(), 48 * 8)
    assert table.schema.field("request_id").type == pa.dictionary(pa.int32(), pa.utf8())
    assert table.schema.field("flags").type == pa.uint16()
    assert table.schema.metadata[b"run_id"] == b"rt"
    assert QWEN3_SHAPE.row_width == 384


def test_batch_read_keeps_moe_layers(shared_service):
    """POST .../routes/batch names the run's MoE layers as GET .../routes does (it left them out)."""
    rng = np.random.default_rng(4)
    shape = RunShape(num_moe_layers=3, top_k=2, num_experts=16, moe_layers=(3, 4, 5))
    client = ReplayClient(shared_service.url)
    client.ingest(batch_bytes("moe-345", "w", 0, ["m0"] * 9, np.arange(9), routes(rng, 9, shape), shape=shape))
    assert client.get_route("moe-345", "m0").moe_layers == (3, 4, 5)
    assert [r.moe_layers for r in client.get_routes("moe-345", ["m0", "m0"])] == [(3, 4, 5), (3, 4, 5)]


def test_unknown_token_ids_are_null_on_the_wire_and_no_token_in_memory(shared_service):
    """One spelling each: Arrow null (and JSON null) on the wire, NO_TOKEN (-1) in an int32 array in memory."""
    rng = np.random.default_rng(5)
    shape = RunShape(num_moe_layers=2, top_k=2, num_experts=8)
    client = ReplayClient(shared_service.url)
    tokens = np.array([5, NO_TOKEN, 7, NO_TOKEN, 9])
    client.ingest(batch_bytes("tok", "w", 0, ["t0"] * 5 + ["t1"] * 3, np.r_[np.arange(5), np.arange(3)],
                              routes(rng, 8, shape), shape=shape, token_ids=np.r_[tokens, [NO_TOKEN] * 3]))
    for route in (client.get_route("tok", "t0"), client.get_routes("tok", ["t0"])[0]):
        assert route.token_ids.dtype == np.int32 and route.token_ids.tolist() == tokens.tolist()
    assert client.get_route("tok", "t1").token_ids.tolist() == [NO_TOKEN] * 3
    doc = calls.get(f"{shared_service.url}/v1/runs/tok/requests/t0/routes", params={"format": "json"}).json()
    RouteJson.model_validate(doc)
    assert [r["token_id"] for r in doc["rows"]] == [5, None, 7, None, 9]
    body = calls.get(f"{shared_service.url}/v1/runs/tok/requests/t0/routes").content
    assert pa.ipc.open_stream(io.BytesIO(body)).read_all().column("token_id").to_pylist() == [5, None, 7, None, 9]


def test_the_client_needs_only_numpy_pyarrow_and_httpx():
    """replay_client runs in the trainer: importing it pulls in neither the service nor torch."""
    import subprocess
    import sys

    code = ("import sys, replay_client; bad = [m for m in ('replay_service', 'fastapi', 'torch', 'sqlite3')"
            " if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clients_read_the_ca_bundle_once_per_process():
    """Every ReplayClient verifies TLS with one context made once: httpx made a new one per client, reading the CA
    bundle each time (~55 ms, for plain-http URLs too), which a script opening a client per call paid on every call.
    """
    clients = [ReplayClient(url) for url in ("http://127.0.0.1:1", "https://127.0.0.1:2", "http://127.0.0.1:3")]
    try:
        contexts = [client._transport.http._transport._pool._ssl_context for client in clients]
        assert all(context is contexts[0] for context in contexts)
        assert contexts[0].verify_mode == ssl.CERT_REQUIRED and contexts[0].check_hostname  # still verifies
    finally:
        for client in clients:
            client.close()
