"""The README's quickstart runs as pasted, against a real service holding the demo run (what `scripts/serve.sh` loads).

The block is the ```python fence right after the `<!-- quickstart -->` marker in README.md. It reads the service's
URL from `REPLAY_URL`, defaulting to what `serve.sh` listens on, so the test sets that variable and changes nothing
else in the code. It runs in a fresh interpreter, as a reader's paste would, and its printed lines must show a
route's shape, a trainer rank's slice and the run's health verdict. A README whose block is missing, renamed or
broken fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replay_service.settings import DEFAULT_PORT
from tests.support.markdown import blocks_of
from tests.support.service import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- quickstart -->"


def quickstart_block(text: str) -> str:
    """The code of the ```python fence on the line right after the marker."""
    at = [i for i, line in enumerate(text.splitlines()) if line.strip() == MARKER]
    assert len(at) == 1, f"README.md must hold exactly one {MARKER} marker, found {len(at)}"
    block = next((b for b in blocks_of(text, "README.md") if b.line == at[0] + 2 and b.above == MARKER), None)
    assert block is not None and block.lang == "python", f"the line after {MARKER} must open a ```python fence"
    assert block.closed, "the quickstart's fence is never closed"
    return block.code


@pytest.fixture(scope="module")
def code() -> str:
    return quickstart_block((ROOT / "README.md").read_text())


def test_the_block_is_found_after_its_marker():
    text = "intro\n<!-- quickstart -->\n```python\nprint(1)\n```\n```python\nprint(2)\n```\n"
    assert quickstart_block(text) == "print(1)\n"
    with pytest.raises(AssertionError, match="must open"):
        quickstart_block("<!-- quickstart -->\n\n```python\nprint(1)\n```\n")


def test_it_defaults_to_where_serve_sh_listens(code):
    """Pasted with no variable set, the snippet talks to `bash scripts/serve.sh`'s service."""
    assert 'os.environ.get("REPLAY_URL"' in code
    assert f'"http://127.0.0.1:{DEFAULT_PORT}"' in code
    assert "--port" not in (ROOT / "scripts" / "serve.sh").read_text().split("exec ", 1)[1]


def test_it_runs_against_the_demo_run(code, tmp_path):
    with ServiceProcess(tmp_path / "replay-data", demo=True) as service:
        env = {**os.environ, "REPLAY_URL": service.url, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, f"the README's quickstart failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    out = done.stdout
    route = re.search(r"^route \((\d+), 48, 8\) clean: True$", out, re.M)
    assert route and int(route[1]) > 0, out
    rank = re.search(r"^rank slice \((\d+), 48, 8\)$", out, re.M)
    assert rank and 0 < int(rank[1]) < 2 * int(route[1]), out
    assert re.search(r"^verdict fail$", out, re.M), out
    assert re.search(r"^run 'demo' run fails routing health: .*ZERO", out, re.M), out
