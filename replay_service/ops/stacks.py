"""`kill -USR1 PID` of a serving process writes the Python stack of each of its threads to the service's log.

A service that hangs (a request that never answers, a commit that never ends) shows where each thread waits
without a debugger or a restart: the process that serves (`serve --workers 1`, or each worker of several)
registers Python's `faulthandler` for SIGUSR1, whose handler runs in C and prints even while a thread is blocked
inside a C call (a socket read, a database driver). The process keeps serving. With several workers, signal the
workers (`pgrep -P PARENT`): uvicorn's supervisor takes SIGUSR1 for itself and ignores it.

faulthandler prints at most 100 frames of a thread, newest first, and marks a cut with `  ...`: a worker still in
its start-up (the lifespan runs deep inside the middleware stack) can show its stack cut before its first frames.
"""

from __future__ import annotations

import faulthandler
import signal

STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """From now on, STACKS_SIGNAL writes every thread's stack to stderr (the service's log) and nothing else."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
