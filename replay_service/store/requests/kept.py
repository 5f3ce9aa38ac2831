"""Where a request's rows lie, kept between the trainer reads of one worker (`RowReader.locate(..., keep=...)`).

Contract: a plain read (FIRST rule, no version named, no late flag) of a whole request's location reuses the one an
earlier read made only while all three hold: the run is the one it was made in (`Keep.created_at`), the request's
record as this read took it equals the record it was made with (every write of rows to a request changes its counters,
and a write that serves no row cannot change what a plain read serves), and each segment it points into is still the
one it was made from (the segment cache hands out the same opened columns; a segment closed since is located again,
a deleted run's is refused by the cache as before). Kept per worker within `max_bytes`, least recently used out; a
kept location holds no segment open (only weak references to its columns).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

L = TypeVar("L")  # a location (rows.Located)


@dataclass(frozen=True)
class Keep:
    """What a read hands over to keep its request's location: the run's creation (tells a run from a later one of the
    same id), the request's record as the read took it (compared by equality), and the rows to locate: `[0, rows)`."""

    created_at: float
    record: object
    rows: int


@dataclass(frozen=True)
class Kept(Generic[L]):
    """One request's location over `[0, keep.rows)` (`located`, without its segments' ids) and the segments it points
    into: their paths and, weakly, the columns each was located in; `nbytes`: what keeping it costs."""

    keep: Keep
    paths: tuple[str, ...]
    columns: tuple[weakref.ref, ...]
    located: L
    nbytes: int

    def holds(self, columns: Sequence[object]) -> bool:
        """Whether `columns` (each path's, as the segment cache hands them out now) are the ones it was located in."""
        return all(ref() is now for ref, now in zip(self.columns, columns, strict=True))


class KeptLocations(Generic[L]):
    """`Kept` locations by (run, request), within `max_bytes` (0: none kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[str, str], Kept[L]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # reads run in many threads
        self._making: dict[tuple[str, str], threading.Event] = {}  # set once the read making a location is done

    def get(self, run_id: str, request_id: str, keep: Keep) -> Kept[L] | None:
        """The request's kept location when it was made under an equal `keep` (the segments are the caller's to
        check: `Kept.holds`), else None."""
        with self._lock:
            kept = self._kept.get((run_id, request_id))
            if kept is None or kept.keep != keep:
                return None
            self._kept.move_to_end((run_id, request_id))
            return kept

    def making(self, run_id: str, request_id: str) -> threading.Event | None:
        """None: the caller makes the request's location now, and says when it is done (`made`); else the event
        another read making it sets when it is done (the ranks of one step ask for a request at once: it is made
        once, not once each)."""
        with self._lock:
            other = self._making.get((run_id, request_id))
            if other is None:
                self._making[(run_id, request_id)] = threading.Event()
            return other

    def made(self, run_id: str, request_id: str) -> None:
        """The caller `making` it is done (kept or not): the reads waiting for it go on."""
        with self._lock:
            self._making.pop((run_id, request_id)).set()

    def put(self, run_id: str, request_id: str, kept: Kept[L]) -> None:
        """Keep `kept` as the request's location (replacing any), the least recently used dropped past `max_bytes`."""
        size = kept.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._kept.pop((run_id, request_id), None)
            if old is not None:
                self._bytes -= old.nbytes
            self._kept[(run_id, request_id)] = kept
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.nbytes

