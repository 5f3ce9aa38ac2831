"""`kill -USR1 PID` of a serving process writes the Python stack of each of its threads to the service's log.

`dump_stacks_on_signal` registers Python's `faulthandler` for SIGUSR1 (`STACKS_SIGNAL`) in the process that serves
(`serve --workers 1`, or each worker of several): it prints even while a thread is blocked in C, and the process
keeps serving. With several workers, signal the workers (`pgrep -P PARENT`): uvicorn's supervisor holds the signal
blocked (`hold_stacks_signal`, before it spawns them), so a worker signalled while starting dumps once registered
rather than dying. faulthandler prints at most 100 frames a thread, newest first.

Design: docs/design/service_workers.md.
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
