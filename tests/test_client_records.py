"""The client's answer records mirror the service's response models; dict-style reads still answer, with a warning."""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings

import numpy as np
import pytest

from replay_client import (
    ExpertLoad,
    IngestAnswer,
    ReplayClient,
    RequestSummary,
    ResponseAnswer,
    ResponseItemAnswer,
    RunSummary,
    VersionRows,
)
from replay_client.records import Record
from replay_format.weight_versions import VersionSpan, WeightVersions
from replay_service.app import create_app
from replay_service.settings import ServiceSettings
from tests.support.data import batch_bytes, routes

# The service's schema (OpenAPI component) each client record mirrors.
MIRRORS: dict[str, type] = {
    "RunSummary": RunSummary,
    "VersionRows": VersionRows,
    "ExpertLoad": ExpertLoad,
    "RequestSummary": RequestSummary,
    "WeightVersionSpan": VersionSpan,
    "IngestAnswer": IngestAnswer,
    "ResponseItemAnswer": ResponseItemAnswer,
    "ResponseAnswer": ResponseAnswer,
}

# The operations whose answers the client reads as records: (method, path) -> the answer's schema.
ANSWERS = {
    ("post", "/v1/ingest"): "IngestAnswer",
    ("post", "/v1/runs/{run}/requests/{request}/routes"): "IngestAnswer",
    ("post", "/v1/runs/{run}/requests/{request}/finish"): "RequestSummary",
    ("post", "/v1/runs/{run}/responses/sglang"): "ResponseAnswer",
    ("post", "/v1/runs/{run}/responses/vllm"): "ResponseAnswer",
    ("get", "/v1/runs/{run}"): "RunSummary",
    ("get", "/v1/runs/{run}/requests/{request}"): "RequestSummary",
    ("get", "/v1/runs/{run}/expert-load"): "ExpertLoad",
}


@pytest.fixture(scope="module")
def schemas(tmp_path_factory) -> dict:
    app = create_app(ServiceSettings(data_dir=tmp_path_factory.mktemp("records")))
    return app.openapi()  # no lifespan: the store is never opened


def _fields(record: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(record)
    return {f.name: hints[f.name] for f in dataclasses.fields(record) if f.name != "raw"}


def _ref(schema: dict) -> str | None:
    """The model a property's schema names: itself, its items', or its non-null alternative's."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "items" in schema:
        return _ref(schema["items"])
    for option in schema.get("anyOf", ()):
        if option.get("type") != "null":
            return _ref(option)
    return None


def _record_of(hint: typing.Any) -> type | None:
    """The record a field's type holds (itself, in a tuple, or optional), else None."""
    origin = typing.get_origin(hint)
    if origin is tuple or origin is typing.Union or origin is types.UnionType:
        inner = [_record_of(a) for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
        return next((r for r in inner if r is not None), None)
    return hint if isinstance(hint, type) and hint in MIRRORS.values() else None


@pytest.mark.parametrize("model", sorted(MIRRORS))
def test_each_record_has_the_fields_of_its_model(schemas, model):
    schema = schemas["components"]["schemas"][model]
    fields = _fields(MIRRORS[model])
    assert set(fields) == set(schema["properties"]), f"{MIRRORS[model].__name__} drifted from the service's {model}"
    for name, hint in fields.items():  # a nested model is the record that mirrors it
        nested = _ref(schema["properties"][name])
        if nested in MIRRORS:
            assert _record_of(hint) is MIRRORS[nested], (model, name)


def test_a_field_the_service_may_leave_out_has_a_default(schemas):
    """What the service does not require (an older one does not send it) must not break reading its answer."""
    for model, record in MIRRORS.items():
        if not dataclasses.is_dataclass(record) or not issubclass(record, Record):
            continue
        required = set(schemas["components"]["schemas"][model].get("required", ()))
        for f in dataclasses.fields(record):
            if f.name != "raw" and f.name not in required:
                assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, \
                    (model, f.name)


def test_the_client_reads_each_answer_as_the_record_of_its_schema(schemas):
    for (method, path), model in ANSWERS.items():
        answer = schemas["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert _ref(answer) == model, (method, path)
    lists = {"/v1/runs": ("RunList", "runs", "RunSummary"),
             "/v1/runs/{run}/requests": ("RequestPage", "items", "RequestSummary")}
    for path, (page, key, model) in lists.items():
        answer = schemas["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert _ref(answer) == page
        assert _ref(schemas["components"]["schemas"][page]["properties"][key]) == model


@pytest.fixture(scope="module")
def client(shared_service):
    rng = np.random.default_rng(42)
    with ReplayClient(shared_service.url) as c:
        answer = c.ingest(batch_bytes("records", "w", 0, ["a"] * 6, np.arange(6), routes(rng, 6)))
        assert isinstance(answer, IngestAnswer) and answer.stored and answer.rows == 6
        c.upload_route("records", "b", routes(rng, 4), weight_version="v1")
        yield c


def test_answers_are_records(client):
    finished = client.finish("records", "a", 7)
    assert isinstance(finished, RequestSummary) and finished.status == "finished" and finished.num_tokens == 7
    summary = client.request("records", "b")
    assert summary.weight_versions == (VersionSpan("v1", 0, 4),) and summary.clean
    run = client.run("records")
    assert isinstance(run, RunSummary) and run.rows == 10 and run.requests == 2 and run.moe_layers == tuple(range(48))
    assert run.shape.top_k == 8 and VersionRows(version="v1", rows=4) in run.weight_versions
    assert run in client.runs()
    assert {s.request_id for s in client.requests("records")} == {"a", "b"}
    load = client.expert_load("records")
    assert isinstance(load, ExpertLoad) and len(load.counts) == 48 and sum(load.counts[0]) == 10 * 8


def test_key_access_warns_naming_the_attribute_and_still_answers(client):
    run = client.run("records")
    with pytest.warns(DeprecationWarning, match=r"RunSummary\['rows'\] is deprecated.*use \.rows"):
        assert run["rows"] == run.rows == 10
    with pytest.warns(DeprecationWarning, match=r"use \.moe_layers"):
        assert run["moe_layers"] == list(range(48))  # the JSON value, as the dict held it
    with pytest.warns(DeprecationWarning, match=r"use \.num_hidden_layers"):
        assert run.get("num_hidden_layers", 0) == 48
    with pytest.warns(DeprecationWarning):
        assert "flagged" in run and run.get("no such key") is None
    summary = client.request("records", "b")
    with pytest.warns(DeprecationWarning, match=r"RequestSummary\['weight_versions'\].*use \.weight_versions"):
        assert summary["weight_versions"] == [{"version": "v1", "start": 0, "end": 4}]
    with pytest.warns(DeprecationWarning):
        assert dict(summary) == summary.raw == summary.to_json()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # attribute reads never warn
        assert (run.rows, summary.status, run.shape.num_experts) == (10, "finished", 128)


def test_a_record_reads_answers_of_older_and_newer_services():
    newer = {"request_id": "r", "status": "open", "num_tokens": None, "rows": 3, "expected_rows": 3,
             "first_flagged_position": None, "flagged": {}, "clean": True, "since": "a later release"}
    summary = RequestSummary.from_json(newer)  # the fields added since this model's first release are left out
    assert summary.weight_versions == () and summary.recomputed == 0 and summary.first_recomputed is None
    assert summary.raw["since"] == "a later release"
    with pytest.warns(DeprecationWarning, match=r"use \.raw\['since'\]"):
        assert summary["since"] == "a later release"
    built = RequestSummary(request_id="r", status="open", num_tokens=None, rows=3, expected_rows=3,
                           first_flagged_position=None, flagged={}, clean=True)
    assert built == summary and built.to_json()["weight_versions"] == []
    items = ResponseAnswer.from_json({"items": [{"stored": True, "duplicate": False, "rows": 2, "padding_dropped": 0,
                                                 "flagged": {}, "bytes": 9, "index": 0, "request_id": "x",
                                                 "start": 0}]})
    assert items.items[0] == ResponseItemAnswer(stored=True, duplicate=False, rows=2, padding_dropped=0, flagged={},
                                                bytes=9, index=0, request_id="x", start=0)


def test_route_versions_are_weight_versions_that_still_compare_as_a_list(client):
    route = client.get_route("records", "b")
    versions = route.versions()
    assert isinstance(versions, WeightVersions) and versions.per_row() == ["v1"] * 4
    with pytest.warns(DeprecationWarning, match=r"use Route\.versions\(\)\.per_row\(\)"):
        assert versions == ["v1"] * 4
    with pytest.warns(DeprecationWarning):
        assert list(versions) == ["v1"] * 4 and versions[0] == "v1" and len(versions) == 4
    assert client.get_route("records", "a").versions().per_row() == [None] * 6
