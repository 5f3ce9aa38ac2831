"""Which processes open one store: this one alone, or one of `serve`'s workers beside the others.

What a process may keep for itself and clean up at start depends on it:

- `ONE`: a command-line tool, `serve --workers 1`, or `serve`'s parent before it starts its workers. It reads
  a run's row once and keeps it (runs.py), and runs the start-up checks and sweep (files.py, every unindexed
  segment) and empties the trash of interrupted deletions (retention.py).
- `WORKER`: one of `serve`'s worker processes (ops/workers.py). It reads a run's row again on every lookup
  (another worker may have deleted the run or learnt its layer count) and leaves the start-up work to the
  parent, which did it before any worker started: an unindexed segment may be another worker's ingest about
  to commit.

A PostgreSQL index is shared by replicas in either case (`Index.shared`); its start-up sweep waits out
`REPLAY_ORPHAN_GRACE_S` as it always did.
"""

from __future__ import annotations

import enum


class Processes(enum.StrEnum):
    """Which processes open the store (module docstring)."""

    ONE = "one"
    WORKER = "worker"
