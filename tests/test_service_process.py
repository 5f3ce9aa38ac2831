"""The tests' own service harness (tests/support/service.py): a port it chose and found taken is not a failure.

`free_port` closes the port it found before the service binds it; under a whole-suite run (two files at a time, each
starting services and opening connections) another process took it in between twice in one run (2026-12-06: two
services exited with "[Errno 98] Address already in use"). The first start then moves to another port; a port the
test named stays a failure, as does a restart's (it keeps the address it had).
"""

from __future__ import annotations

import socket

import pytest

from replay_client import ReplayClient
from tests.support.service import ServiceProcess, free_port


def _taken(port: int) -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_chosen_port_taken_before_the_start_moves_the_service_to_another(tmp_path):
    service = ServiceProcess(tmp_path / "data", env={"REPLAY_FSYNC": "false"})
    chosen = service.port
    with _taken(chosen), service, ReplayClient(service.url) as client:
        assert service.port != chosen
        assert client.runs() == []


def test_a_port_the_test_named_stays_its_own(tmp_path):
    with _taken(free_port()) as holder:
        named = ServiceProcess(tmp_path / "named", port=holder.getsockname()[1])
        with pytest.raises(RuntimeError, match=r"\[Errno 98\]"), named:
            pass
