"""Bearer tokens and roles: who may call which route, for which runs.

Tokens come from `REPLAY_TOKENS_FILE`, one `token role [run-prefix]` per line (`#` starts a comment);
roles are `read` < `write` < `admin` (each implies the ones before it); a run prefix limits the token to
runs whose id starts with it. The file is read once, at start-up (restart to change it).

`authorize` is installed on every router in the app factory. It finds the route's `Need` in one table
(`ROUTE_NEEDS`, else by method: GET/HEAD read, POST write, DELETE admin), answers 401 for a missing or
unknown token and 403 for a wrong role or a run outside the token's prefix, and sets the caller as the
store's acting writer (`replay_service.ownership`). Where a route's run is not in its path it says where
it is: a trainer body names runs per sequence (checked here: FastAPI has parsed the body before it solves
dependencies), an ingest body's Arrow metadata (checked by the store once decoded, before anything is
stored). `/healthz` is open (liveness probes carry no token); so are the API docs (`/docs`,
`/openapi.json`: the schema is public code, no data) and the web view's files (the page loads, its API
calls need a token). `/metrics` needs a read token (Prometheus scrapes with `authorization:`).

Without a tokens file nothing is checked: the service then listens on loopback only (`cli serve`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from replay_format import valid_id
from replay_service.errors import Forbidden, Unauthenticated
from replay_service.ownership import Actor, acting


class Role(enum.StrEnum):
    """What a token may do; each role implies the ones before it."""

    READ = "read"
    WRITE = "write"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        """Order of the roles: read 0, write 1, admin 2."""
        return list(Role).index(self)


class RunsIn(enum.StrEnum):
    """Where a route names the runs it touches (what a token's run prefix is checked against)."""

    PATH = "path"  # the `{run}` path parameter
    TRAINER_BODY = "trainer body"  # `sequences[].run` of a JSON body
    INGEST_BODY = "ingest body"  # the Arrow body's metadata: the store checks it once decoded
    NONE = "none"  # no run (or every run): refused to a token limited to a run prefix


@dataclass(frozen=True)
class Need:
    """What a route needs: a role (None: open to anyone) and where its runs are."""

    role: Role | None
    runs: RunsIn = RunsIn.PATH


OPEN = Need(None, RunsIn.NONE)
BY_METHOD = {"GET": Role.READ, "HEAD": Role.READ, "POST": Role.WRITE, "PUT": Role.WRITE, "PATCH": Role.WRITE,
             "DELETE": Role.ADMIN}

# Every route whose need is not its method's default, and every POST/PUT/PATCH (those may read, write or
# administer: tests/test_service_auth.py refuses one missing here, so no new one is write-by-accident).
ROUTE_NEEDS: dict[tuple[str, str], Need] = {
    ("GET", "/healthz"): OPEN,
    ("GET", "/metrics"): Need(Role.READ, RunsIn.NONE),
    ("GET", "/v1/runs"): Need(Role.READ, RunsIn.NONE),
    ("POST", "/v1/ingest"): Need(Role.WRITE, RunsIn.INGEST_BODY),
    ("POST", "/v1/runs/{run}/requests/{request}/finish"): Need(Role.WRITE),
    ("POST", "/v1/runs/{run}/requests/{request}/routes"): Need(Role.WRITE),
    ("POST", "/v1/runs/{run}/responses/sglang"): Need(Role.WRITE),  # stores each item of an engine's answer
    ("POST", "/v1/runs/{run}/responses/vllm"): Need(Role.WRITE),  # stores each choice of a vLLM answer
    ("POST", "/v1/runs/{run}/references"): Need(Role.WRITE),
    ("POST", "/v1/runs/{run}/routes/batch"): Need(Role.READ),  # a read with a body (many request ids)
    ("POST", "/v1/runs/{run}/routes/trajectory"): Need(Role.READ),  # a read with a body (its turns)
    ("POST", "/v1/runs/{run}/compare"): Need(Role.WRITE),  # stores the comparison (disk, listed to readers)
    ("POST", "/v1/runs/{run}/health"): Need(Role.READ),  # a read with a body (a training batch's requests)
    ("PUT", "/v1/runs/{run}/health/thresholds"): Need(Role.WRITE),  # the run's own policy, set by its trainer
    ("DELETE", "/v1/runs/{run}/health/thresholds"): Need(Role.WRITE),
    ("POST", "/v1/trainer/megatron"): Need(Role.READ, RunsIn.TRAINER_BODY),
    ("POST", "/v1/trainer/verl"): Need(Role.READ, RunsIn.TRAINER_BODY),
    ("PUT", "/v1/runs/{run}/pin"): Need(Role.ADMIN),  # retention: what may be deleted is the operator's call
    ("DELETE", "/v1/runs/{run}/pin"): Need(Role.ADMIN),
    ("DELETE", "/v1/runs/{run}"): Need(Role.ADMIN),
}


def need_of(method: str, path: str) -> Need:
    """The need of route `path` (its template) called with `method`: the table's, else the method's default."""
    need = ROUTE_NEEDS.get((method, path))
    if need is not None:
        return need
    if method not in BY_METHOD:
        raise KeyError(f"no role for {method} {path}: add it to ROUTE_NEEDS")
    return Need(BY_METHOD[method], RunsIn.NONE if "{run}" not in path else RunsIn.PATH)


@dataclass(frozen=True)
class Grant:
    """One line of the tokens file, kept as the token's SHA-256 (compared in constant time)."""

    digest: bytes
    role: Role
    run_prefix: str

    @property
    def actor(self) -> Actor:
        """The caller this token makes: owner named by a digest prefix (stable across restarts, not the secret)."""
        return Actor(f"token:{self.digest.hex()[:16]}", self.role == Role.ADMIN, self.run_prefix)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load_tokens(path: Path) -> list[Grant]:
    """The grants of a tokens file; ValueError naming the file and line of the first bad one."""
    grants: list[Grant] = []
    seen: set[bytes] = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) not in (2, 3):
            raise ValueError(f"{where}: expected `token role [run-prefix]`, got {len(words)} words")
        token, role = words[0], words[1]
        if role not in Role.__members__.values():
            raise ValueError(f"{where}: role {role!r} is not one of {', '.join(Role)}")
        if len(token) < 16:
            raise ValueError(f"{where}: a token must be at least 16 characters (e.g. `openssl rand -hex 24`)")
        prefix = words[2] if len(words) == 3 else ""
        if prefix and not valid_id(prefix):
            raise ValueError(f"{where}: run prefix {prefix!r} is not a valid id prefix")
        digest = _digest(token)
        if digest in seen:
            raise ValueError(f"{where}: this token is listed twice")
        seen.add(digest)
        grants.append(Grant(digest, Role(role), prefix))
    if not grants:
        raise ValueError(f"{path}: no tokens (one `token role [run-prefix]` per line)")
    return grants


class Authenticator:
    """The tokens of a service (None: no tokens file, nothing checked)."""

    def __init__(self, grants: list[Grant] | None) -> None:
        self.grants = grants

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        """The tokens of `path`, or an open service for None."""
        return cls(load_tokens(path) if path is not None else None)

    def grant_of(self, header: str | None) -> Grant:
        """The grant of an `Authorization: Bearer` header; Unauthenticated when missing or unknown."""
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("this service needs a bearer token (header `Authorization: Bearer <token>`); "
                                  "its operator lists tokens in REPLAY_TOKENS_FILE")
        digest = _digest(token.strip())
        found = None
        for grant in self.grants or ():  # every grant compared, in constant time each: no early answer
            if hmac.compare_digest(digest, grant.digest):
                found = grant
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found


def trainer_runs(body: bytes) -> list[str]:
    """The run ids a trainer body's sequences name (none for a body that does not parse: validation refuses it)."""
    try:
        doc = json.loads(body)
        return [str(s["run"]) for s in doc["sequences"] if isinstance(s, dict) and "run" in s]
    except (ValueError, KeyError, TypeError):
        return []


async def authorize(request: Request) -> None:
    """Every route's gate: 401/403 as the route's `Need` says; sets the caller as the acting writer."""
    auth: Authenticator = request.app.state.auth
    if auth.grants is None:
        return
    route = request.scope.get("route")
    need = need_of(request.method, getattr(route, "path", request.url.path))
    if need.role is None:
        return
    grant = auth.grant_of(request.headers.get("authorization"))
    if grant.role.rank < need.role.rank:
        raise Forbidden(f"{request.method} {getattr(route, 'path', '')} needs a {need.role} token; "
                        f"this one is {grant.role}")
    actor = grant.actor
    if actor.run_prefix:
        if need.runs == RunsIn.NONE:
            raise Forbidden(f"this token is limited to runs whose id starts with {actor.run_prefix!r}; "
                            "this route covers every run")
        if need.runs == RunsIn.PATH:
            actor.require_run(request.path_params.get("run", ""))
        elif need.runs == RunsIn.TRAINER_BODY:
            for run in trainer_runs(await request.body()):  # the body FastAPI already read (cached)
                actor.require_run(run)
    # Set in this request's task: the endpoint (and the threads it runs work in) see it; the next request
    # on the connection runs in a new task with a fresh context.
    acting.set(actor)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def listen_refusal(host: str, tokens_file: Path | None, insecure: bool) -> str | None:
    """Why `serve` must not listen on `host`, None when it may: without tokens, loopback only unless --insecure."""
    if tokens_file is not None or insecure or is_loopback(host):
        return None
    return (f"refusing to listen on {host} without authentication: set REPLAY_TOKENS_FILE (or --tokens-file) to "
            "a file of `token role [run-prefix]` lines, or pass --insecure to let anyone who reaches the port "
            "read, write and delete every run")
