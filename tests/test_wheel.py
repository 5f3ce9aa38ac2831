"""The wheel is the whole product: built from the checkout and installed (not editable) into a bare environment,
`replay-service serve` answers the web view, its scripts and /healthz, and `--version` says the release.

The bare environment is a fresh venv with the wheel alone; the dependencies (numpy, FastAPI, ...) are the
project venv's, seen through one .pth line added after the install, so nothing is downloaded. Neither the
checkout nor its editable install is on that environment's path (asserted, not assumed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.service import ServiceProcess, calls

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"  # the sources
SHIPPED = Path("replay_service", "web")  # where the wheel carries them (setup.py's build step)
# what a clean clone lacks: the venv, caches, build output, data (and .git: the build never reads it)
NOT_SOURCE = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "replay-data")
ENV = {"PYTHONPATH": ""}  # an empty PYTHONPATH adds nothing to sys.path


def run(*cmd, cwd: Path, timeout: float = 120) -> str:
    """Run a command; its stdout, or a failure carrying its output."""
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV})
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a clean copy of the checkout (an in-tree build would reuse a stale build/ folder)."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out / "dist", source,
        cwd=out)
    (found,) = (out / "dist").glob("routing_replay-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel alone (no pip, no editable install), then the project venv's packages."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=venv)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv).strip())
    deps = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "project-dependencies.pth").write_text("".join(f"{d}\n" for d in deps))  # after the install
    return venv


def test_the_wheel_carries_the_web_view_and_the_entry_points(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = z.read(entry_points).decode()
    sources = [p for p in WEB.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    web = {(SHIPPED / p.relative_to(WEB)).as_posix() for p in sources}
    assert (SHIPPED / "index.html").as_posix() in web and not web - names, f"left out of the wheel: {web - names}"
    assert not [n for n in names if n.startswith("web/")], "the web view must ship inside replay_service, not as web/"
    assert re.search(r"^replay-service = replay_service\.\S+:app$", scripts, flags=re.M), scripts
    assert re.search(r"^routing_replay = capture\.vllm:register$", scripts, flags=re.M), scripts


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    probe = ("import json, sys, importlib, importlib.metadata as md; "  # every package the wheel installs
             "tops = md.distribution('routing-replay').read_text('top_level.txt').split(); "
             "mods = {p: importlib.import_module(p).__file__ for p in tops}; "
             "print(json.dumps({'files': mods, 'path': sys.path, 'version': md.version('routing-replay'), "
             "'dist': str(md.distribution('routing-replay')._path), "
             "'finders': [f.__module__ for f in sys.meta_path]}))")
    seen = json.loads(run(installed / "bin" / "python", "-c", probe, cwd=tmp_path))
    venv = installed.resolve()
    assert set(seen["files"]) == {"replay_format", "replay_service", "replay_client", "capture"}, seen["files"]
    for package, file in seen["files"].items():
        assert Path(file).resolve().is_relative_to(venv), f"{package} imported from {file}, not the wheel"
    assert Path(seen["dist"]).resolve().is_relative_to(venv), seen["dist"]
    assert not [p for p in seen["path"] if p and Path(p).resolve() == ROOT], seen["path"]  # not the checkout
    assert not [f for f in seen["finders"] if "editable" in f.lower()], seen["finders"]  # not its editable install
    assert seen["version"] == version("routing-replay")


def test_the_installed_wheel_serves_the_web_view(installed, tmp_path):
    cli = installed / "bin" / "replay-service"
    assert run(cli, "--version", cwd=tmp_path).strip() == f"routing-replay {version('routing-replay')}"
    elsewhere = tmp_path / "elsewhere"  # a working directory with no web/ and no packages in it
    elsewhere.mkdir()
    with ServiceProcess(tmp_path / "data", program=[str(cli)], cwd=elsewhere, env=ENV, workers=0) as service:
        index = calls.get(f"{service.url}/", timeout=10)
        assert index.status_code == 200 and "text/html" in index.headers["content-type"], index.text[:300]
        scripts = re.findall(r'<script[^>]*\ssrc="([^"]+\.js)"', index.text)
        assert scripts, index.text
        script = calls.get(f"{service.url}/{scripts[0]}", timeout=10)
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert script.content == (WEB / scripts[0]).read_bytes()
        health = calls.get(f"{service.url}/healthz", timeout=10).json()
        assert health["status"] == "ok" and health["version"] == version("routing-replay"), health


def test_a_checkout_run_without_installing_says_its_version_is_unknown(tmp_path):
    """The lent device machine runs a copy of the checkout from PYTHONPATH, with no distribution installed and no
    egg-info (2026-12-06: the import raised PackageNotFoundError there and its bench could not start). `-S` hides
    this venv's install; the package is copied without the checkout's egg-info."""
    shutil.copytree(ROOT / "replay_service", tmp_path / "replay_service", ignore=shutil.ignore_patterns("__pycache__"))
    said = subprocess.run([sys.executable, "-S", "-c", "import replay_service; print(replay_service.__version__)"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert said.returncode == 0 and said.stdout.strip() == "0+unknown", said.stderr
