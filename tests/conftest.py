from __future__ import annotations

import pytest

from replay_service.service_process import ServiceProcess


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
