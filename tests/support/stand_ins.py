"""Small stand-ins tests share: where a sink process would be (`KeptHandoff`), and a recorder of fsyncs."""

from __future__ import annotations

import os
import stat


class KeptHandoff:
    """Where the sink process would be: keeps each step frame's bytes (a worker's frame buffer is reused)."""

    pid = os.getpid()

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def step_packed(self, view) -> None:
        self.frames.append(bytes(view))

    def references(self, refs) -> None:
        pass

    def finish(self, ended) -> None:
        pass

    def close(self, timeout: float = 30.0, wait: bool = True) -> bool:
        return True


def record_fsyncs(monkeypatch) -> list[str]:
    """What each os.fsync from now on syncs: "file", or the folder's path (os.fsync still runs)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return synced
