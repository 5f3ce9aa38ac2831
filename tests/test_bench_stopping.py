"""A benchmark stopped by SIGTERM (`timeout`, a scheduler) stops its service and removes its data, as on Ctrl-C.

A child shaped as every `bench/` script (a `with` over a temporary folder and a real service) is sent SIGTERM.
With `bench.stopping.exit_on_sigterm` (what each script's `__main__` calls) it exits 143 through its `with` blocks:
the service process is gone and the folder removed. Without it (the scripts before) Python dies at once: the
service runs on and the folder stays. Those leftovers, 0.6-0.8 GB each, once filled the machine's disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, {root!r})
from bench.stopping import exit_on_sigterm
from tests.support.service import ServiceProcess
if {handled}:
    exit_on_sigterm()
with tempfile.TemporaryDirectory(prefix="bench-stopping-") as tmp, ServiceProcess(Path(tmp) / "data") as service:
    print(tmp, service.proc.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("handled", [True, False], ids=["exit_on_sigterm", "python-default"])
def test_sigterm_stops_the_service_and_removes_the_data(handled):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT), handled=handled)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    tmp, pid = None, None
    try:
        tmp, pid_text = child.stdout.readline().split()
        pid = int(pid_text)
        assert Path(tmp).is_dir() and _alive(pid)
        child.send_signal(signal.SIGTERM)
        rc = child.wait(60)
        if handled:
            assert rc == 128 + signal.SIGTERM
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid), "the service outlived the benchmark"
            assert not Path(tmp).exists(), "the benchmark's data was left behind"
        else:  # what the scripts did before: both left behind
            assert rc == -signal.SIGTERM and _alive(pid) and Path(tmp).is_dir()
    finally:
        if child.poll() is None:
            child.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
