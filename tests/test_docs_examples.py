"""Every code example in README.md and docs/ runs, or says why it does not.

A fenced block in a language that runs (python, bash, sh, shell, console) is executed against a real service
holding the demo run (`serve --demo`, the data `scripts/serve.sh` loads), unless the HTML comment on the line
right above its fence says `<!-- not run: REASON -->` with a reason. `<!-- run: continues -->` runs a block after
the page's previous run block, in one process (a walk-through split by prose). Python runs in this interpreter
with the checkout on its path; shell blocks run in bash with `-e` and the test environment's PATH. The service's
address replaces `http://127.0.0.1:8470` (what `serve.sh` listens on) and `REPLAY_URL` is set to it. A block
that exits non-zero, or times out, fails its page's test, naming the block's first line. Installers and container
engines (pip, apt-get, docker, podman, sudo) are not run from a page: a block using one fails until marked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.markdown import Block, blocks_of
from tests.support.service import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
DEFAULT_URL = "http://127.0.0.1:8470"


def pages() -> list[Path]:
    """README.md and every markdown page of the docs site (docs/), sorted."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks_of(page.read_text(), page.relative_to(ROOT).as_posix()) if b.lang in RUNS]


def test_blocks_are_found_with_their_markers():
    text = ("# t\n\n<!-- not run: needs a GPU -->\n```bash\nvllm serve x\n```\n\n```python\nprint(1)\n```\n"
            "<!-- run: continues -->\n```python\nprint(2)\n```\n\n````md\n```python\nnot code\n```\n````\n"
            "<!-- not run: -->\n```sh\nfalse\n```\n")
    got = blocks_of(text, "t.md")
    assert [(b.lang, b.line, b.not_run, b.continues) for b in got] == [
        ("bash", 4, "needs a GPU", False), ("python", 8, None, False), ("python", 12, None, True),
        ("md", 16, None, False), ("sh", 22, "", False)]
    assert got[3].code == "```python\nnot code\n```\n"


@pytest.fixture(scope="module")
def demo_service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("docs") / "replay-data", demo=True) as service:
        yield service


REFUSED = ("pip", "pip3", "apt-get", "docker", "podman", "sudo")


def _refusing(folder: Path) -> Path:
    """A folder of commands that refuse to run from a page (first on PATH): a block installing packages or starting
    containers is marked `not run`, never run by the suite."""
    folder.mkdir(exist_ok=True)
    for name in REFUSED:
        (folder / name).write_text(f"#!/bin/sh\necho 'a docs example ran {name}: mark its block not run' >&2\n"
                                   "exit 97\n")
        (folder / name).chmod(0o755)
    return folder


def _run(blocks: list[Block], url: str, cwd: Path) -> subprocess.CompletedProcess:
    lang = RUNS[blocks[0].lang]
    code = "\n".join(b.code for b in blocks).replace(DEFAULT_URL, url)
    path = os.pathsep.join([str(_refusing(cwd / ".refused")), str(Path(sys.executable).parent),
                            os.environ.get("PATH", "")])
    env = {**os.environ, "REPLAY_URL": url, "PYTHONPATH": str(ROOT), "PATH": path}
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-e", "-c", code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages()])
def test_every_example_of_the_page_runs_or_says_why_not(page, demo_service, tmp_path):
    blocks = runnable(ROOT / page)
    unexplained = [b.where for b in blocks if b.not_run == ""]
    assert not unexplained, f"`not run` without a reason: {unexplained}"
    groups: list[list[Block]] = []
    for b in blocks:
        if b.not_run is not None:
            continue
        if b.continues and groups and RUNS[groups[-1][-1].lang] == RUNS[b.lang]:
            groups[-1].append(b)
        else:
            groups.append([b])
    failed = []
    for group in groups:
        done = _run(group, demo_service.url, tmp_path)
        if done.returncode != 0:
            failed.append(f"{group[0].where}: exit {done.returncode}\n{(done.stdout + done.stderr)[-1500:]}")
    assert not failed, "\n\n".join(failed)
