"""The STALE content check's table of recently stored rows: one per host, shared by every worker of `serve`.

A stale row is a byte-identical copy of a row recorded for another token (an earlier batch's device buffer replayed
as this one). The table keys rows by content hash; each slot remembers the (request, position, token id) that last
hashed there. `serve` creates it as a file its workers map (`RecentRows.create`, `RecentRows.attach`), so a copy is
found whichever worker stored the original; one process keeps it in memory. Probes hold a thread lock and an
exclusive `flock` on the file: the kernel drops a killed worker's lock, and a slot half-written when its worker died
fails its check word and reads as empty, so `kill -9` neither wedges nor corrupts the table. The file's layout
(version 1, below) is private to this module and lives only as long as its service.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import threading
from pathlib import Path

import numba
import numpy as np

MAGIC = b"RRSTALE\x00"
VERSION = 1
_HEADER = 64  # MAGIC, u32 version, u32 log2(slots), 16 bytes: the table's id (random), zero padding
_SLOT_BYTES = 32  # hash u64, check u64, request i64, position i32, token i32
_MIX = np.uint64(0x9E3779B97F4A7C15)


def slots_for(capacity: int) -> int:
    """The table's slot count for a capacity of `capacity` rows: a power of two, at least 1024."""
    return 1 << max(10, (max(1, capacity) - 1).bit_length())


def table_bytes(capacity: int) -> int:
    """The memory (and file size) of a table of `capacity` rows: 32 bytes a slot plus a 64-byte header."""
    return _HEADER + _SLOT_BYTES * slots_for(capacity)


def request_keys(run_id: str, request_ids: list[str]) -> np.ndarray:
    """Each request's key in the table (int64 >= 0), the same in every worker process (a stable hash)."""
    run = run_id.encode() + b"\x00"
    keys = [int.from_bytes(hashlib.blake2b(run + r.encode(), digest_size=8).digest(), "little") >> 1
            for r in request_ids]
    return np.array(keys, np.int64)


class RecentRows:
    """A bounded, lossy table of recently stored row hashes (module docstring).

    What it cannot see: rows evicted (a colliding newer row overwrites an older one), rows stored before the
    service started, and, without token ids, a shared prefix versus a stale copy at the same position (treated as
    a shared prefix: not flagged).
    """

    def __init__(self, capacity: int, path: Path | None = None) -> None:
        """An empty table of `capacity` rows in memory, or the table file at `path` (`create` made it). `id` names
        the table (random; every process mapping one file reads the same): the STALE feed's host."""
        self.path = path
        self._fd: int | None = None
        if path is None:
            size = slots_for(capacity)
            buf: memoryview | mmap.mmap = memoryview(bytearray(_HEADER + _SLOT_BYTES * size))
        else:
            self._fd = os.open(path, os.O_RDWR)
            buf = mmap.mmap(self._fd, 0)
            header = bytes(buf[:_HEADER])
            if header[:8] != MAGIC or int.from_bytes(header[8:12], "little") != VERSION:
                raise ValueError(f"{path} is not a STALE table of version {VERSION}")
            size = 1 << int.from_bytes(header[12:16], "little")
        self._buf = buf
        self.id = bytes(buf[16:32]).hex() if path is not None else os.urandom(16).hex()
        self.slots = size
        self.mask = np.uint64(size - 1)
        at = _HEADER
        self.hashes = np.frombuffer(buf, np.uint64, size, at)
        self.check = np.frombuffer(buf, np.uint64, size, at + 8 * size)
        self.request = np.frombuffer(buf, np.int64, size, at + 16 * size)  # -1: empty
        self.position = np.frombuffer(buf, np.int32, size, at + 24 * size)
        self.token = np.frombuffer(buf, np.int32, size, at + 28 * size)  # -1: no token id recorded
        if path is None:
            self.request[:] = -1
        self._lock = threading.Lock()

    @classmethod
    def create(cls, path: Path, capacity: int) -> RecentRows:
        """A new, empty table file of `capacity` rows at `path` (replacing any), mapped."""
        size = slots_for(capacity)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.truncate(_HEADER + _SLOT_BYTES * size)
            f.write(MAGIC + VERSION.to_bytes(4, "little") + (size.bit_length() - 1).to_bytes(4, "little")
                    + os.urandom(16))
        table = cls(capacity, tmp)
        table.request[:] = -1  # every slot empty
        table.close()
        os.replace(tmp, path)
        return cls(capacity, path)

    def check_and_add(
        self, hashes: np.ndarray, request: np.ndarray, position: np.ndarray, token: np.ndarray, eligible: np.ndarray
    ) -> np.ndarray:
        """Boolean STALE verdict per row; eligible rows that are not copies are then remembered."""
        with self._lock:
            if self._fd is None:
                return _stale_probe(self.hashes, self.check, self.request, self.position, self.token, self.mask,
                                    hashes, request, position, token, eligible)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                return _stale_probe(self.hashes, self.check, self.request, self.position, self.token, self.mask,
                                    hashes, request, position, token, eligible)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap the table file (a no-op in memory)."""
        if self._fd is not None:
            self.hashes = self.check = self.request = self.position = self.token = None  # type: ignore[assignment]
            self._buf.close()  # type: ignore[union-attr]
            os.close(self._fd)
            self._fd = None


@numba.njit(nogil=True, cache=True)
def _check_word(h, req, pos, tok):  # pragma: no cover
    x = h ^ (np.uint64(req) * _MIX)
    x ^= (np.uint64(np.uint32(pos)) << np.uint64(32)) | np.uint64(np.uint32(tok))
    return x * _MIX


@numba.njit(nogil=True, cache=True)
def _stale_probe(t_hash, t_check, t_req, t_pos, t_tok, mask, hashes, request, position, token,
                 eligible):  # pragma: no cover
    n = hashes.shape[0]
    stale = np.zeros(n, np.bool_)
    for i in range(n):
        if not eligible[i]:
            continue
        h = hashes[i]
        slot = h & mask
        held = t_req[slot] >= 0 and t_hash[slot] == h and \
            t_check[slot] == _check_word(t_hash[slot], t_req[slot], t_pos[slot], t_tok[slot])
        if held:
            same_place = t_pos[slot] == position[i]
            if same_place and t_req[slot] == request[i]:
                continue  # a resend of the same row: not a copy
            if not same_place or (token[i] >= 0 and t_tok[slot] >= 0 and t_tok[slot] != token[i]):
                stale[i] = True
                continue  # keep the original's entry: further copies match it too
        t_req[slot] = -1  # a worker killed from here on leaves a slot that fails its check word
        t_hash[slot] = h
        t_pos[slot] = position[i]
        t_tok[slot] = token[i]
        t_check[slot] = _check_word(h, request[i], position[i], token[i])
        t_req[slot] = request[i]
    return stale


def warm_up() -> None:
    """Compile the probe for the argument types ingest passes (hashes u64, keys i64, positions and tokens i32)."""
    table = RecentRows(1)
    one = np.ones(1, np.int64)
    table.check_and_add(one.astype(np.uint64), one, one.astype(np.int32), one.astype(np.int32), np.ones(1, np.bool_))
