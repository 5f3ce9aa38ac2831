"""Hot reads' parameters, parsed in one call each instead of by FastAPI's dependency solving.

A hot endpoint takes only the `Request` and asks this module for its parameters (`query`, `path_id`). They are the
same ones: the query is the same pydantic model (its errors answer the same 422 as FastAPI's, `loc` starting with
"query"), the ids pass the same rule (`deps.checked_id`), and the auth gate stays the router's dependency
(`auth.authorize`). The OpenAPI document lists the parameters from the same model (`openapi_parameters`), so clients
and the schema fuzzer see no difference.

Design (what it saves, measured): docs/design/service_workers.md.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from replay_service.api.deps import checked_id

M = TypeVar("M", bound=BaseModel)


def query(request: Request, model: type[M]) -> M:
    """The request's query string as `model` (a repeated key: its last value, as FastAPI takes it)."""
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in errors]) from None


def path_id(request: Request, name: str, kind: str) -> str:
    """Path parameter `name`, checked against the id rule (422 naming `kind` when it breaks it)."""
    return checked_id(kind, request.path_params[name])


def openapi_parameters(model: type[BaseModel], path_ids: dict[str, str],
                       headers: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `openapi_extra` of an endpoint parsed here: its path ids (name: description), `model` as its
    query, and `headers` (optional strings), as FastAPI would list them for declared parameters."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "description": text,
         "schema": {"type": "string", "description": text}}
        for name, text in path_ids.items()
    ]
    required = set(schema.get("required", ()))
    for name, field_schema in schema["properties"].items():
        entry = {"name": name, "in": "query", "required": name in required, "schema": _inline(field_schema, defs)}
        if "description" in field_schema:
            entry["description"] = field_schema["description"]
        params.append(entry)
    params += [{"name": name, "in": "header", "required": False,
                "schema": {"anyOf": [{"type": "string"}, {"type": "null"}]}} for name in headers]
    return {"parameters": params}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with each `$ref` to the model's own `$defs` replaced by the definition (no dangling refs)."""
    if isinstance(schema, list):
        return [_inline(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return {**_inline(defs[schema["$ref"].rsplit("/", 1)[-1]], defs), **_inline(rest, defs)}
    return {k: _inline(v, defs) for k, v in schema.items()}
