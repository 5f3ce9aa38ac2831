"""The boundaries in pyproject.toml's [tool.importlinter] hold, and the checker breaks on a planted violation.

`lint-imports` (import-linter) reads the imports of the packages statically: nothing is imported. It runs in a
child process in the tree it checks, so a copy is checked as the copy, not as the installed checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES: list[str] = CONFIG["root_packages"]
NAMES: dict[str, str] = {c["id"]: c["name"] for c in CONFIG["contracts"]}
LINT = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> tuple[int, str]:
    """`lint-imports` run in `tree` (its pyproject.toml, its packages): exit status and report."""
    env = {**os.environ, "COLUMNS": "1000"}  # one line per contract, never wrapped
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(LINT), "--no-cache", "--no-logo"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def broken(report: str) -> set[str]:
    """The ids of the contracts the report calls BROKEN."""
    return {cid for cid, name in NAMES.items() if re.search(rf"^{re.escape(name)} BROKEN$", report, flags=re.M)}


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the packages and pyproject.toml, nothing else."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def plant(tree: Path, module: str, line: str) -> None:
    """Append an import to one module of the copy, as a careless edit would."""
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_checkout_keeps_every_contract():
    status, report = lint(ROOT)
    assert status == 0, report
    assert not broken(report) and f"Contracts: {len(NAMES)} kept, 0 broken." in report


@pytest.mark.parametrize(("module", "line", "contract", "chain"), [
    ("replay_service.errors", "from replay_client import ReplayClient",
     "service-not-client", "replay_service.errors -> replay_client"),
    ("capture.vllm.engine_core.scheduler", "import capture.vllm.worker",
     "engine-core-not-worker", "capture.vllm.engine_core.scheduler -> capture.vllm.worker"),
    ("replay_service.store.runs", "from replay_service.ingest.result import IngestResult",
     "store-not-ingest", "replay_service.store.runs -> replay_service.ingest.result"),
    ("replay_service.store.segments.places", "from replay_service.store.segments.write import write_segment",
     "segment-file-floors", "replay_service.store.segments.places -> replay_service.store.segments.write"),
], ids=["service-imports-client", "engine-core-imports-worker", "store-imports-ingest", "segment-places-import-writer"])
def test_a_planted_import_breaks_its_contract(tree, module, line, contract, chain):
    before = broken(lint(tree)[1])  # the checkout's own state (empty once every contract holds)
    plant(tree, module, line)
    status, report = lint(tree)
    assert status == 1, report
    assert contract in broken(report) - before, report
    assert f"{chain} (l." in report, report  # the report names the planted import and its line
