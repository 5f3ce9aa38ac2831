"""Durable files, the store's bottom floor: write beside, fsync, rename into place, fsync the folder.

Every file the store keeps on local disk (segments, stored comparisons, run journals, a rebuilt index) becomes
durable this way, so a crash leaves either the old state or the new, never a partial file under its final name:
at worst a `<name>.tmp` beside it, which the start-up sweep deletes (cache.py). Nothing here knows what the
files hold. The folder's fsync is `replay_format.durable.fsync_dir`, the one the capture sender's spill uses too.
"""

from __future__ import annotations

import os
from pathlib import Path

from replay_format.durable import fsync_dir

TMP_SUFFIX = ".tmp"  # a file being written: never complete, never acknowledged


def tmp_path(path: Path) -> Path:
    """Where a file is written before it is renamed to `path`: `<name>.tmp` beside it."""
    return path.with_name(path.name + TMP_SUFFIX)


def write_file(path: Path, data: bytes, fsync: bool = True) -> None:
    """`data` as the file `path`, atomically: written to `tmp_path(path)`, (with `fsync`) fsynced, renamed into
    place and its folder fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
