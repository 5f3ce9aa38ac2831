"""The OpenAPI document (/docs) describes every answer: a named schema for each JSON one, media types for the rest."""

from __future__ import annotations

import pytest

from replay_service.api.models import RouteParams
from replay_service.app import create_app
from replay_service.settings import ServiceSettings


@pytest.fixture(scope="module")
def openapi(tmp_path_factory) -> dict:
    app = create_app(ServiceSettings(data_dir=tmp_path_factory.mktemp("openapi")))
    return app.openapi()  # no lifespan: the store is never opened


def _operations(doc: dict):
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            yield f"{method.upper()} {path}", op


def _named(schema: dict) -> bool:
    """A schema that points at a model (or a list of one), not a bare `object`."""
    return "$ref" in schema or ("items" in schema and "$ref" in schema["items"])


def test_every_json_answer_has_a_schema(openapi):
    missing = []
    for name, op in _operations(openapi):
        for status, answer in op["responses"].items():
            json_answer = answer.get("content", {}).get("application/json")
            if json_answer is not None and not _named(json_answer.get("schema", {})):
                missing.append(f"{name} -> {status}")
    assert not missing, f"JSON answers without a response model: {missing}"


def test_every_answer_names_its_media_type(openapi):
    bare = [name for name, op in _operations(openapi)
            if not any(a.get("content") for s, a in op["responses"].items() if s.startswith("2"))]
    assert not bare, f"answers that say nothing of what they return: {bare}"


def test_errors_are_documented_as_error_bodies(openapi):
    assert "ErrorBody" in openapi["components"]["schemas"]
    for name, op in _operations(openapi):
        if " /v1/" not in name:
            continue
        schema = op["responses"].get("422", {}).get("content", {}).get("application/json", {}).get("schema", {})
        assert schema.get("$ref", "").endswith("/ErrorBody"), f"{name}: 422 is not an ErrorBody"


def test_the_route_answer_documents_all_three_formats(openapi):
    answer = openapi["paths"]["/v1/runs/{run}/requests/{request}/routes"]["get"]["responses"]["200"]["content"]
    assert set(answer) == {"application/vnd.apache.arrow.stream", "application/x-npy", "application/json"}
    assert answer["application/json"]["schema"]["$ref"].endswith("/RouteJson")


def test_the_route_read_documents_the_parameters_it_parses_itself(openapi):
    """GET .../routes parses its own parameters (api/lean.py, no dependency solving): the document still lists
    each one, from the same query model, with its bounds and its enums inline."""
    op = openapi["paths"]["/v1/runs/{run}/requests/{request}/routes"]["get"]
    params = {(p["in"], p["name"]): p for p in op["parameters"]}
    assert set(params) == ({("path", "run"), ("path", "request"), ("header", "accept")}
                           | {("query", name) for name in RouteParams.model_fields})
    assert all(params[("path", name)]["required"] for name in ("run", "request"))
    assert not any(p["required"] for (where, _), p in params.items() if where != "path")
    start = params[("query", "start")]["schema"]
    assert (start["minimum"], start["maximum"], start["default"]) == (0, 2**31 - 1, 0)
    assert params[("query", "layer_axis")]["schema"]["enum"] == ["moe", "model"]
    assert params[("query", "recompute")]["schema"]["enum"] == ["first", "latest"]
    assert "$ref" not in str(op["parameters"])
