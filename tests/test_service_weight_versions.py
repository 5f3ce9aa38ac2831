"""Weight versions through a real server: stored, checked, served (rows.md "Weight versions", segment.md 2.6).

Every read path gives each row's version back exactly (Arrow, JSON, .npy's header, the batch read, summaries);
a position recomputed under another version is counted and located, never CONFLICT, and `recompute=first|latest`
and `weight_version=` choose what is served; the same version (or an unknown one) with other ids stays CONFLICT;
engine-output uploads map vLLM's and SGLang's spans over output tokens to rows, and bad spans or labels are a 422
naming them, with nothing stored. Data of the formats before (a 2.4 batch, a segment before 2.6, an index before
schema 6) reads back as version unknown. Run with REPLAY_TEST_INDEX=postgresql REPLAY_TEST_SEGMENTS=s3 to take the
same tests through PostgreSQL and ranged reads of a bucket.
"""

from __future__ import annotations

import base64
import io
import json
import sqlite3
import subprocess
import sys
import zlib

import httpx
import numpy as np
import pyarrow as pa
import pytest

from replay_client.client import ReplayClient
from replay_format import ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, Flag, RunShape
from replay_format.core import decode_metadata
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.segment import WEIGHT_VERSIONS_KEY, SegmentMeta, segment_versions
from replay_format.weight_versions import WeightVersions
from replay_service.errors import DamagedSegment
from replay_service.store.segments.integrity import seal
from replay_service.store.segments.ranges import BufferOffsets, read_rows
from replay_service.store.segments.write import object_image
from tests.support.data import QWEN3_SHAPE, routes
from tests.support.service import ServiceProcess, calls

ARROW = {"content-type": ARROW_STREAM_MEDIA_TYPE}
SMALL = RunShape(num_moe_layers=4, top_k=2, num_experts=8)


def body(run, writer, seq, request_ids, positions, experts, versions, shape=QWEN3_SHAPE) -> bytes:
    """A row batch; `versions`: one label (or None) per row, or None for a batch without the column."""
    wv = None if versions is None else WeightVersions.of_labels(versions)
    return encode_stream(build_rows(RowsMeta(run, writer, seq, shape), request_ids, np.asarray(positions),
                                    experts, weight_versions=wv))


def raw(service, run, request, **params) -> httpx.Response:
    answer = calls.get(f"{service.url}/v1/runs/{run}/requests/{request}/routes", params=params, timeout=30)
    answer.raise_for_status()
    return answer


def spans_of(labels: list[str | None]) -> list[dict]:
    """The spans over positions 0.. of per-row labels (unknown rows in none), as the service answers them."""
    out: list[dict] = []
    for p, label in enumerate(labels):
        if label is not None and out and out[-1]["version"] == label and out[-1]["end"] == p:
            out[-1]["end"] = p + 1
        elif label is not None:
            out.append({"version": label, "start": p, "end": p + 1})
    return out


def test_versions_round_trip_on_every_read_path(shared_service):
    client = ReplayClient(shared_service.url)
    run, n = "wv-roundtrip", 40
    rng = np.random.default_rng(23001)
    ex = {r: routes(rng, n) for r in ("a", "b")}
    # a switch at 17, an unknown stretch, and a label using every allowed kind of character
    labels = {"a": ["step-100"] * 17 + ["step-101"] * 23,
              "b": [None] * 5 + ["ckpt:v2/rank@0+x=1_y.z"] * 30 + ["default"] * 5}
    client.ingest(body(run, "w", 0, ["a"] * n + ["b"] * n, np.r_[0:n, 0:n], np.concatenate([ex["a"], ex["b"]]),
                       labels["a"] + labels["b"]))
    for r in ("a", "b"):
        client.finish(run, r, n + 1)
        route = client.get_route(run, r, strict=True)  # Arrow
        assert route.experts.tobytes() == ex[r].tobytes()
        assert route.versions().per_row() == labels[r]
        table = pa.ipc.open_stream(raw(shared_service, run, r).content).read_all()
        assert table.column("weight_version").to_pylist() == labels[r]  # the column itself, byte for byte
        doc = raw(shared_service, run, r, format="json").json()
        assert [row["weight_version"] for row in doc["rows"]] == labels[r]
        assert doc["weight_versions"] == spans_of(labels[r]) and doc["recompute"] == "first"
        npy = raw(shared_service, run, r, format="npy")
        assert json.loads(npy.headers["X-Replay-Weight-Versions"]) == spans_of(labels[r])
        assert np.load(io.BytesIO(npy.content)).tobytes() == ex[r].tobytes()
        part = client.get_route(run, r, start=15, end=20)
        assert part.versions().per_row() == labels[r][15:20]
        summary = client.request(run, r)
        assert [s.to_json() for s in summary.weight_versions] == spans_of(labels[r])
        assert (summary.recomputed, summary.first_recomputed, summary.clean) == (0, None, True)
    for got, r in zip(client.get_routes(run, ["b", "a"]), ("b", "a")):  # the batch read: one dictionary each
        assert got.versions().per_row() == labels[r] and got.experts.tobytes() == ex[r].tobytes()
    assert [v.raw for v in client.run(run).weight_versions] == [
        {"version": "ckpt:v2/rank@0+x=1_y.z", "rows": 30}, {"version": "default", "rows": 5},
        {"version": "step-100", "rows": 17}, {"version": "step-101", "rows": 23}, {"version": None, "rows": 5}]


def test_a_recompute_under_another_version_is_counted_and_located_not_conflict(shared_service):
    """Positions 0..11 computed under v1, then again under v2 (a cache reset after an update): the ids differ at
    some positions, not at others. Nothing is CONFLICT; `first` serves v1's rows, `latest` v2's."""
    client = ReplayClient(shared_service.url)
    run, n = "wv-recompute", 12
    rng = np.random.default_rng(23002)
    v1, v2 = routes(rng, n), routes(rng, n + 4)
    same = [0, 1, 2, 5]  # the new weights routed these positions as the old ones did
    v2[same] = v1[same]
    client.ingest(body(run, "w", 0, ["r"] * n, np.arange(n), v1, ["v1"] * n))
    answer = client.ingest(body(run, "w", 1, ["r"] * (n + 4), np.arange(n + 4), v2, ["v2"] * (n + 4)))
    assert answer.flagged == {} and answer.recomputed == n - len(same)
    client.finish(run, "r", n + 5)
    summary = client.request(run, "r")
    assert summary.flagged["CONFLICT"] == 0 and summary.clean
    assert (summary.recomputed, summary.first_recomputed) == (n - len(same), 3)
    assert summary.rows == n + 4
    assert [s.to_json() for s in summary.weight_versions] == [{"version": "v1", "start": 0, "end": n},
                                                              {"version": "v2", "start": n, "end": n + 4}]
    first = client.get_route(run, "r", strict=True)
    assert first.experts.tobytes() == np.concatenate([v1, v2[n:]]).tobytes()
    assert first.versions().per_row() == ["v1"] * n + ["v2"] * 4
    latest = client.get_route(run, "r", recompute="latest", strict=True)
    assert latest.experts.tobytes() == v2.tobytes() and latest.versions().per_row() == ["v2"] * (n + 4)
    only_v1 = client.get_route(run, "r", weight_version="v1")
    assert only_v1.experts[:n].tobytes() == v1.tobytes() and (only_v1.flags[n:] == Flag.GAP).all()
    assert not only_v1.flags[:n].any() and only_v1.versions().per_row() == ["v1"] * n + [None] * 4
    assert client.get_route(run, "r", weight_version="v2").experts.tobytes() == v2.tobytes()
    assert (client.get_route(run, "r", weight_version="v3").flags == Flag.GAP).all()  # none of that version
    batch = client.get_routes(run, ["r"], recompute="latest")[0]
    assert batch.experts.tobytes() == v2.tobytes()
    doc = raw(shared_service, run, "r", format="json", recompute="latest").json()
    assert doc["recompute"] == "latest" and doc["weight_versions"] == [{"version": "v2", "start": 0, "end": n + 4}]
    npy = raw(shared_service, run, "r", format="npy", weight_version="v1")
    assert json.loads(npy.headers["X-Replay-Weight-Versions"]) == [{"version": "v1", "start": 0, "end": n}]
    # the same recompute sent again (a retry under another seq) and a third version: each position counted once
    client.ingest(body(run, "w", 2, ["r"] * n, np.arange(n), v2[:n], ["v2"] * n))
    v3 = routes(rng, n)
    client.ingest(body(run, "w", 3, ["r"] * n, np.arange(n), v3, ["v3"] * n))
    summary = client.request(run, "r")
    assert summary.recomputed == n and summary.flagged["CONFLICT"] == 0  # 0, 1, 2, 5 now too (v3 differs)
    assert client.get_route(run, "r", recompute="latest").experts[:n].tobytes() == v3.tobytes()
    assert client.get_route(run, "r").experts[:n].tobytes() == v1.tobytes()  # the first computation, always
    assert client.run(run).recomputed == n


def test_a_recompute_inside_one_batch(shared_service):
    """Both computations of a position in one batch (the sink coalesced the steps before and after a reset)."""
    client = ReplayClient(shared_service.url)
    run = "wv-in-batch"
    rng = np.random.default_rng(23003)
    a, b = routes(rng, 6), routes(rng, 6)
    answer = client.ingest(body(run, "w", 0, ["r"] * 12, np.r_[0:6, 0:6], np.concatenate([a, b]),
                                ["old"] * 6 + ["new"] * 6))
    assert answer.flagged == {} and answer.recomputed == 6
    summary = client.request(run, "r")
    assert (summary.recomputed, summary.first_recomputed, summary.rows) == (6, 0, 6)
    assert client.get_route(run, "r").experts.tobytes() == a.tobytes()
    assert client.get_route(run, "r", recompute="latest").experts.tobytes() == b.tobytes()


@pytest.mark.parametrize("versions", [("v1", "v1"), ("v1", None), (None, "v1"), (None, None)],
                         ids=["same-version", "then-unknown", "unknown-first", "both-unknown"])
def test_differing_ids_under_one_version_or_an_unknown_one_stay_conflict(shared_service, versions):
    client = ReplayClient(shared_service.url)
    run = f"wv-conflict-{'-'.join(str(v) for v in versions)}".replace("None", "none")
    rng = np.random.default_rng(zlib.crc32(run.encode()))  # other rows per case: no row copies another's (STALE)
    a, b = routes(rng, 4), routes(rng, 4)
    b[[0, 2]] = a[[0, 2]]  # identical at 0 and 2: a resend, whatever the versions
    first, second = ([v] * 4 if v is not None else None for v in versions)
    client.ingest(body(run, "w", 0, ["r"] * 4, np.arange(4), a, first))
    answer = client.ingest(body(run, "w", 1, ["r"] * 4, np.arange(4), b, second))
    assert answer.flagged == {"CONFLICT": 2} and answer.recomputed == 0
    summary = client.request(run, "r")
    assert (summary.flagged["CONFLICT"], summary.first_flagged_position, summary.recomputed) == (2, 1, 0)
    route = client.get_route(run, "r")
    assert route.experts.tobytes() == a.tobytes()
    assert route.flagged_rows() == [(1, ["CONFLICT"]), (3, ["CONFLICT"])]
    assert client.get_route(run, "r", recompute="latest").flagged_rows() == [(1, ["CONFLICT"]), (3, ["CONFLICT"])]
    # and inside one batch, the same
    answer = client.ingest(body(run, "w", 2, ["q"] * 8, np.r_[0:4, 0:4], np.concatenate([a, b]),
                                None if first is None and second is None else (first or [None] * 4)
                                + (second or [None] * 4)))
    assert answer.flagged == {"CONFLICT": 2} and answer.recomputed == 0


def test_versions_of_a_recompute_identical_ids_are_a_resend(shared_service):
    client = ReplayClient(shared_service.url)
    run = "wv-resend"
    a = routes(np.random.default_rng(23005), 5)
    client.ingest(body(run, "w", 0, ["r"] * 5, np.arange(5), a, ["v1"] * 5))
    answer = client.ingest(body(run, "w", 1, ["r"] * 5, np.arange(5), a, ["v2"] * 5))
    assert answer.flagged == {} and answer.recomputed == 0
    summary = client.request(run, "r")
    assert (summary.rows, summary.recomputed) == (5, 0)
    assert client.get_route(run, "r").versions().per_row() == ["v1"] * 5
    latest = client.get_route(run, "r", recompute="latest")
    assert latest.versions().per_row() == ["v2"] * 5  # the last computation stored


def test_a_mirrored_prefix_under_another_version_is_a_recompute(shared_service):
    """A prefix-cache reference mirrors the source's rows into a request that computed those positions itself under
    other weights: a recompute, not CONFLICT; the mirrored rows keep the source's version."""
    client = ReplayClient(shared_service.url)
    run = "wv-references"
    rng = np.random.default_rng(23006)
    src, own = routes(rng, 8), routes(rng, 8)
    client.ingest(body(run, "w", 0, ["src"] * 8 + ["r"] * 8, np.r_[0:8, 0:8], np.concatenate([src, own]),
                       ["old"] * 8 + ["new"] * 8))
    answer = calls.post(f"{shared_service.url}/v1/runs/{run}/references", json={"references": [
        {"request_id": "r", "start": 0, "end": 4, "source_request_id": "src"}]}, timeout=30)
    assert answer.status_code == 200, answer.text
    summary = client.request(run, "r")
    assert (summary.recomputed, summary.first_recomputed, summary.flagged["CONFLICT"]) == (4, 0, 0)
    assert client.get_route(run, "r").experts.tobytes() == own.tobytes()
    latest = client.get_route(run, "r", recompute="latest")
    assert latest.experts.tobytes() == np.concatenate([src[:4], own[4:]]).tobytes()
    assert latest.versions().per_row() == ["old"] * 4 + ["new"] * 4


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def upload(service, run, request, content, content_type, **params) -> httpx.Response:
    return calls.post(f"{service.url}/v1/runs/{run}/requests/{request}/routes", content=content,
                      headers={"content-type": content_type}, params=params, timeout=30)


def test_vllm_spans_over_output_tokens_become_row_versions(shared_service):
    """vLLM's `CompletionOutput.weight_versions` for a prompt of 5 tokens and 7 output tokens (T = 12, 11 rows):
    output token j is the row at position 4+j; the prompt's rows 0..3 take output token 0's version."""
    client = ReplayClient(shared_service.url)
    run = "wv-vllm-upload"
    ex = routes(np.random.default_rng(23007), 11, SMALL)
    spans = [{"version": "default", "start": 0, "end": 3}, {"version": "step-1", "start": 3, "end": 7}]
    answer = upload(shared_service, run, "r", npy(ex), NPY_MEDIA_TYPE, num_experts=8,
                    weight_versions=json.dumps(spans))
    assert answer.status_code == 200, answer.text
    route = client.get_route(run, "r", strict=True)
    assert route.versions().per_row() == ["default"] * 7 + ["step-1"] * 4
    assert [s.to_json() for s in client.request(run, "r").weight_versions] == [
        {"version": "default", "start": 0, "end": 7}, {"version": "step-1", "start": 7, "end": 11}]
    # a later turn (start 11, a prompt of 14 tokens: 3 new, then 4 outputs) under a new version
    turn = routes(np.random.default_rng(23008), 6, SMALL)
    answer = upload(shared_service, run, "r", npy(turn), NPY_MEDIA_TYPE, start=11, prompt_tokens=14,
                    weight_versions=json.dumps([["step-2", 0, 4]]))
    assert answer.status_code == 200, answer.text
    assert client.get_route(run, "r").versions().per_row() == ["default"] * 7 + ["step-1"] * 4 + ["step-2"] * 6


def test_sglang_spans_and_one_version_for_every_row(shared_service):
    client = ReplayClient(shared_service.url)
    run = "wv-sglang-upload"
    ids = routes(np.random.default_rng(23009), 9, SMALL).astype(np.int32)
    doc = {"routed_experts": base64.b64encode(ids.tobytes()).decode(), "num_layers": 4, "top_k": 2,
           "num_experts": 8,  # 9 rows (T = 10) and 7 output tokens: a prompt of 3, output token j at row 2+j
           "weight_versions": [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 7}]}
    answer = calls.post(f"{shared_service.url}/v1/runs/{run}/requests/r/routes", json=doc, timeout=30)
    assert answer.status_code == 200, answer.text
    assert client.get_route(run, "r").versions().per_row() == ["a"] * 4 + ["b"] * 5
    doc = {"routed_experts": doc["routed_experts"], "num_layers": 4, "top_k": 2, "num_experts": 8,
           "weight_version": "7"}  # SGLang's meta_info["weight_version"]: one version for the whole request
    answer = calls.post(f"{shared_service.url}/v1/runs/{run}/requests/s/routes", json=doc, timeout=30)
    assert answer.status_code == 200, answer.text
    assert client.get_route(run, "s").versions().per_row() == ["7"] * 9


def test_the_clients_uploads_send_the_engines_spans_as_returned(shared_service):
    """`upload_vllm_output` takes vLLM's `WeightVersionSpan`s as the engine returns them (objects with version,
    start, end), `upload_sglang_output` SGLang's spans; both land as the endpoint's own test above says."""
    from vllm.outputs import WeightVersionSpan  # vLLM's own record: what CompletionOutput.weight_versions holds

    client = ReplayClient(shared_service.url)
    run = "wv-client-upload"
    ex = routes(np.random.default_rng(23011), 11, SMALL)
    client.upload_vllm_output(run, "r", ex, num_experts=8,
                              weight_versions=[WeightVersionSpan("default", 0, 3), WeightVersionSpan("step-1", 3, 7)])
    assert client.get_route(run, "r").versions().per_row() == ["default"] * 7 + ["step-1"] * 4
    ids = routes(np.random.default_rng(23012), 9, SMALL).astype(np.int32)
    client.upload_sglang_output(run, "s", ids, num_layers=4, top_k=2, num_experts=8,
                                weight_versions=[{"version": "a", "start": 0, "end": 2}, ["b", 2, 7]])
    assert client.get_route(run, "s").versions().per_row() == ["a"] * 4 + ["b"] * 5
    client.upload_sglang_output(run, "t", ids, num_layers=4, top_k=2, num_experts=8, weight_version="7")
    assert client.get_route(run, "t").versions().per_row() == ["7"] * 9
    with pytest.raises(Exception, match="overlap"):
        client.upload_vllm_output(run, "u", ex, num_experts=8, weight_versions=[("a", 0, 3), ("b", 2, 7)])


@pytest.mark.parametrize("spans, named", [
    ([["a", 0, 3], ["b", 2, 7]], "overlap"),
    ([["a", 0, 3], ["b", 4, 7]], "position 3 is in no span"),
    ([["a", 1, 7]], "position 0 is in no span"),
    ([["a", 0, 3], ["b", 3, 9]], "output token 8"),
    ([["bad label", 0, 7]], "'bad label' is not a valid label"),
    ([["x" * 129, 0, 7]], "is not a valid label"),
    ([["a", 0, "7"]], "non-integer"),
    ([], "empty"),
], ids=["overlap", "hole", "no-start", "past-the-end", "space", "too-long", "not-int", "empty"])
def test_bad_spans_and_labels_are_a_422_naming_them_and_store_nothing(shared_service, spans, named):
    run = "wv-bad-spans"
    ex = routes(np.random.default_rng(23010), 11, SMALL)  # 5 prompt tokens, 7 outputs when the spans cover 7
    answer = upload(shared_service, run, "r", npy(ex), NPY_MEDIA_TYPE, num_experts=8, prompt_tokens=5,
                    weight_versions=json.dumps(spans))
    assert answer.status_code == 422 and named in answer.json()["detail"], answer.text
    assert calls.get(f"{shared_service.url}/v1/runs/{run}/requests/r", timeout=30).status_code == 404


def test_bad_labels_in_a_batch_and_in_a_read_are_4xx_naming_them(shared_service):
    run = "wv-bad-labels"
    ex = routes(np.random.default_rng(23011), 2)
    meta = RowsMeta(run, "w", 0, QWEN3_SHAPE)
    batch = build_rows(meta, ["r"] * 2, np.arange(2), ex)
    bad = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int16()), pa.array(["no spaces allowed"]))
    batch = pa.RecordBatch.from_arrays([*batch.columns, bad], schema=batch.schema.append(
        pa.field("weight_version", bad.type)))
    answer = calls.post(f"{shared_service.url}/v1/ingest", content=encode_stream(batch), headers=ARROW, timeout=30)
    assert answer.status_code == 422 and "'no spaces allowed' is not a valid label" in answer.json()["detail"]
    assert calls.get(f"{shared_service.url}/v1/runs/{run}", timeout=30).status_code == 404
    ReplayClient(shared_service.url).ingest(body(run, "w", 1, ["r"] * 2, np.arange(2), ex, ["ok"] * 2))
    answer = calls.get(f"{shared_service.url}/v1/runs/{run}/requests/r/routes",
                       params={"weight_version": "a b"}, timeout=30)
    assert answer.status_code == 422 and "'a b' is not a valid label" in answer.json()["detail"]
    answer = calls.get(f"{shared_service.url}/v1/runs/{run}/requests/r/routes", params={"recompute": "newest"},
                       timeout=30)
    assert answer.status_code == 422 and "recompute" in answer.text


def test_ranged_reads_check_and_serve_the_versions(tmp_path):
    """A bucket segment's blocks are read by byte ranges (store/segments/ranges.py): the versions come from the footer
    and are checked by the block CRCs, so a label changed in the footer is refused, not served."""
    n = 9000  # three blocks
    ex = routes(np.random.default_rng(23012), n, SMALL).reshape(n, -1)
    labels = ["v1"] * 5000 + [None] * 1000 + ["v2"] * 3000
    versions = WeightVersions.of_labels(labels)
    md = SegmentMeta(RowsMeta("ranges", "w", 0, SMALL), "d" * 32, 1, weight_versions=versions).to_metadata()
    image = object_image(build_rows(SMALL, ["r"] * n, np.arange(n), ex, metadata=md))
    schema = pa.ipc.open_file(pa.BufferReader(image)).schema
    assert "weight_version" not in schema.names and WEIGHT_VERSIONS_KEY in decode_metadata(schema.metadata, "s")
    offsets = BufferOffsets.from_schema(schema, image.size)
    assert offsets is not None

    def read_at(offset: int, length: int) -> pa.Buffer:
        return image.slice(offset, length)

    got = read_rows(offsets, read_at, 4990, 6010, "x", "x")
    assert segment_versions(got.schema.metadata, None).take(slice(4990, 6010)).per_row() == labels[4990:6010]
    text = decode_metadata(schema.metadata, "s")[WEIGHT_VERSIONS_KEY]
    forged = pa.schema(schema, metadata={**decode_metadata(schema.metadata, "s"),
                                         WEIGHT_VERSIONS_KEY: text.replace('"v2"', '"v3"')})
    forged_offsets = BufferOffsets.from_schema(forged, image.size)
    assert forged_offsets is not None
    for lo in (8000, 10):  # a block of v2 rows, and one of v1 rows only: each block covers the segment's labels
        with pytest.raises(DamagedSegment, match="CRC32C"):
            read_rows(forged_offsets, read_at, lo, lo + 100, "x", "x")


# ---- data of the formats before --------------------------------------------------------------------------------


def test_a_2_4_batch_an_old_segment_and_an_old_index_read_back_as_version_unknown(tmp_path):
    """A 2.4 row batch (no weight_version column) stored, its segment rewritten as a 2.5 one (no weight_versions
    key), the index taken back to schema 5 (no recompute columns, no version tables): every read answers the rows
    with versions unknown, and new rows with versions land beside them; reindex rebuilds the counters."""
    data = tmp_path / "data"
    rng = np.random.default_rng(23013)
    old, new = routes(rng, 6), routes(rng, 6)
    meta = RowsMeta("old", "w", 0, QWEN3_SHAPE)
    batch = build_rows(meta, ["r"] * 6, np.arange(6), old)
    batch = batch.replace_schema_metadata({**decode_metadata(batch.schema.metadata, "rows"), "format_version": "2.4"})
    with ServiceProcess(data) as service:
        client = ReplayClient(service.url)
        assert client.ingest(encode_stream(batch)).stored
        assert client.get_route("old", "r").versions().per_row() == [None] * 6
    segment = next((data / "runs" / "old").glob("*.arrow"))
    stored = pa.ipc.open_file(pa.py_buffer(segment.read_bytes())).get_batch(0)
    md = decode_metadata(stored.schema.metadata, "segment")
    assert WEIGHT_VERSIONS_KEY not in md and md["format_version"] == "2.6"
    older = {k: v for k, v in md.items() if k != "crc32c"}
    older["format_version"] = "2.5"
    rewritten = seal(pa.RecordBatch.from_arrays(stored.columns, schema=stored.schema.with_metadata(older)))
    with pa.OSFile(str(segment), "wb") as f, pa.ipc.new_file(f, rewritten.schema) as writer:
        writer.write_batch(rewritten)
    with sqlite3.connect(data / "index.sqlite") as conn:  # as a release before this one left it
        conn.executescript("""
            ALTER TABLE requests DROP COLUMN recomputed;
            ALTER TABLE requests DROP COLUMN first_recomputed;
            DROP TABLE version_spans;
            DROP TABLE run_versions;
            PRAGMA user_version = 5;
        """)
    with ServiceProcess(data) as service:
        client = ReplayClient(service.url)
        route = client.get_route("old", "r")
        assert route.experts.tobytes() == old.tobytes() and route.versions().per_row() == [None] * 6
        assert raw(service, "old", "r", format="npy").headers["X-Replay-Weight-Versions"] == "[]"
        assert [row["weight_version"] for row in raw(service, "old", "r", format="json").json()["rows"]] == [None] * 6
        summary = client.request("old", "r")
        assert (summary.weight_versions, summary.recomputed, summary.first_recomputed) == ((), 0, None)
        assert [v.raw for v in client.run("old").weight_versions] == [{"version": None, "rows": 6}]
        # new rows with versions beside the old ones: an unknown row and a known one differ -> CONFLICT, as before
        new[0] = old[3]  # positions 3..5 again: identical at 3 (a resend), other ids at 4 and 5
        answer = client.ingest(body("old", "w", 1, ["r"] * 6 + ["t"] * 6, np.r_[3:9, 0:6],
                                    np.concatenate([new, routes(rng, 6)]), ["v1"] * 12))
        assert answer.flagged == {"CONFLICT": 2} and answer.recomputed == 0
        assert client.get_route("old", "r").versions().per_row() == [None] * 6 + ["v1"] * 3
        before = {r: client.request("old", r) for r in ("r", "t")}
        assert [v.raw for v in client.run("old").weight_versions] == [{"version": "v1", "rows": 9},
                                                                     {"version": None, "rows": 6}]
    with sqlite3.connect(data / "index.sqlite") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] >= 6
    rebuilt = subprocess.run([sys.executable, "-m", "replay_service.ops.cli", "reindex", "--data", str(data)],
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    with ServiceProcess(data) as service:
        client = ReplayClient(service.url)
        for r in ("r", "t"):
            assert client.request("old", r) == before[r]
        assert client.get_route("old", "t").versions().per_row() == ["v1"] * 6


def test_reindex_rebuilds_versions_and_recompute_counters(tmp_path):
    data = tmp_path / "data"
    rng = np.random.default_rng(23014)
    a, b = routes(rng, 8), routes(rng, 8)
    with ServiceProcess(data) as service:
        client = ReplayClient(service.url)
        client.ingest(body("rx", "w", 0, ["r"] * 8, np.arange(8), a, ["v1"] * 4 + ["v2"] * 4))
        client.ingest(body("rx", "w", 1, ["r"] * 8, np.arange(8), b, ["v3"] * 8))
        client.finish("rx", "r", 9)
        before, run_before = client.request("rx", "r"), client.run("rx")
        assert before.recomputed == 8
    rebuilt = subprocess.run([sys.executable, "-m", "replay_service.ops.cli", "reindex", "--data", str(data)],
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    with ServiceProcess(data) as service:
        client = ReplayClient(service.url)
        assert client.request("rx", "r") == before
        after = client.run("rx")
        assert (after.weight_versions, after.recomputed) == (run_before.weight_versions, 8)
        assert client.get_route("rx", "r", recompute="latest").versions().per_row() == ["v3"] * 8
