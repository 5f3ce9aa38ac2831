"""The container path run for real: the image built from this checkout with podman, and the compose file brought up.

The images are built once per test session by scripts/container_images.sh (which the test script's install runs
first, so the session's build finds podman's layer cache warm): the service's image from this checkout on a Debian
base made here from Debian packages (no registry is reachable), with podman set up by
deploy/podman/containers.conf (runc, no default ulimits). The compose file's default service is brought up
with podman-compose on a free port with a tokens file of the test's own; so is its scale-out profile, with
deploy/podman/scale-out.yml's stand-ins (PostgreSQL, moto's S3 server, nginx), built by the same script. Named
volumes are removed afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import pytest

from replay_client import ReplayClient
from tests.support.data import batch_bytes, routes
from tests.support.service import calls, free_port

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "localhost/routing-replay:latest"
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
    # the Debian base, the service's image from this checkout, the scale-out stand-ins; from podman's layer cache
    # what the test script's install built, unless the checkout changed since
    subprocess.run(["bash", "scripts/container_images.sh"], cwd=ROOT, env=podman_env(), check=True, timeout=600)
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


def _compose(*args: str, env: dict[str, str], check: bool = True,
             files: tuple[str, ...] = ("docker-compose.yml",), project: str = PROJECT) -> subprocess.CompletedProcess:
    named = [arg for name in files for arg in ("-f", str(ROOT / name))]
    return subprocess.run(["podman-compose", *named, "-p", project, *args],
                          env=env, capture_output=True, text=True, timeout=300, check=check)


def _answering_healthz(url: str, wanted: int = 1, timeout: float = 120) -> set[str]:
    """Who answered /healthz 200 at `url`: the replicas nginx names (X-Replay-Replica), else the service itself;
    polled until `wanted` have or `timeout` passed. Behind nginx, a replica still starting refuses connections, and
    nginx leaves it out for 10 s after three refusals."""
    answered: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(answered) < wanted and time.monotonic() < deadline:
        try:
            answer = calls.get(f"{url}/healthz", timeout=2)
        except httpx.HTTPError:
            answer = None
        if answer is not None and answer.status_code == 200:
            answered.add(answer.headers.get("x-replay-replica", url))
        else:
            time.sleep(0.5)
    return answered


def _up(url: str, env: dict[str, str]) -> None:
    _compose("up", "-d", "replay-service", env=env)
    if not _answering_healthz(url):
        logs = podman("logs", f"{PROJECT}_replay-service_1", check=False).stderr
        raise AssertionError(f"the composed service did not answer /healthz: {logs[-2000:]}")


def _tokens_file(tmp_path: Path) -> Path:
    tokens = tmp_path / "replay-tokens"
    tokens.write_text("".join(f"{token} {role}\n" for role, token in TOKENS.items()))
    tokens.chmod(0o600)
    os.chown(tokens, 10001, -1)  # the image's user reads it (docs/operating/docker.md)
    return tokens


@pytest.fixture
def composed(image, tmp_path):
    port = free_port()
    env = {**podman_env(), "REPLAY_PORT": str(port), "REPLAY_TOKENS_FILE_HOST": str(_tokens_file(tmp_path))}
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


SCALE_OUT = ("docker-compose.yml", "deploy/podman/scale-out.yml")
SCALE_PROJECT = "replaytestscale"


@pytest.fixture
def scaled_out(image, tmp_path):
    """The scale-out profile with podman's stand-ins, brought up through its load balancer on a free port."""
    port = free_port()
    env = {**podman_env(), "REPLAY_LB_PORT": str(port), "REPLAY_PORT": str(free_port()),
           "REPLAY_TOKENS_FILE_HOST": str(_tokens_file(tmp_path)),
           "REPLAY_WORKERS": "1"}  # three replicas on two cores: one worker each (all three answer in ~15 s, not ~26)
    url = f"http://127.0.0.1:{port}"
    compose = functools.partial(_compose, env=env, files=SCALE_OUT, project=SCALE_PROJECT)
    try:
        compose("--profile", "scale-out", "up", "-d", "replay-lb")
        if len(_answering_healthz(url, wanted=3)) < 3:
            logs = podman("logs", f"{SCALE_PROJECT}_replay-1_1", check=False).stderr
            raise AssertionError(f"not every replica answered /healthz through nginx: {logs[-2000:]}")
        yield url
    finally:
        compose("--profile", "scale-out", "down", "-v", check=False)


@contextlib.contextmanager
def _through_nginx(url: str, token: str) -> Iterator[tuple[ReplayClient, list[str]]]:
    """A client through nginx, and the replicas (X-Replay-Replica) that answered its calls, in order."""
    answered: list[str] = []
    with httpx.Client(base_url=url, timeout=60, event_hooks={
            "response": [lambda response: answered.append(response.headers["x-replay-replica"])]}) as http:
        yield ReplayClient(url, http=http, token=token), answered


def test_scale_out_replicas_behind_nginx_serve_what_another_stored(scaled_out):
    """Three replicas on the PostgreSQL stand-in and the S3 stand-in, each with a volume of its own: a batch
    written through one is read, byte-equal, through each of the other two."""
    replicas = _answering_healthz(scaled_out, wanted=3)  # three, each answering on its own address
    sent = routes(np.random.default_rng(451), 64)
    with _through_nginx(scaled_out, TOKENS["write"]) as (writer, wrote):
        writer.ingest(batch_bytes("scaled", "w0", 0, ["r"] * 64, np.arange(64), sent))
    with _through_nginx(scaled_out, TOKENS["read"]) as (reader, read):
        for _ in range(3):  # round robin: one read from each replica
            assert reader.get_route("scaled", "r").experts.tobytes() == sent.tobytes()
    assert set(read) == replicas and len(replicas - set(wrote)) == 2  # the two that did not store it among them
    healthz = [calls.get(f"{scaled_out}/healthz") for _ in range(3)]
    assert [(answer.status_code, answer.json().get("runs")) for answer in healthz] == [(200, 1)] * 3, [
        (answer.headers.get("x-replay-replica"), answer.text) for answer in healthz]
