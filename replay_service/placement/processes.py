"""Which processes open one store: this one alone, or one of `serve`'s workers beside the others.

Contract: `ONE` (a command-line tool, `serve --workers 1`, or `serve`'s parent before its workers start) keeps a run's
row once read on a SQLite index and does the start-up work (index checks, sweep, emptying the trash); `WORKER` (one
of `serve`'s workers, ops/workers.py) reads a run's row on every lookup and leaves the start-up work to the parent.
Design: docs/design/store.md ("One process or many").
"""

from __future__ import annotations

import enum


class Processes(enum.StrEnum):
    """Which processes open the store (module docstring)."""

    ONE = "one"
    WORKER = "worker"
