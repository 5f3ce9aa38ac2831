"""Bearer tokens and roles: who may call which route, for which runs.

Tokens come from `REPLAY_TOKENS_FILE`, one `token role [run-prefix]` per line; roles are `read` < `write` < `admin`,
and a run prefix limits a token to runs whose id starts with it. `Tokens` holds them: `reload` (the admin call, or
SIGHUP to `serve`) switches every process at once, only to a file that parses; `serve`'s workers hold their parent's
snapshot (`Tokens.share`). `authorize`, on every router, finds the route's `Need` (`ROUTE_NEEDS`, else by method),
answers 401 (no or unknown token) or 403 (wrong role, run outside the prefix) and sets the store's acting writer.
Without a tokens file nothing is checked, and `serve` listens on loopback only unless `--insecure` (`listen_refusal`).

Design: docs/design/service_workers.md.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import hmac
import ipaddress
import json
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
    ("POST", "/v1/admin/reload-tokens"): Need(Role.ADMIN, RunsIn.NONE),  # the tokens of every run
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
    """One generation of a service's tokens (None: no tokens file, nothing checked)."""

    def __init__(self, grants: list[Grant] | None) -> None:
        self.grants = grants

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


NO_TOKENS_FILE = "this service has no tokens file (REPLAY_TOKENS_FILE) and checks no tokens: start it with one"


@dataclass(frozen=True)
class Reloaded:
    """What a reload switched the service to: its generation, how many tokens, read from which file."""

    generation: int
    tokens: int
    source: Path


class Tokens:
    """The tokens of a service, the same in each of its processes, switched everywhere at once by `reload`.

    In memory for one process (`load`). Under `serve`'s workers, a snapshot in the parent's shared folder (`share` in
    the parent, `attach` in each worker): the grants as a JSON file (digests, never tokens), replaced whole by a
    reload, beside a generation word every process maps; `current` compares the word per request (a memory read)
    and reads the snapshot again only when it moved. A reload holds an exclusive `flock` on the word's file, so
    reloads through several workers and the parent's SIGHUP take turns.
    """

    def __init__(self, source: Path | None, grants: list[Grant] | None, generation: int = 1,
                 path: Path | None = None) -> None:
        """Tokens read from `source` (None: an open service), in memory, or attached to the snapshot at `path`."""
        self.source = source
        self.path = path
        self._held = (generation, Authenticator(grants))
        self._lock = threading.RLock()  # a SIGHUP's reload may interrupt the main thread inside one
        self._fd: int | None = None
        self._word: memoryview | None = None
        if path is not None:
            self._fd = os.open(_word_file(path), os.O_RDWR)
            self._word = memoryview(mmap.mmap(self._fd, _WORD_BYTES)).cast("Q")  # one aligned 8-byte load or store

    @classmethod
    def load(cls, source: Path | None) -> Tokens:
        """The tokens of the file `source` (None: an open service), in memory; OSError for a file that cannot be read,
        ValueError naming the line for one that does not parse."""
        return cls(source, load_tokens(source) if source is not None else None)

    @classmethod
    def attach(cls, path: Path) -> Tokens:
        """The shared snapshot at `path` (`share` made it), as every other process of the service holds it."""
        source, generation, grants = _read_snapshot(path)
        return cls(source, grants, generation, path)

    def share(self, path: Path) -> Tokens:
        """These tokens as a new shared snapshot at `path` (and its generation word beside it), attached: what
        `serve`'s parent makes before it starts its workers."""
        generation, auth = self._held
        _write_snapshot(path, self.source, auth.grants, generation)
        _word_file(path).write_bytes(generation.to_bytes(_WORD_BYTES, sys.byteorder))
        return Tokens.attach(path)

    @property
    def generation(self) -> int:
        """The generation in force: 1 at start, one more per reload."""
        return self._word[0] if self._word is not None else self._held[0]

    def current(self) -> Authenticator:
        """The tokens in force now, whichever process switched them last."""
        generation, auth = self._held
        if self._word is not None and self._word[0] != generation:
            assert self.path is not None
            _, generation, grants = _read_snapshot(self.path)
            auth = Authenticator(grants)
            self._held = (generation, auth)
        return auth

    def reload(self) -> Reloaded:
        """Read the tokens file again and, only when every line parses, switch every process of the service to it:
        from the return on, each request anywhere is checked against it. ValueError naming the file (and the line)
        when it cannot be read or does not parse, when the workers' snapshot cannot be written, or when the service
        has no tokens file; the tokens in force then stay."""
        if self.source is None:
            raise ValueError(NO_TOKENS_FILE)
        with self._lock, _locked(self._fd):
            try:
                grants = load_tokens(self.source)
            except OSError as exc:
                raise ValueError(f"{self.source}: {exc.strerror or exc}") from None
            if self._word is None:
                generation = self._held[0] + 1
                self._held = (generation, Authenticator(grants))
            else:
                assert self.path is not None
                generation = self._word[0] + 1
                try:
                    _write_snapshot(self.path, self.source, grants, generation)  # whole, before the word moves
                except OSError as exc:  # the shared folder removed under the service, a full disk
                    raise ValueError(f"the workers' snapshot {self.path}: {exc.strerror or exc}") from None
                self._word[0] = generation
        return Reloaded(generation, len(grants), self.source)


_WORD_BYTES = 8


def _word_file(path: Path) -> Path:
    return path.with_name(path.name + ".generation")


@contextmanager
def _locked(fd: int | None) -> Iterator[None]:
    """An exclusive flock on `fd` (none in memory); the kernel drops it with a killed process."""
    if fd is None:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _write_snapshot(path: Path, source: Path | None, grants: list[Grant] | None, generation: int) -> None:
    doc = {"generation": generation, "source": None if source is None else str(source),
           "grants": None if grants is None else [[g.digest.hex(), g.role.value, g.run_prefix] for g in grants]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _read_snapshot(path: Path) -> tuple[Path | None, int, list[Grant] | None]:
    doc = json.loads(path.read_text())
    grants = doc["grants"]
    return (None if doc["source"] is None else Path(doc["source"]), doc["generation"],
            None if grants is None else [Grant(bytes.fromhex(d), Role(r), p) for d, r, p in grants])


def trainer_runs(body: bytes) -> list[str]:
    """The run ids a trainer body's sequences name (none for a body that does not parse: validation refuses it)."""
    try:
        doc = json.loads(body)
        return [str(s["run"]) for s in doc["sequences"] if isinstance(s, dict) and "run" in s]
    except (ValueError, KeyError, TypeError):
        return []


async def authorize(request: Request) -> None:
    """Every route's gate: 401/403 as the route's `Need` says; sets the caller as the acting writer."""
    auth = request.app.state.tokens.current()
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
