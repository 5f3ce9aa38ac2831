"""The container path run for real: the image built from this checkout with podman, and the compose file brought up.

The image is built once per test session on a Debian base made here from Debian packages
(scripts/container_base.sh, which the test script's install runs: no registry is reachable), with podman set up
by deploy/podman/containers.conf (runc, no default ulimits). The compose file's default service is brought up
with podman-compose on a free port with a tokens file of the test's own; its named volume is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import pytest

from replay_client import ReplayClient
from tests.support.data import batch_bytes, routes
from tests.support.service import calls, free_port

ROOT = Path(__file__).resolve().parent.parent
BASE = "localhost/routing-replay-base:bookworm"
IMAGE = "localhost/routing-replay:latest"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # a TLS-intercepting proxy's CA, when the host trusts one
TOKENS = {"admin": "admin-token-0123456789abcdef", "write": "write-token-0123456789abcdef",
          "read": "read-token-0123456789abcdef0"}
PROJECT = "replaytest"


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy" / "podman" / "containers.conf")}


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, check=check,
                          timeout=timeout)


@pytest.fixture(scope="session")
def image() -> str:
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        if os.environ.get("REPLAY_REQUIRE_ALL") == "1":
            raise RuntimeError("podman and mmdebstrap are not installed (scripts/env.sh installs them)")
        pytest.skip("podman and mmdebstrap are not installed")
    subprocess.run(["bash", "scripts/container_base.sh", BASE], cwd=ROOT, env=podman_env(), check=True, timeout=600)
    secret = ["--secret", f"id=pip-ca,src={CA_BUNDLE}"] if CA_BUNDLE.is_file() else []
    podman("build", "--quiet", "--format", "docker", "--build-arg", f"BASE={BASE}", *secret, "-t", IMAGE, str(ROOT))
    return IMAGE


def test_the_image_runs_the_built_wheel_as_an_unprivileged_user(image):
    script = ("id -u; stat -c %U /data; test ! -e /app && test ! -e /src && echo no-checkout; python3 -c \""
              "import importlib.metadata as m, replay_service.app as a; d = m.distribution('routing-replay'); "
              "print(d.version); print(d.read_text('direct_url.json')); print((a.WEB_DIR / 'index.html').is_file())\"")
    out = podman("run", "--rm", image, "sh", "-c", script).stdout.split("\n")
    assert out[0] == "10001" and out[1] == "replay" and out[2] == "no-checkout", out
    assert '"archive_info"' in out[4] and "editable" not in out[4], out  # installed from the wheel, not -e
    assert out[5] == "True", out  # the web view came with the wheel


def test_the_image_refuses_to_start_without_its_tokens(image):
    done = podman("run", "--rm", image, check=False, timeout=120)
    assert done.returncode != 0
    assert "tokens file" in done.stderr + done.stdout


def _compose(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman-compose", "-f", str(ROOT / "docker-compose.yml"), "-p", PROJECT, *args],
                          env=env, capture_output=True, text=True, timeout=300, check=check)


def _up(url: str, env: dict[str, str]) -> None:
    _compose("up", "-d", "replay-service", env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if calls.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    logs = podman("logs", f"{PROJECT}_replay-service_1", check=False).stderr
    raise AssertionError(f"the composed service did not answer /healthz: {logs[-2000:]}")


@pytest.fixture
def composed(image, tmp_path):
    tokens = tmp_path / "replay-tokens"
    tokens.write_text("".join(f"{token} {role}\n" for role, token in TOKENS.items()))
    tokens.chmod(0o600)
    os.chown(tokens, 10001, -1)  # the image's user reads it (docs/operating/docker.md)
    port = free_port()
    env = {**podman_env(), "REPLAY_PORT": str(port), "REPLAY_TOKENS_FILE_HOST": str(tokens)}
    url = f"http://127.0.0.1:{port}"
    try:
        _up(url, env)
        yield url, env
    finally:
        _compose("down", "-v", env=env, check=False)


def test_compose_serves_with_tokens_and_keeps_routes_on_its_volume_across_a_restart(composed):
    url, env = composed
    assert calls.get(f"{url}/healthz").json()["version"] == version("routing-replay")  # this checkout's wheel
    assert calls.get(f"{url}/v1/runs").status_code == 401
    assert calls.get(f"{url}/").text.lstrip().lower().startswith("<!doctype html")  # the web view
    sent = routes(np.random.default_rng(45), 64)
    with ReplayClient(url, token=TOKENS["write"]) as writer:
        writer.ingest(batch_bytes("docker", "w0", 0, ["r"] * 64, np.arange(64), sent))
    with ReplayClient(url, token=TOKENS["read"]) as reader:
        assert reader.get_route("docker", "r").experts.tobytes() == sent.tobytes()
    _compose("down", env=env)  # the container goes, the named volume stays
    _up(url, env)
    with ReplayClient(url, token=TOKENS["read"]) as reader:
        assert reader.get_route("docker", "r").experts.tobytes() == sent.tobytes()
