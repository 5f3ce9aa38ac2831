"""The OpenAPI surface fuzzed by schemathesis against a real server (issue 13): no 5xx, and every answer
conforms to the documented schema (status code, content type, body). A bounded number of examples per
operation keeps it short; every operation is run and all failures are reported together."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# What the issue asks: no 5xx, and answers as documented (status code, media type, body). Not
# `positive_data_acceptance`: ids are documented as plain strings while the service refuses those outside
# ID_RULE with a 422 (api/deps.py: its Path parameters carry no pattern), a documentation gap left to report.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

EXAMPLES = 8


@schemathesis.serializer("application/vnd.apache.arrow.stream")
def _arrow(ctx, value) -> bytes:
    """Generated bodies sent as bytes (not valid Arrow: the service must refuse them with a JSON 4xx)."""
    return value if isinstance(value, bytes) else str(value).encode()


def test_api(shared_service):
    schema = schemathesis.openapi.from_url(f"{shared_service.url}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS)

        try:
            check()
        except Exception as exc:  # noqa: BLE001  (every operation's failure is collected, then reported)
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
