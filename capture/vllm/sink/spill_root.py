"""Runs in the sink process: the spill root its writer directory lies in, shared with the other sinks.

Every sink spills under `<spill root>/<writer id>/` (the root is `ROUTING_REPLAY_SPILL_DIR`), and writer ids are new
at every start. `claim(root, writer)` holds an exclusive `flock` on `<root>/<writer>.lock` while the sink runs (the
kernel drops it even on kill -9); `adopt(root, into)` moves the items of every writer directory whose lock it can
take into its own, to be sent first, oldest first (each item keeps its `(run, writer, seq)` identity, so one sent
twice is stored once); `release` removes an emptied directory and its lock; `drain(root, url)` adopts and sends on its
own. A spill root belongs to one service.

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from capture.sender import RouteSender, SenderConfig
from capture.vllm.log import log
from replay_format import RunShape
from replay_format.durable import fsync_dir
from replay_format.spill import SUFFIX

LOCK_SUFFIX = ".lock"
# Writer directories of plugin versions from before the lock files (`handoff.start_sink` names them).
_OLD_WRITER_PREFIX = "vllm-dp"


def _lock(path: Path, wait: bool) -> int | None:
    """An fd holding an exclusive flock on `path` (created if missing); None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim(root: Path, writer: str) -> int:
    """Lock `<root>/<writer>.lock` for this process's lifetime, then make the writer's directory; the lock's fd."""
    root.mkdir(parents=True, exist_ok=True)
    fd = _lock(root / (writer + LOCK_SUFFIX), wait=True)
    assert fd is not None
    (root / writer).mkdir(exist_ok=True)
    return fd


def adopt(root: Path, into: Path) -> int:
    """Move the items of dead writers under `root` into `into`; how many were moved.

    A directory is only looked at once its lock is held by nobody: its writer took the lock before
    making it, so a live writer's directory is never touched.
    """
    moved = 0
    for directory in _writer_dirs(root):
        if directory == into:
            continue
        fd = _lock(root / (directory.name + LOCK_SUFFIX), wait=False)
        if fd is None:
            continue  # its writer runs
        try:
            for item in sorted(directory.glob("*" + SUFFIX)):
                try:
                    os.rename(item, into / item.name)
                    moved += 1
                except FileNotFoundError:
                    continue
            for partial in directory.glob("*.tmp"):  # never renamed into place: never an item
                partial.unlink(missing_ok=True)
            fsync_dir(into)  # the moves are durable before the dead writer's folder goes
            _remove(root, directory.name)
        finally:
            os.close(fd)
    if moved:
        log.info("routing-replay: %d items left under %s by stopped writers will be sent first", moved, root)
    return moved


def _writer_dirs(root: Path) -> list[Path]:
    """The directories under `root` that sinks made (a lock file beside each) and that hold items.

    Nothing else under the root is touched, whatever `ROUTING_REPLAY_SPILL_DIR` points at.
    """
    found = []
    for directory in sorted(root.iterdir()):
        if not directory.is_dir():
            continue
        ours = (root / (directory.name + LOCK_SUFFIX)).exists() or directory.name.startswith(_OLD_WRITER_PREFIX)
        if ours and next(directory.glob("*" + SUFFIX), None) is not None:
            found.append(directory)
    return found


def release(root: Path, writer: str, fd: int) -> None:
    """This writer is done: its directory and lock file go if nothing is left in it; the lock is dropped."""
    try:
        _remove(root, writer)
    finally:
        os.close(fd)


def _remove(root: Path, writer: str) -> None:
    """Remove an empty writer directory, then its lock file (with the lock held: no writer can be in it)."""
    try:
        (root / writer).rmdir()
    except OSError:
        return  # items (or `.bad` files) are left: the directory stays for a later start
    (root / (writer + LOCK_SUFFIX)).unlink(missing_ok=True)


# A drain submits no rows, so its sender's shape is never used.
_NO_ROWS = RunShape(num_moe_layers=1, top_k=1, num_experts=1)


def drain(root: Path | str, url: str, token: str | None = None, timeout: float = 30.0) -> bool:
    """Send what stopped writers left under spill root `root`; True when nothing is left there.

    What the next start of the plugin does first, run on its own. Items still unsent after `timeout`
    stay under `root` for a later drain or start.
    """
    root = Path(root)
    writer = f"drain-{os.getpid()}-{os.urandom(3).hex()}"
    fd = claim(root, writer)
    try:
        adopt(root, root / writer)
        sender = RouteSender(SenderConfig(url=url, run_id="drain", shape=_NO_ROWS, writer_id=writer, token=token,
                                          spill_dir=root / writer))
        done = sender.close(timeout)
        sender.http.close()
    finally:
        release(root, writer, fd)
    return done
