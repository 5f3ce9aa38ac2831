"""The service's CPU per gigabyte: what the figure of issue 54 is made of, shared by the benches.

`process_cpu_s(pids)` reads user + system seconds of live processes from /proc (the service's parent and its
workers: `service_pids`); `per_gb` divides CPU seconds by the gigabytes stored or delivered. Unlike a wall-clock
ratio, CPU-seconds per GB does not swing with how many processes share the cores, so it carries from a 2-core
machine to a many-core host. `own_cpu_s` is this process's own (a baseline's) CPU.
"""

from __future__ import annotations

import os
import resource

from tests.support.service import ServiceProcess


def process_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the live processes `pids` so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """User + system CPU seconds of this process (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def service_pids(service: ServiceProcess) -> list[int]:
    """The service's parent and its workers (what `process_cpu_s` sums)."""
    return [service.proc.pid, *service.children()] if service.proc else []


def per_gb(cpu_s: float, nbytes: int) -> float:
    """CPU seconds per gigabyte (1e9 bytes) of `nbytes` stored or delivered."""
    return cpu_s / (nbytes / 1e9) if nbytes else float("nan")
