from __future__ import annotations

import os

import pytest

# The README's test command sets this: there every package and the browser are installed,
# so a test skipped for a missing one is a broken set-up, not a pass.
REQUIRE_ALL = os.environ.get("REPLAY_REQUIRE_ALL") == "1"


def pytest_collectreport(report):
    if REQUIRE_ALL and report.skipped:
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"

from tests.support.service import ServiceProcess


@pytest.fixture
def service(tmp_path):
    """A fresh service process with its own data directory."""
    with ServiceProcess(tmp_path / "data") as proc:
        yield proc


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory):
    """One service process for a module's read-mostly tests (each test uses its own run id)."""
    with ServiceProcess(tmp_path_factory.mktemp("shared") / "data") as proc:
        yield proc
