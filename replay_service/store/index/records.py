"""The index's value types: what its typed methods take and answer, and the names of its counter columns.

No SQL runs here. `RequestStatus` is a request's state; `HeldRows` a `spans` row with its segment's path;
`RequestSpans` every span of one request as columns; `RequestCounts` what one batch adds to a request's counters;
`FeedEntry` one entry of the STALE table's feed; `load_of` a `runs.load` value as an array. `count_column` /
`COUNT_COLUMNS` name the `requests` column counting each flag of `COUNTED_FLAGS`, and `EXPECTED_ROWS` is the SQL
expression of the rows a request should have.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from replay_format import Flag, RunShape

__all__ = ["COUNTED_FLAGS", "COUNT_COLUMNS", "EXPECTED_ROWS", "FeedEntry", "HeldRows", "RequestCounts",
           "RequestSpans", "RequestStatus", "count_column", "load_of"]


class RequestStatus(enum.StrEnum):
    """A request's state in the `requests` table (and the finish body's `status`)."""

    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


# Counted per request; GAP is derived on read, PADDING counts rows dropped at ingest.
COUNTED_FLAGS = (Flag.ZERO, Flag.DUPLICATE, Flag.OUT_OF_RANGE, Flag.STALE, Flag.CONFLICT, Flag.PADDING)


def count_column(flag: Flag) -> str:
    """The `requests` column counting rows with `flag`."""
    return f"n_{str(flag.name).lower()}"


COUNT_COLUMNS = tuple(count_column(f) for f in COUNTED_FLAGS)
# Rows a request should have: T-1 once finished with T tokens, else up to the last position seen.
EXPECTED_ROWS = "COALESCE(final_tokens - 1, pos_max + 1)"


@dataclass(frozen=True)
class HeldRows:
    """Rows `[row_start, row_start + row_count)` of one segment, held by a request at positions pos_min..pos_max
    (a `spans` row, with its segment's path)."""

    request_id: str
    segment_id: int
    path: str
    row_start: int
    row_count: int
    pos_min: int
    pos_max: int


@dataclass(frozen=True)
class RequestSpans:
    """Every span of one request, in the order it came to hold them (span i: rows `[row_start[i], row_start[i] +
    row_count[i])` of segment `path[i]`, at positions `pos_min[i]..pos_max[i]`): `HeldRows` as columns, plain lists
    (a read walks them span by span)."""

    path: list[str]
    row_start: list[int]
    row_count: list[int]
    pos_min: list[int]
    pos_max: list[int]

    def touching(self, lo: int, hi: int) -> list[int]:
        """The spans touching positions `[lo, hi]`, in order."""
        return [i for i, (a, b) in enumerate(zip(self.pos_min, self.pos_max)) if b >= lo and a <= hi]


@dataclass(frozen=True)
class RequestCounts:
    """What one batch adds to one request's counters (`IndexTransaction.add_counts`).

    `rows`: rows newly served; `pos_max`: the last position the batch's span reaches (served or not);
    `counts`: rows per counted flag (PADDING: writer padding rows dropped); `referenced`: how many of `rows` are
    served through a prefix-cache reference; `unclean`: how many of `rows` carry any flag.
    """

    request_id: str
    rows: int
    pos_max: int
    flag_bits: int = 0
    first_flagged: int | None = None
    counts: Mapping[Flag, int] = field(default_factory=dict)
    referenced: int = 0
    unclean: int = 0

    @classmethod
    def of_rows(cls, request_id: str, positions: np.ndarray, flags: np.ndarray, pos_max: int, padding: int = 0,
                referenced: int = 0) -> RequestCounts:
        """The counts of rows newly served at sorted `positions` with their `flags`."""
        counts: dict[Flag, int] = {f: int(np.count_nonzero(flags & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        counts[Flag.PADDING] = padding
        flagged = positions[flags != 0]
        return cls(request_id, rows=len(positions), pos_max=pos_max,
                   flag_bits=int(np.bitwise_or.reduce(flags)) if flags.size else 0,
                   first_flagged=int(flagged[0]) if flagged.size else None, counts=counts,
                   referenced=referenced, unclean=int(flagged.size))


@dataclass(frozen=True)
class FeedEntry:
    """One entry of the STALE table's feed: the rows one host stored recently, as `ingest/stale_feed.py` packs them."""

    feed_id: int
    host: str
    records: bytes


def load_of(blob: bytes | None, shape: RunShape) -> np.ndarray:
    """The expert load a `runs.load` value records (NULL: nothing counted yet), as a new writable array."""
    load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
    if blob is not None:
        load[:] = np.frombuffer(blob, np.int64).reshape(load.shape)
    return load
