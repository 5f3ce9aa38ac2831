"""Every bad input: a JSON 4xx naming the problem, nothing stored, the server still serving."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pyarrow as pa
import pytest

from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes
from tests.support.service import ServiceProcess, calls

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A small body limit so the 413 case needs no huge upload.
    path = tmp_path_factory.mktemp("bad") / "data"
    with ServiceProcess(path, env={"REPLAY_MAX_BODY_BYTES": str(4 * 2**20), "REPLAY_MAX_READ_ROWS": "8"}) as proc:
        rng = np.random.default_rng(5)
        body = batch_bytes("good", "w", 0, ["r"] * 10, np.arange(10), routes(rng, 10))
        assert calls.post(f"{proc.url}/v1/ingest", content=body, headers=ARROW).status_code == 200
        yield proc


def _table_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _good_batch(seq: int = 1, n: int = 4) -> pa.RecordBatch:
    rng = np.random.default_rng(seq)
    return build_rows(RowsMeta("good", "w", seq, QWEN3_SHAPE), ["r2"] * n, np.arange(n), routes(rng, n))


def _with_metadata(batch: pa.RecordBatch, **changes) -> bytes:
    md = {k.decode(): v.decode() for k, v in batch.schema.metadata.items()}
    md.update({k: str(v) for k, v in changes.items()})
    for k, v in list(md.items()):
        if v == "None":
            del md[k]
    return encode_stream(batch.replace_schema_metadata(md))


def _cases():
    good = _good_batch()
    experts_i32 = pa.FixedSizeListArray.from_arrays(
        pa.array(np.full(4 * 384, 300, np.int32)), 384
    )
    too_wide = pa.RecordBatch.from_arrays(
        [good.column(0), good.column(1), good.column(2), experts_i32, good.column(4)],
        names=good.schema.names,
    ).replace_schema_metadata(good.schema.metadata)
    negative = pa.RecordBatch.from_arrays(
        [good.column(0), good.column(1), good.column(2),
         pa.FixedSizeListArray.from_arrays(pa.array(np.full(4 * 384, -1, np.int32)), 384), good.column(4)],
        names=good.schema.names,
    ).replace_schema_metadata(good.schema.metadata)
    wrong_width = build_rows(RowsMeta("good", "w", 2, RunShape(47, 8, 128)), ["r2"] * 2, np.arange(2),
                              routes(np.random.default_rng(0), 2, RunShape(47, 8, 128)))
    renamed = good.rename_columns(["request_id", "pos", "token_id", "experts", "flags"]).replace_schema_metadata(
        good.schema.metadata
    )
    bad_req = build_rows(RowsMeta("good", "w", 3, QWEN3_SHAPE), ["../etc"] * 2, np.arange(2),
                          routes(np.random.default_rng(0), 2))
    neg_pos = build_rows(RowsMeta("good", "w", 4, QWEN3_SHAPE), ["r2"] * 2, np.array([-1, 0]),
                          routes(np.random.default_rng(0), 2))
    bad_indices = good.set_column(
        0, "request_id",
        pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 7], pa.int32()), pa.array(["r2"]), safe=False),
    )
    return {
        "not arrow": (b"this is not arrow", ARROW, 400, "not a valid Arrow IPC stream"),
        # Found by mutating valid bodies: both were 500s before read_arrow_body validated fully.
        "dictionary index out of range": (encode_stream(bad_indices), ARROW, 400, "not a valid Arrow IPC stream"),
        "field name not UTF-8": (encode_stream(good).replace(b"position", b"posit\xd6on", 1), ARROW, 400, "not UTF-8"),
        "json body": (b'{"a": 1}', {"content-type": "application/json"}, 415, "ingest takes"),
        "missing metadata": (_with_metadata(good, seq=None), ARROW, 422, "lacks seq"),
        "bad seq": (_with_metadata(good, seq="x"), ARROW, 422, "seq='x' is not an integer"),
        "renamed column": (encode_stream(renamed), ARROW, 422, "lacks column 'position'"),
        "L*K differs from metadata": (_with_metadata(good, num_moe_layers=47, moe_layers=None), ARROW, 422,
                                      "num_moe_layers*top_k"),
        "L*K differs from run": (encode_stream(wrong_width), ARROW, 409, "run 'good' stores rows of 48 layers"),
        "ids too wide": (encode_stream(too_wide), ARROW, 422, "id 300, which does not fit uint8"),
        "negative ids": (encode_stream(negative), ARROW, 422, "id -1"),
        "bad request id": (encode_stream(bad_req), ARROW, 422, "request_id '../etc' is not a valid id"),
        "bad run id": (_with_metadata(good, run_id="a/b"), ARROW, 422, "run_id 'a/b' is not a valid id"),
        "negative position": (encode_stream(neg_pos), ARROW, 422, "column 'position'"),
        "unknown flag bits": (encode_stream(good.set_column(4, "flags", pa.array(np.full(4, 512, np.uint16)))),
                              ARROW, 422, "bits outside the defined flags"),
        "over the limit": (b"\0" * (5 * 2**20), ARROW, 413, "exceeds the limit"),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_ingest_is_refused_and_nothing_stored(server, name):
    body, headers, status, words = CASES[name]
    before = calls.get(f"{server.url}/v1/runs").json()
    answer = calls.post(f"{server.url}/v1/ingest", content=body, headers=headers, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert words in answer.json()["detail"]
    assert calls.get(f"{server.url}/v1/runs").json() == before
    assert calls.get(f"{server.url}/healthz").status_code == 200


@pytest.mark.parametrize(
    "path,status,words",
    [
        ("/v1/runs/..", 404, None),  # never routed to a handler: Starlette normalises nothing, no match
        ("/v1/runs/a..b", 422, "not a valid id"),
        ("/v1/runs/" + "x" * 129, 422, "not a valid id"),
        ("/v1/runs/nope", 404, "run 'nope' not found"),
        ("/v1/runs/good/requests/nope", 404, "request 'nope' not found"),
        ("/v1/runs/good/requests/r/routes?format=xml", 422, "format 'xml'"),
        ("/v1/runs/good/requests?flag=PURPLE", 422, "unknown flag 'PURPLE'"),
        ("/v1/runs/good/requests/r/routes?start=-1", 422, "start"),
    ],
)
def test_bad_reads(server, path, status, words):
    answer = calls.get(server.url + path)
    assert answer.status_code == status, answer.text
    if words:
        assert words in answer.json()["detail"]


def test_bad_route_uploads(server):
    url = f"{server.url}/v1/runs/fresh/requests/r/routes"
    npy = io.BytesIO()
    np.save(npy, np.ones((5, 2, 2), np.int32))
    cases = [
        (npy.getvalue(), {"content-type": "application/x-npy"}, {}, 422, "num_experts is unknown"),
        (b"garbage", {"content-type": "application/x-npy"}, {"num_experts": 8}, 400, "not a .npy"),
        (json.dumps({"routed_experts": "!!"}).encode(), {"content-type": "application/json"}, {}, 422, "base64"),
        (json.dumps({"routed_experts": "AAAA", "num_layers": 3, "top_k": 2}).encode(),
         {"content-type": "application/json"}, {}, 422, "not a whole number of int32"),
        (json.dumps({"routed_experts": "AAAAAAAAAAAAAAAA", "num_layers": 3, "top_k": 2}).encode(),
         {"content-type": "application/json"}, {}, 422, "do not split into rows"),
        (b"x", {"content-type": "text/plain"}, {}, 415, "a route is"),
        # Found by mutating valid uploads: each was a 500 before.
        (npy.getvalue()[:10] + b"{'descr': '<i4', 'fortran_order': False, 'shape': (5, 2, 2), }}".ljust(118) + b"\n"
         + npy.getvalue()[128:], {"content-type": "application/x-npy"}, {"num_experts": 8}, 400, "not a .npy"),
        (npy.getvalue()[:-4], {"content-type": "application/x-npy"}, {"num_experts": 8}, 400, "the body holds 76"),
        (json.dumps({"routed_experts": "AAAAAAAAAAA=", "num_layers": 1, "top_k": 2, "token_ids": ["a"]}).encode(),
         {"content-type": "application/json"}, {}, 422, "'token_ids' must be a list of integers"),
        (json.dumps({"routed_experts": "AAAAAAAAAAA=", "num_layers": 1, "top_k": 2, "num_experts": "x"}).encode(),
         {"content-type": "application/json"}, {}, 422, "'num_experts' must be an integer"),
    ]
    for body, headers, params, status, words in cases:
        answer = calls.post(url, content=body, headers=headers, params=params)
        assert answer.status_code == status, answer.text
        assert words in answer.json()["detail"]
    assert calls.get(f"{server.url}/v1/runs/fresh").status_code == 404


def test_finish_conflicts_and_validation(server):
    url = f"{server.url}/v1/runs/good/requests/r/finish"
    assert calls.post(url, json={"num_tokens": 11}).status_code == 200
    again = calls.post(url, json={"num_tokens": 12})
    assert again.status_code == 409 and "already finished with 11 tokens" in again.json()["detail"]
    assert calls.post(url, json={"num_tokens": -1}).status_code == 422
    assert calls.post(url, json={"num_tokens": 5, "status": "exploded"}).status_code == 422


def test_reads_past_the_row_limit_are_paged(server):
    url = f"{server.url}/v1/runs/good/requests/r/routes"
    whole = calls.get(url)
    assert whole.status_code == 422 and "REPLAY_MAX_READ_ROWS=8" in whole.json()["detail"]
    assert calls.get(url, params={"start": 0, "end": 8}).status_code == 200
    assert calls.get(url, params={"start": 8, "end": 10}).status_code == 200


# Positions are int32 (0 .. 2^31 - 2; an exclusive end up to 2^31 - 1): a read range past that answered 500 from
# the catch-all guard (an int32 overflow assembling the route, SQLite's integer overflow reading spans).
OUT_OF_RANGE_POSITIONS = [(2**31, 2**31 + 2), (2**31 - 1, 2**31 + 9), (2**63 - 1, 2**63 + 9), (2**63, 2**63 + 1),
                          (2**64, 2**64 + 1), (0, 2**63), (-1, 3)]


def test_an_empty_range_reads_as_no_rows_in_every_format(server):
    """start == end (also at the last position there is): no rows, not a 500 (.npy cast a zero-length view)."""
    url = f"{server.url}/v1/runs/good/requests/r/routes"
    for start in (5, 2**31 - 1):
        for fmt in ("arrow", "npy", "json"):
            answer = calls.get(url, params={"start": start, "end": start, "format": fmt})
            assert answer.status_code == 200, (fmt, answer.text[:200])
        assert np.load(io.BytesIO(calls.get(url, params={"start": start, "end": start, "format": "npy"}).content)
                       ).shape[0] == 0


@pytest.mark.parametrize(("start", "end"), OUT_OF_RANGE_POSITIONS)
def test_read_positions_past_int32_are_a_422_naming_the_parameter(server, start, end):
    """Every read that takes a range: the route (each format), the batch read, a comparison's request, the trainer."""
    run = f"{server.url}/v1/runs/good"
    with httpx.Client(timeout=30) as http:
        answers = [http.get(f"{run}/requests/r/routes", params={"start": start, "end": end, "format": fmt})
                   for fmt in ("arrow", "npy", "json")]
        answers.append(http.post(f"{run}/routes/batch", json={"requests": ["r"], "start": start, "end": end}))
        answers.append(http.post(f"{run}/routes/batch", json={"requests": ["r"], "start": start}))
        answers.append(http.get(f"{run}/compares/c-unknown/requests/r", params={"start": start, "end": end}))
        if not 0 <= start < 2**31:  # a trainer sequence has a start only
            answers.append(http.post(f"{server.url}/v1/trainer/megatron",
                                     json={"sequences": [{"run": "good", "request": "r", "start": start}]}))
    for answer in answers[:3]:  # the route GET parses its own query (api/lean.py): FastAPI's error shape
        assert answer.status_code == 422
        assert {tuple(e["loc"]) for e in answer.json()["errors"]} <= {("query", "start"), ("query", "end")}
    for answer in answers:
        assert answer.status_code == 422, (answer.request.url, answer.status_code, answer.text[:300])
        detail = json.dumps(answer.json()["detail"])
        assert "start" in detail or "end" in detail, detail
