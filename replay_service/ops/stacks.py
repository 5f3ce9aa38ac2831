"""`kill -USR1 PID` of a serving process writes the Python stack of each of its threads to the service's log.

A service that hangs (a request that never answers, a commit that never ends) shows where each thread waits
without a debugger or a restart: the process that serves (`serve --workers 1`, or each worker of several)
registers Python's `faulthandler` for SIGUSR1, whose handler runs in C and prints even while a thread is blocked
inside a C call (a socket read, a database driver). The process keeps serving. With several workers, signal the
workers (`pgrep -P PARENT`): the supervisor, uvicorn's, holds SIGUSR1 blocked and does nothing with it.

The supervisor blocks the signal before it spawns the workers (`hold_stacks_signal`), so each worker starts with it
blocked and unblocks it once its dump is registered: a worker signalled in the first moments of its start dumps
then, rather than dying of the signal's default action.

faulthandler prints at most 100 frames of a thread, newest first, and marks a cut with `  ...`: a worker still in
its start-up (the lifespan runs deep inside the middleware stack) can show its stack cut before its first frames.
"""

from __future__ import annotations

import faulthandler
import signal

STACKS_SIGNAL = signal.SIGUSR1


def hold_stacks_signal() -> None:
    """Block STACKS_SIGNAL in this thread, and so in the threads and processes it starts from now on (a signal mask
    is inherited across fork and exec): the supervisor calls it before it spawns the workers, so a worker signalled
    before `dump_stacks_on_signal` gets the signal then instead of dying of its default action."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})


def dump_stacks_on_signal() -> None:
    """From now on, STACKS_SIGNAL writes every thread's stack to stderr (the service's log) and nothing else; a
    signal held back until now (`hold_stacks_signal`) is delivered at once."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})
