"""SGLang `/generate` answers as returned: every item stored in one call, narrow ids honoured, nothing half-stored.

SGLang does not install here; its encoding is restated below, line by line:
- SGLang 0.5.23 (the newest on PyPI) sends int32 and no dtype: the host buffer is int32
  (sglang/srt/state_capturer/base.py:70, zeroed at :75, so dense layers read 0), a request's rows are
  `buffer[req_to_token[start_len : seqlen - 1]]` (base.py:182-188), encoded
  `pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")` (managers/detokenizer_manager.py:443) into
  `meta_info["routed_experts"]` (managers/tokenizer_manager.py:2603-2609). Its reader assumes int32
  (state_capturer/routed_experts.py:166-174).
- SGLang after 0.5.23 (sgl-project/sglang a6463a10, python/sglang/srt/state_capturer/routed_experts_wire.py) narrows:
  `encode_routed_experts_for_wire` (:29-43) casts to `SGLANG_ROUTED_EXPERTS_DTYPE` (uint8, uint16, int32; `_WIRE_DTYPES`
  :13-17) unless an id falls outside the unsigned range, then int32, and returns the dtype actually sent, which
  meta_info carries as `routed_experts_dtype`; `extract_routed_experts_from_meta_info` (:46-58) reads int32 when absent.
- meta_info (tokenizer_manager.py:2507-2513): `id`, `finish_reason`, `prompt_tokens` (len(origin_input_ids)),
  `weight_version`, `num_retractions`; then `completion_tokens` (:2554-2558, the output through the stop) and, for a
  finished request, `weight_versions` (:2560-2568, `add_weight_versions_to_meta_info`, utils/weight_versions.py:90-107,
  over `compute_weight_version_spans`, :66-84). An item is `{"text", "output_ids", "meta_info"}` (:2664-2669) with
  `prompt_token_ids` when asked (:2673-2674); a batch answers a list (`_handle_batch_request`, :2190-2192).
- `routed_experts_start_len` is a request field, one for a whole batch (managers/io_struct.py:265-268, copied to every
  item at :1002); a start beyond the prompt aborts the request (managers/scheduler.py:3308-3317).
"""

from __future__ import annotations

import base64
import zlib

import numpy as np
import pytest

from replay_client.client import ReplayClient, ReplayError
from replay_format import RunShape
from tests.support.data import routes
from tests.support.service import calls

SMALL = RunShape(num_moe_layers=5, top_k=4, num_experts=64, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)
WIDE = RunShape(num_moe_layers=5, top_k=4, num_experts=300, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)
_WIRE_DTYPES = {"int32": np.dtype(np.int32), "uint16": np.dtype(np.uint16), "uint8": np.dtype(np.uint8)}


def wire(array: np.ndarray, sglang_dtype: str | None) -> tuple[str, str | None]:
    """`meta_info["routed_experts"]` and `["routed_experts_dtype"]`: 0.5.23 (None: int32, no key) or the encoder."""
    if sglang_dtype is None:  # detokenizer_manager.py:443 on the int32 host buffer
        return base64.b64encode(array.astype(np.int32).tobytes()).decode("utf-8"), None
    target = _WIRE_DTYPES[sglang_dtype]  # routed_experts_wire.py:36-43
    if target.kind == "u" and array.size:
        bounds = np.iinfo(target)
        if array.min() < bounds.min or array.max() > bounds.max:
            target = _WIRE_DTYPES["int32"]
    array = array.astype(target, copy=False)
    return base64.b64encode(array.tobytes()).decode("utf-8"), target.name


def version_spans(events: list[tuple[str, int]], current: str, num_output: int) -> list[dict]:
    """utils/weight_versions.py:66-107: spans over output tokens, each end cut at the output's length."""
    spans: list[dict] = []
    for version, end in [*events, (current, num_output)]:
        end = min(end, num_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [{**s, "end": min(s["end"], num_output)} for s in spans if s["start"] < num_output or s["start"] == 0]


def generate_item(rid: str, prompt: list[int], output: list[int], model_route: np.ndarray, start: int = 0,
                  sglang_dtype: str | None = None, events: list[tuple[str, int]] | None = None,
                  current: str = "default", prompt_token_ids: bool = False) -> dict:
    """One item of /generate as tokenizer_manager.py builds it (`model_route`: the whole (T-1, layers, K) buffer)."""
    meta: dict = {"id": rid, "finish_reason": {"type": "length", "length": len(output)}, "prompt_tokens": len(prompt),
                  "weight_version": current, "num_retractions": 0, "reasoning_tokens": 0,
                  "completion_tokens": len(output), "cached_tokens": 0}
    if events is not None:  # a finished request has spans (managers/scheduler_components/output_streamer.py:541-548)
        spans = version_spans(events, current, len(output))
        meta["weight_versions"], meta["weight_version"] = spans, spans[-1]["version"]
    seqlen = len(prompt) + len(output)
    payload, dtype = wire(model_route[min(start, seqlen - 1): seqlen - 1], sglang_dtype)  # base.py:182-188
    meta["routed_experts"] = payload
    if dtype is not None:
        meta["routed_experts_dtype"] = dtype
    item = {"text": "...", "output_ids": list(output), "meta_info": meta}
    if prompt_token_ids:
        item["prompt_token_ids"] = list(prompt)
    return item


def request_of(rng, shape: RunShape, prompt_len: int, output_len: int) -> tuple[list[int], list[int], np.ndarray]:
    """Tokens and SGLang's model-axis buffer (dense layers zero) of one request."""
    n = prompt_len + output_len - 1
    model = shape.to_model_axis(routes(rng, n, shape).astype(np.int32))
    return rng.integers(0, 1000, prompt_len).tolist(), rng.integers(0, 1000, output_len).tolist(), model


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


def expected_versions(item: dict, start: int) -> list[str]:
    """Each row's version: output token j is the row at position P-1+j, the prompt's rows take token 0's."""
    meta = item["meta_info"]
    prompt, total = meta["prompt_tokens"], meta["prompt_tokens"] + meta["completion_tokens"]
    spans = meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0, "end": total}]
    out = []
    for position in range(start, total - 1):
        j = max(position - (prompt - 1), 0)
        out.append(next(s["version"] for s in spans if s["start"] <= j < s["end"]))
    return out


def assert_read_back(client: ReplayClient, run: str, rid: str, model: np.ndarray, shape: RunShape, start: int,
                     item: dict) -> None:
    """Byte-equal on both axes: `model` is SGLang's buffer, its rows from `start` what was sent."""
    sent = model[start:]
    full = client.get_route(run, rid, start=start, strict=True, layer_axis="model")
    assert full.experts.shape == sent.shape
    assert np.array_equal(full.experts.astype(np.int32), sent)
    moe = client.get_route(run, rid, start=start, strict=True, layer_axis="moe")
    assert np.array_equal(moe.experts.astype(np.int32), sent[:, list(shape.moe_layers)])
    assert moe.positions.tolist() == list(range(start, start + len(sent)))
    assert moe.versions().per_row() == expected_versions(item, start)
    summary = client.request(run, rid)
    assert summary.status == "finished"


@pytest.mark.parametrize(("sglang_dtype", "shape", "sent"), [
    ("uint8", SMALL, "uint8"), ("uint16", WIDE, "uint16"), ("uint8", WIDE, "int32"),  # 300 experts: ids past 255
    (None, SMALL, None),  # SGLang 0.5.23: int32, no routed_experts_dtype
])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("versions", [False, True])
def test_one_answer_as_returned(client, sglang_dtype, shape, sent, start, versions):
    run = f"sgr-{sglang_dtype}-{shape.num_experts}-{start}-{int(versions)}"
    rng = np.random.default_rng(zlib.crc32(run.encode()))
    prompt, output, model = request_of(rng, shape, 12, 9)
    events = [("v1", 3), ("v2", 6)] if versions else None
    item = generate_item("4f1c2d9e8a7b", prompt, output, model, start, sglang_dtype, events, current="v3",
                         prompt_token_ids=True)
    assert item["meta_info"].get("routed_experts_dtype") == sent
    answer = client.upload_sglang_response(run, item, start=start, top_k=shape.top_k, num_experts=shape.num_experts,
                                           moe_layers=shape.moe_layers)
    assert [(i.index, i.request_id, i.start, i.rows, i.stored) for i in answer.items] == [
        (0, "4f1c2d9e8a7b", start, 20 - start, True)]
    assert_read_back(client, run, "4f1c2d9e8a7b", model, shape, start, item)
    route = client.get_route(run, "4f1c2d9e8a7b", start=start)
    assert route.token_ids.tolist() == (prompt + output)[start:-1]


def test_batched_generate_stored_in_one_call(client):
    rng = np.random.default_rng(7)
    run, start = "sgr-batch", 2
    reqs = [request_of(rng, SMALL, p, o) for p, o in ((10, 6), (4, 11), (7, 1))]
    answer = [generate_item(f"b{i}", p, o, m, start, "uint8", [("v0", 2)] if i == 1 else [], current="v1")
              for i, (p, o, m) in enumerate(reqs)]
    result = client.upload_sglang_response(run, answer, start=start, top_k=4, num_experts=64,
                                           moe_layers=SMALL.moe_layers)
    assert [i.request_id for i in result.items] == ["b0", "b1", "b2"]
    for i, (_, _, model) in enumerate(reqs):
        assert_read_back(client, run, f"b{i}", model, SMALL, start, answer[i])
    assert client.run(run).requests == 3
    # The same answer again is a retry: nothing stored twice.
    again = client.upload_sglang_response(run, answer, start=start)
    assert [i.duplicate for i in again.items] == [True, True, True]
    # Under the caller's ids (a dict from SGLang's id to its own), the run's shape from the run.
    mine = client.upload_sglang_response("sgr-batch-mine", answer, start=start, top_k=4, num_experts=64,
                                         moe_layers=SMALL.moe_layers, request_ids={"b0": "x0", "b1": "x1", "b2": "x2"})
    assert [i.request_id for i in mine.items] == ["x0", "x1", "x2"]
    assert_read_back(client, "sgr-batch-mine", "x1", reqs[1][2], SMALL, start, answer[1])


def _refusals(rng) -> list[tuple[str, object, dict, int, str]]:
    """(name, body, query, status, text the detail names) for answers that cannot be stored whole."""
    good = [generate_item(f"g{i}", *request_of(rng, SMALL, 6, 5), sglang_dtype="uint8") for i in range(3)]
    no_routes = [good[0], {**good[1], "meta_info": {k: v for k, v in good[1]["meta_info"].items()
                                                    if k != "routed_experts"}}, good[2]]
    short = dict(good[2]["meta_info"])
    short["routed_experts"] = base64.b64encode(base64.b64decode(short["routed_experts"])[:-4 * 8]).decode()
    truncated = [good[0], good[1], {**good[2], "meta_info": short}]
    bad_dtype = [good[0], {**good[1], "meta_info": {**good[1]["meta_info"], "routed_experts_dtype": "int8"}}]
    odd = dict(good[1]["meta_info"])
    odd["routed_experts"], odd["routed_experts_dtype"] = base64.b64encode(b"\0" * 7).decode(), "uint16"
    duplicate = [good[0], good[0]]
    q = {"top_k": 4, "num_experts": 64, "moe_layers": "3,4,5,6,7"}
    return [
        ("no routes", no_routes, q, 422, "item 1 (request 'g1'): meta_info has no 'routed_experts'"),
        ("truncated", truncated, q, 422, "item 2 (request 'g2'): meta_info.routed_experts holds"),
        ("start beyond the prompt", good, {**q, "start": 7}, 422, "item 0 (request 'g0'): routed_experts_start_len=7"),
        ("unknown dtype", bad_dtype, q, 422, "item 1 (request 'g1'): 'meta_info.routed_experts_dtype' 'int8'"),
        ("length not whole ids", [good[0], {**good[1], "meta_info": odd}], q, 422,
         "item 1 (request 'g1'): 'meta_info.routed_experts' decodes to 7 bytes"),
        ("same id twice", duplicate, q, 422, "item 1 (request 'g0'): the same request id as item 0"),
        ("no shape", good, {"num_experts": 64}, 422, "item 0 (request 'g0'): SGLang does not send the array's shape"),
    ]


def test_refusals_name_the_item_and_store_nothing(client, shared_service):
    rng = np.random.default_rng(11)
    for index, (name, body, query, status, text) in enumerate(_refusals(rng)):
        run = f"sgr-refused-{index}"
        r = calls.post(f"{shared_service.url}/v1/runs/{run}/responses/sglang", json=body, params=query)
        assert r.status_code == status, (name, r.text)
        assert text in r.json()["detail"], (name, r.json()["detail"])
        assert calls.get(f"{shared_service.url}/v1/runs/{run}").status_code == 404, name  # no run: nothing stored
    # On a run that exists, a refused answer leaves its requests as they were.
    good = [generate_item(f"k{i}", *request_of(rng, SMALL, 6, 5), sglang_dtype="uint8") for i in range(2)]
    client.upload_sglang_response("sgr-refused-run", good[:1], top_k=4, num_experts=64, moe_layers=SMALL.moe_layers)
    broken = {**good[1], "meta_info": {**good[1]["meta_info"], "completion_tokens": 9}}
    with pytest.raises(ReplayError, match=r"item 1 \(request 'k1'\)") as refused:
        client.upload_sglang_response("sgr-refused-run", [good[1] | {"meta_info": {**good[1]["meta_info"],
                                                                                  "id": "k9"}}, broken])
    assert refused.value.status == 422
    listed = calls.get(f"{shared_service.url}/v1/runs/sgr-refused-run/requests").json()
    assert [r["request_id"] for r in listed["items"]] == ["k0"]


def test_routes_upload_reads_routed_experts_dtype(client):
    rng = np.random.default_rng(3)
    _, _, model = request_of(rng, SMALL, 5, 4)
    payload, dtype = wire(model, "uint8")
    assert dtype == "uint8"
    r = client.http.post("/v1/runs/sgr-routes/requests/u8/routes", json={
        "routed_experts": payload, "routed_experts_dtype": dtype, "num_layers": 8, "top_k": 4, "num_experts": 64,
        "moe_layers": list(SMALL.moe_layers)})
    assert r.status_code == 200, r.text
    assert np.array_equal(client.get_route("sgr-routes", "u8", layer_axis="model").experts.astype(np.int32), model)
    client.upload_sglang_output("sgr-routes", "u8b", payload, num_layers=8, top_k=4, routed_experts_dtype="uint8")
    assert np.array_equal(client.get_route("sgr-routes", "u8b", layer_axis="model").experts.astype(np.int32), model)
    r = client.http.post("/v1/runs/sgr-routes/requests/u8c/routes", json={
        "routed_experts": payload, "routed_experts_dtype": "uint8", "dtype": "int32", "num_layers": 8, "top_k": 4})
    assert r.status_code == 422 and "disagree" in r.json()["detail"]
