"""`serve` on every core: worker processes over one index and one segment store, sharing one listening socket.

The parent opens the store alone (migrate, check, sweep, the demo), makes a fresh shared folder (Prometheus
multiprocess files, the STALE table, the tokens' snapshot) and runs uvicorn's supervisor (`run_workers`,
`Supervisor`; SIGHUP reloads the tokens), which starts `worker_count` workers and replaces one that dies. Each worker
(`worker_app`) serves `create_app(..., Processes.WORKER)` with the parent's settings and its share of the body budget,
and dies with the parent. State that must hold across workers lives in the index or in files every worker maps. A
worker that cannot start stops them all: `run_workers` raises `WorkerCannotStart` with its cause, and `serve` exits.

Design: docs/design/service_workers.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess

from replay_service.api.auth import Tokens
from replay_service.app import create_app
from replay_service.checks.recent import RecentRows, table_bytes
from replay_service.metrics import MULTIPROCESS_DIR
from replay_service.ops.stacks import dump_stacks_on_signal, hold_stacks_signal
from replay_service.settings import ServiceSettings, StaleTableScope
from replay_service.store import Processes

SETTINGS_VARIABLE = "REPLAY_WORKER_SETTINGS"  # the parent's settings, as JSON, for its workers
PARENT_VARIABLE = "REPLAY_WORKER_PARENT"  # the parent's pid: a worker started after its parent died exits
TOKENS_VARIABLE = "REPLAY_WORKER_TOKENS"  # the tokens' snapshot the parent shares (api/auth.py Tokens)
FAILURES_VARIABLE = "REPLAY_WORKER_FAILURES"  # where a worker that cannot start writes why (StartFailures)
log = logging.getLogger("replay_service")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_count(workers: int) -> int:
    """How many workers a `workers` setting means: that many, or one per core this process may run on when 0."""
    return workers or len(os.sched_getaffinity(0))


def worker_settings(settings: ServiceSettings, workers: int, stale_table: Path | None = None) -> ServiceSettings:
    """One worker's settings: the service's, with its share of the bytes of bodies in flight (at least one body)
    and the STALE table file every worker maps."""
    share = max(settings.max_body_bytes, settings.max_body_bytes_in_flight // workers)
    return settings.model_copy(update={"max_body_bytes_in_flight": share, "stale_table_file": stale_table})


SHARED_PREFIX = "replay-workers-"
OWNER_FILE = "owner"  # in a shared folder: "<pid> <start time>" of the `serve` parent that made it
LEGACY_GRACE_S = 60.0  # a shared folder without an owner file (made before there was one) is this old at least


def _shared_folder(table: int) -> Path:
    """A new folder for what the workers share: on /dev/shm when it has room for twice the STALE table (its pages
    are then never written back to a disk; a container's small /dev/shm would fault a worker when full), else in
    the temp folder. What a `serve` killed before it could remove its own folder left there is removed first
    (`remove_orphans`): it is RAM, and a crash loop would otherwise fill it one folder per crash."""
    shm = "/dev/shm"
    for place in (shm, tempfile.gettempdir()):
        remove_orphans(Path(place))
    room = os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * table
    folder = Path(tempfile.mkdtemp(prefix=SHARED_PREFIX, dir=shm if room else None))
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return folder


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), None where it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def remove_orphans(place: Path) -> list[Path]:
    """Remove the shared folders under `place` whose `serve` is gone; the folders removed.

    A folder's owner file names its parent by pid and start time (a pid used again by another process is not its
    parent). A folder of an older release, without an owner file, goes when it is LEGACY_GRACE_S old and no running
    process maps a file of it (`/proc/*/maps`: a live service's workers map its STALE table and tokens)."""
    removed = []
    mapped: set[str] | None = None
    for folder in place.glob(f"{SHARED_PREFIX}*"):
        try:
            owner = (folder / OWNER_FILE).read_text().split()
            gone = _start_time(int(owner[0])) != (int(owner[1]) if owner[1] != "None" else None)
        except FileNotFoundError:
            if mapped is None:
                mapped = _mapped_paths()
            gone = _age_s(folder) > LEGACY_GRACE_S and not any(p.startswith(f"{folder}/") for p in mapped)
        except (OSError, ValueError, IndexError):
            continue  # not ours to judge (another user's, half written): left alone
        if gone:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.warning("start-up: removed %d shared folders left by a service that did not stop (%s)", len(removed),
                    ", ".join(str(f) for f in removed))
    return removed


def _age_s(folder: Path) -> float:
    try:
        return time.time() - folder.stat().st_mtime
    except OSError:
        return 0.0


def _mapped_paths() -> set[str]:
    """Every file path some running process maps (what /proc lets this user read)."""
    paths: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:
            continue  # gone meanwhile, or another user's
        paths.update(fields[5].strip() for fields in (line.split(None, 5) for line in lines) if len(fields) == 6)
    return paths


class WorkerCannotStart(RuntimeError):
    """A worker could not build or start its app, so the service stopped; the message is the cause, one line."""


def run_workers(settings: ServiceSettings, workers: int, tokens: Tokens, **options: Any) -> None:
    """Serve with `workers` processes and `tokens` (the parent's, read from the tokens file) until a signal stops
    the supervisor (`options`: uvicorn.Config's); WorkerCannotStart when a worker could not build or start its app,
    which stops every worker. The folder of the metrics, the STALE table and the tokens is made before and removed
    after."""
    shared = _shared_folder(table_bytes(settings.stale_table_rows))
    metrics_dir = shared / "metrics"
    metrics_dir.mkdir()
    table = None
    if settings.stale_table_scope is StaleTableScope.HOST:
        table = shared / "stale-table"
        RecentRows.create(table, settings.stale_table_rows).close()
    os.environ[MULTIPROCESS_DIR] = str(metrics_dir)
    os.environ[SETTINGS_VARIABLE] = worker_settings(settings, workers, table).model_dump_json()
    os.environ[PARENT_VARIABLE] = str(os.getpid())
    os.environ[TOKENS_VARIABLE] = str(shared / "tokens")
    failures = StartFailures()
    os.environ[FAILURES_VARIABLE] = failures.path
    hold_stacks_signal()  # the workers start with it blocked; each unblocks it once it dumps stacks (ops/stacks.py)
    try:
        config = uvicorn.Config(f"{__name__}:worker_app", factory=True, workers=workers, **options)
        supervisor = Supervisor(config, [config.bind_socket()], tokens.share(shared / "tokens"))
        try:
            supervisor.run()
        except KeyboardInterrupt:  # as uvicorn.run
            pass
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    if supervisor.a_worker_could_not_start():
        raise WorkerCannotStart(failures.first() or "a worker could not start (exit status "
                                f"{STARTUP_FAILURE}); its log above says why")


class Supervisor(Multiprocess):
    """uvicorn's supervisor of the workers, where SIGHUP reloads the tokens of every worker (`reload_tokens`),
    instead of uvicorn's own SIGHUP: replacing each worker, which would only map the same snapshot again."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], tokens: Tokens) -> None:
        super().__init__(config, sockets)
        self.tokens = tokens

    def handle_hup(self) -> None:
        """SIGHUP, taken in the supervisor's loop: reload the tokens for every worker."""
        reload_tokens(self.tokens)

    def a_worker_could_not_start(self) -> bool:
        """Whether the supervisor stopped because a worker exited with STARTUP_FAILURE (uvicorn stops on it)."""
        return any(process.exitcode == STARTUP_FAILURE for process in self.processes)


def reload_tokens(tokens: Tokens) -> None:
    """SIGHUP: read the tokens file again for every process of the service (api/auth.py `Tokens.reload`), logging
    the generation now in force, or why the file was refused (the tokens in force then stay)."""
    try:
        done = tokens.reload()
    except ValueError as exc:
        log.error("SIGHUP: tokens not reloaded: %s; the tokens in force (generation %d) stay", exc, tokens.generation)
        return
    log.warning("SIGHUP: the %d tokens of %s are in force in every worker (generation %d)", done.tokens, done.source,
                done.generation)


def reload_tokens_on_sighup(tokens: Tokens) -> None:
    """From now on SIGHUP to this process reloads `tokens` (`serve` of one process; the supervisor of several
    takes SIGHUP in its own loop)."""
    signal.signal(signal.SIGHUP, lambda signum, frame: reload_tokens(tokens))


class StartFailures:
    """Where a worker that cannot start writes why, for the parent: a file in memory (memfd) the parent holds open
    and a worker appends a line to through /proc/PARENT/fd/N. It is in no folder, so it outlives the loss of the
    shared one (logind's RemoveIPC, a temp cleaner), the likeliest reason a replacement worker cannot start."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("replay-worker-start-failures")
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"

    def first(self) -> str | None:
        """The first cause written, None when none was."""
        lines = os.pread(self._fd, 1 << 16, 0).decode(errors="replace").splitlines()
        return lines[0] if lines else None


def cannot_start(exc: BaseException, what: str, traceback: bool) -> None:
    """Log and report to the parent (StartFailures) why this worker cannot start: one line naming `what` failed
    and the exception (`traceback`: also its traceback, to the log)."""
    cause = " ".join(f"worker {os.getpid()} could not {what}: {type(exc).__name__}: {exc}".split())
    log.error("%s", cause, exc_info=exc if traceback else None)
    try:
        with open(os.environ[FAILURES_VARIABLE], "a") as failures:
            failures.write(cause + "\n")
    except (KeyError, OSError):  # the log has it
        pass


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent ends; exit now if it already has (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def worker_app() -> FastAPI:
    """The app of one worker (uvicorn's factory, called in the worker): the parent's settings and tokens, a shared
    store. A worker that cannot build it, or start it (its lifespan: the store), reports why (`cannot_start`) and
    exits with STARTUP_FAILURE, on which the supervisor stops the service."""
    die_with_parent(int(os.environ[PARENT_VARIABLE]))
    dump_stacks_on_signal()
    try:
        settings = ServiceSettings.model_validate_json(os.environ[SETTINGS_VARIABLE])
        app = create_app(settings, processes=Processes.WORKER, tokens=Tokens.attach(Path(os.environ[TOKENS_VARIABLE])))
    except Exception as exc:
        cannot_start(exc, "build its app", traceback=True)
        sys.exit(STARTUP_FAILURE)  # uvicorn's factory call lets it through; any other exception is respawned
    app.router.lifespan_context = _reporting_start_failure(app.router.lifespan_context)
    return app


def _reporting_start_failure(lifespan: Callable[[Any], AbstractAsyncContextManager[Any]]) -> Callable[..., Any]:
    """`lifespan`, reporting an exception of its start (uvicorn then logs its traceback and exits STARTUP_FAILURE)."""

    @asynccontextmanager
    async def reporting(app: Any) -> AsyncIterator[Any]:
        started = False
        try:
            async with lifespan(app) as state:
                started = True
                yield state
        except Exception as exc:
            if not started:
                cannot_start(exc, "start its app", traceback=False)
            raise

    return reporting
