"""scripts/device_bench.sh stays runnable between the sessions that are lent a many-core machine: its options parse
and its bench imports (the machine's run itself is not part of the suite: no such machine in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_bench_parses_its_options_with_this_interpreter():
    done = subprocess.run(["bash", "scripts/device_bench.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PY": sys.executable}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--workers" in done.stdout and "--ranks" in done.stdout
