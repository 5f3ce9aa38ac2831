"""`serve` on every core: worker processes over one index and one segment store, sharing one listening socket.

    serve (the parent)                                    each worker (uvicorn's supervisor spawns N)
      open the store alone: migrate the index, check   ->   worker_app(): the parent's settings, its share of
      it against the segments, sweep, the demo; close        the body budget, the STALE table; dies with the
      a fresh folder: PROMETHEUS_MULTIPROC_DIR, the          parent; create_app(..., Processes.WORKER)
      STALE table file
      uvicorn.run(workers=N): bind the socket, start
      the workers, replace one that dies

The kernel hands each new connection to one worker, and every request on it stays there (HTTP keep-alive). Not
evenly: on the one shared socket the first worker to wake accepts every connection waiting, so writers that
connect together can all land on one worker (README, "What the floors say": in 9 runs of 4 writers on 2 workers,
3 put all four on one). One socket per worker with SO_REUSEPORT would spread them by address hash, which is as
blind to load (all four on one in 1 draw of 8); what would even them is a worker that stops accepting while it
holds more than its share. Neither is done. What each worker keeps for itself, and how it stays right across them:

- idempotency keys, the CONFLICT rule, ownership, request counters, the expert load, run health: the index,
  shared (SQLite: one write lock over every worker's transactions; PostgreSQL as between replicas).
- group commit: per worker; each groups its own writers' batches into one index transaction.
- run registry: re-read from the index on every lookup (`Index.shared`), so a run deleted or widened by
  another worker is seen at once.
- STALE content table: one per host, a file every worker maps (checks/recent.py), made by the parent before its
  workers start; a copy is found whichever worker stored the original.
- retention passes: every worker runs them; a run deleted by one is gone for all (the index decides).
- connection bounds: `max_connections` per worker (each has its own sockets and descriptors);
  `max_body_bytes_in_flight` is the service's, split between the workers.
- `/metrics`: every worker's counters summed (metrics.py), run health read from the index once.

`kill -9` of one worker loses only what it had not acknowledged (acknowledged means committed), and uvicorn starts
another in its place; the new worker does not sweep (another's ingest may be about to commit): what the killed one
had written but not committed stays unindexed until the next start of the service sweeps it. `kill -9` of the parent
takes every worker with it (`PR_SET_PDEATHSIG`), so a restart never meets an old worker on the port.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI

from replay_service.app import create_app
from replay_service.checks.recent import RecentRows, table_bytes
from replay_service.metrics import MULTIPROCESS_DIR
from replay_service.ops.stacks import dump_stacks_on_signal, hold_stacks_signal
from replay_service.settings import ServiceSettings, StaleTableScope
from replay_service.store import Processes

SETTINGS_VARIABLE = "REPLAY_WORKER_SETTINGS"  # the parent's settings, as JSON, for its workers
PARENT_VARIABLE = "REPLAY_WORKER_PARENT"  # the parent's pid: a worker started after its parent died exits
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_count(workers: int) -> int:
    """How many workers a `workers` setting means: that many, or one per core this process may run on when 0."""
    return workers or len(os.sched_getaffinity(0))


def worker_settings(settings: ServiceSettings, workers: int, stale_table: Path | None = None) -> ServiceSettings:
    """One worker's settings: the service's, with its share of the bytes of bodies in flight (at least one body)
    and the STALE table file every worker maps."""
    share = max(settings.max_body_bytes, settings.max_body_bytes_in_flight // workers)
    return settings.model_copy(update={"max_body_bytes_in_flight": share, "stale_table_file": stale_table})


def _shared_folder(table: int) -> Path:
    """A new folder for what the workers share: on /dev/shm when it has room for twice the STALE table (its pages
    are then never written back to a disk; a container's small /dev/shm would fault a worker when full), else in
    the temp folder."""
    shm = "/dev/shm"
    room = os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * table
    return Path(tempfile.mkdtemp(prefix="replay-workers-", dir=shm if room else None))


def run_workers(settings: ServiceSettings, workers: int, serve: Callable[..., None], **options) -> None:
    """Serve with `workers` processes: `serve` is `uvicorn.run`, given the worker app's import string and
    `options`; the folder of the metrics and the STALE table is made before and removed after."""
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
    hold_stacks_signal()  # the workers start with it blocked; each unblocks it once it dumps stacks (ops/stacks.py)
    try:
        serve(f"{__name__}:worker_app", factory=True, workers=workers, **options)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent ends; exit now if it already has (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def worker_app() -> FastAPI:
    """The app of one worker (uvicorn's factory, called in the worker): the parent's settings, a shared store."""
    die_with_parent(int(os.environ[PARENT_VARIABLE]))
    dump_stacks_on_signal()
    settings = ServiceSettings.model_validate_json(os.environ[SETTINGS_VARIABLE])
    return create_app(settings, processes=Processes.WORKER)
