"""How a file of these formats becomes durable on local disk: the folder's fsync after a rename into it.

The specs say their files are written beside (`<name>.tmp`), fsynced and renamed into place (spill.md,
compare.md); the rename is durable only once the folder itself is fsynced. `fsync_dir` is that one step, the one
helper both sides use: the capture sender's spill (`capture.sender.spill`, `capture.vllm.sink.spill_root`) and the
service's store (`replay_service.store.segments.durable` and the writers above it). Standard library only; no
message here.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` durable (what a rename into it changed), as fsync makes a file's bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
