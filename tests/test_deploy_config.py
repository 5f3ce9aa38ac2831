"""docker-compose.yml and deploy/nginx/ agree with the service's settings (no Docker daemon or nginx needed).

The files are read as they ship: every variable a replica is given is one the service reads, the default
`docker compose up` still runs the one service on local files, every scale-out service waits for healthy
dependencies, nginx's body limit and both variants of its upstreams match the replicas, and podman's override
(deploy/podman/scale-out.yml) names the stand-ins scripts/container_images.sh builds. tests/test_container.py runs
them.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml

from replay_service.settings import ServiceSettings
from replay_service.store.segments import places as segment_store

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
NGINX = {name: (ROOT / "deploy" / "nginx" / name).read_text()
         for name in ("nginx.conf", "server.conf", "upstreams.conf", "upstreams-static.conf")}


class _ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: `!override` replaces a value (read here as the value it gives)."""


_ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node))
PODMAN = yaml.load((ROOT / "deploy" / "podman" / "scale-out.yml").read_text(), _ComposeLoader)["services"]
SERVICES = COMPOSE["services"]
REPLICAS = [name for name, s in SERVICES.items() if "REPLAY_INDEX_URL" in s.get("environment", {})]


def _defaults(value: object) -> str:
    """A compose value with `${VAR:-default}` read as its default (nothing set in the environment)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def test_plain_compose_up_runs_only_the_local_service():
    unprofiled = [name for name, s in SERVICES.items() if "profiles" not in s]
    assert unprofiled == ["replay-service"]
    env = SERVICES["replay-service"]["environment"]
    assert "REPLAY_INDEX_URL" not in env and "REPLAY_SEGMENTS_URL" not in env


def test_replicas_are_given_only_variables_the_service_reads():
    aws_read = set(re.findall(r'"(AWS_[A-Z0-9_]+)"', inspect.getsource(segment_store.s3_filesystem)))
    assert len(REPLICAS) == 3
    for name in REPLICAS:
        env = {key: _defaults(value) for key, value in SERVICES[name]["environment"].items()}
        for key in env:
            if key.startswith("REPLAY_"):
                assert key.removeprefix("REPLAY_").lower() in ServiceSettings.model_fields, (name, key)
            else:
                assert key in aws_read, (name, key)
        settings = ServiceSettings.model_validate({k.removeprefix("REPLAY_").lower(): v for k, v in env.items()
                                                   if k.startswith("REPLAY_")})
        assert settings.index_url and settings.index_url.startswith("postgresql://")
        assert settings.segments_url and settings.segments_url.startswith("s3://")
        store = segment_store.open_segment_store(Path("/nonexistent"), settings.segments_url)  # parses the URL
        assert store.url == settings.segments_url


def test_every_scale_out_service_waits_for_healthy_dependencies():
    for name, service in SERVICES.items():
        for dependency, how in (service.get("depends_on") or {}).items():
            target = SERVICES[dependency]
            assert target.get("profiles") == service.get("profiles"), (name, dependency)
            if how["condition"] == "service_healthy":
                assert "healthcheck" in target, dependency
            elif "scale-out" in service.get("profiles", []):
                assert how["condition"] == "service_completed_successfully", (name, dependency)
            else:  # monitoring: Grafana needs Prometheus started, not healthy (its queries wait for data)
                assert how["condition"] == "service_started", (name, dependency)
        if "scale-out" in service.get("profiles", []) and not service.get("entrypoint"):  # one-shots excepted
            assert "healthcheck" in service, name
    for name in REPLICAS:
        assert {"replay-postgres", "replay-minio", "replay-bucket"} <= set(SERVICES[name]["depends_on"])
    assert set(SERVICES["replay-lb"]["depends_on"]) == set(REPLICAS)


def test_nginx_matches_the_replicas():
    body_limit = {int(_defaults(SERVICES[name]["environment"]["REPLAY_MAX_BODY_BYTES"])) for name in REPLICAS}
    assert body_limit == {512 * 2**20}
    server = NGINX["server.conf"]
    assert "client_max_body_size 512m;" in server
    for variant in ("upstreams.conf", "upstreams-static.conf"):
        upstreams = dict(re.findall(r"upstream (\w+) \{(.*?)\}", NGINX[variant], re.S))
        assert set(upstreams) == set(re.findall(r"proxy_pass http://(\w+);", server)), variant
        for body in upstreams.values():
            servers = re.findall(r"server ([\w-]+):(\d+)", body)
            assert sorted(servers) == [(name, "8470") for name in sorted(REPLICAS)], variant
            assert (" resolve " in body) == (variant == "upstreams.conf"), variant  # nginx 1.27.3+ only
    assert "proxy_buffering off;" in server  # answers streamed
    assert re.search(r"proxy_next_upstream error timeout http_503 non_idempotent;", server)
    mounted = {volume.split(":")[1]: volume.split(":")[0] for volume in SERVICES["replay-lb"]["volumes"]}
    included = re.findall(r"include (\S+);", NGINX["nginx.conf"])
    assert set(included) | {"/etc/nginx/nginx.conf"} == set(mounted)


def test_podmans_override_runs_the_stand_ins_the_image_script_builds():
    built = (ROOT / "scripts" / "container_images.sh").read_text()
    for name, service in PODMAN.items():
        assert name in SERVICES and "scale-out" in SERVICES[name]["profiles"], name
        if "image" in service:
            part = re.fullmatch(r"localhost/routing-replay-(\w+):bookworm", service["image"]).group(1)
            assert (ROOT / "deploy" / "podman" / "images" / part / "Containerfile").is_file()
            assert "postgres nginx s3" in built
        # podman 4.3 cannot start a container that requires an exited one: nothing waits on the bucket one-shot
        assert "replay-bucket" not in service.get("depends_on", []), name
    lb_upstreams = [volume for volume in PODMAN["replay-lb"]["volumes"] if "upstreams" in volume]
    assert lb_upstreams == ["./deploy/nginx/upstreams-static.conf:/etc/nginx/replay/upstreams.conf:ro"]
