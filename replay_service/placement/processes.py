"""Which processes open one store: this one alone, or one of `serve`'s workers beside the others.

Contract: `ONE` (a command-line tool, `serve --workers 1`, or `serve`'s parent before its workers start) keeps a run's
row once read on a SQLite index and does the start-up work (index checks, sweep, emptying the trash); `WORKER` (one
of `serve`'s workers, ops/workers.py) reads a run's row on every lookup and leaves the start-up work to the parent.
`pool_id` names what the workers of one `serve` share and a restart does not (a segment file's check).
Design: docs/design/store.md ("One process or many").
"""

from __future__ import annotations

import enum
import os
from pathlib import Path


class Processes(enum.StrEnum):
    """Which processes open the store (module docstring)."""

    ONE = "one"
    WORKER = "worker"


def pool_id(processes: Processes) -> str | None:
    """The processes that share one check of a segment file: a worker's pool (its parent's pid and start time on this
    boot), or this process alone (its own); a restarted service is a new pool. None where /proc does not say."""
    pid = os.getppid() if processes is Processes.WORKER else os.getpid()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        started = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        return None
    return f"{boot}:{pid}:{started}"
