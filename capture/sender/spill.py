"""The sender's spill folder: items the service has not taken yet, one fsynced file each, drained oldest first.

Each file is one `replay_format.spill` item, named so that names sort in creation order (`item_name`). A sender
that starts finds what an earlier one left and sends it first. The folder keeps the list of its files and their
bytes (the sender's `max_spill_bytes` budget). The sender's two threads, and `close()`, share it under the sender's
condition, given here as `lock`: `write` takes it to add a file and wakes the network thread; `oldest` and `remove`
are called with it held. Writes take a lock of their own too, one at a time: `close()` spills the in-flight item
while the network thread may be spilling the same one (its delivery failed), and both would write one `.tmp` file.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from capture.sender.items import Item
from replay_format import FormatError
from replay_format.durable import fsync_dir
from replay_format.spill import SUFFIX, encode_item, item_name

log = logging.getLogger("routing_replay.sender")


@dataclass(frozen=True)
class Spilled:
    """An item read back from its spill file, and the file (removed once the service has it)."""

    item: Item
    path: Path


class SpillFolder:
    """A folder of spilled items: their files in order and their bytes (see the module docstring)."""

    def __init__(self, path: Path, max_bytes: int, lock: threading.Condition) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = lock
        self._writing = threading.Lock()
        self._files: deque[Path] = deque(sorted(self.path.glob("*" + SUFFIX), key=_spill_order))
        self._bytes = sum(p.stat().st_size for p in self._files)

    def __len__(self) -> int:
        """How many items wait in the folder."""
        return len(self._files)

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes stay within the folder's budget."""
        return self._bytes + size <= self.max_bytes

    def write(self, item: Item, writer_id: str) -> bool:
        """Write `item` as a file (fsynced, renamed into place, the folder fsynced) and queue it for draining;
        False when the folder holds it already (a copy of the in-flight item at close), and nothing is written."""
        name = item_name(item.created_ns, writer_id, item.seq)
        with self._writing:
            if (self.path / name).exists():
                return False
            data = encode_item(item.header, item.payload)
            tmp = self.path / (name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / name)
            fsync_dir(self.path)  # the rename too survives a crash of the machine, not only of the process
            with self._lock:
                self._files.append(self.path / name)
                self._files = deque(sorted(self._files, key=_spill_order))
                self._bytes += len(data)
                self._lock.notify_all()
        return True

    def oldest(self) -> Spilled | None:
        """The oldest readable item and its file, or None when the folder is empty (call with the lock held).

        A file that cannot be read (damaged, or from a newer version) is kept as `.bad` and skipped."""
        while self._files:
            path = self._files[0]
            try:
                return Spilled(Item.from_spill_file(path.name, path.read_bytes()), path)
            except FormatError as exc:
                log.error("routing-replay: spill file %s cannot be read (%s); kept as %s.bad and skipped",
                          path, exc, path.name)
                self._forget(path)
                path.rename(path.with_name(path.name + ".bad"))
        return None

    def remove(self, path: Path) -> None:
        """Delete a file whose item the service took (call with the lock held)."""
        self._forget(path)
        path.unlink()

    def _forget(self, path: Path) -> None:
        self._files.remove(path)
        self._bytes -= path.stat().st_size


def _spill_order(path: Path) -> str:
    return path.name
