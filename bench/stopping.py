"""A benchmark stopped by SIGTERM cleans up as one stopped by Ctrl-C.

`timeout`, a job scheduler or `kill` send SIGTERM, whose default action ends Python at once: no `with` block
closes, so the services a benchmark started keep running and its temporary folders stay (a store of 0.6-0.8 GB
each; they filled this machine's disk once). `exit_on_sigterm` makes SIGTERM raise `SystemExit` in the main
thread instead, as Ctrl-C raises `KeyboardInterrupt`: services stop, folders are removed, the exit status is
128 + 15.
"""

from __future__ import annotations

import signal
import sys


def exit_on_sigterm() -> None:
    """From now on, SIGTERM ends this process through `SystemExit(143)` (call it from the main thread)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
