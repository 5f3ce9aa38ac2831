"""Spill items: what a sender keeps on disk while the service is not taking data (spec: spill.md).

`capture.sender.RouteSender` writes one file per item (`encode_item`, named by `item_name`)
and reads it back at drain time or at the next start (`decode_item`, ordered by `created_ns`).
A file without a version (written before this module) is read as 1.0: the layout is the same.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from replay_format.core import FormatError, FormatVersion, metadata_version

FORMAT = "routing-replay.spill"
VERSION = FormatVersion(1, 1)  # 1.1: the `references` kind
SUFFIX = ".item"
_HEADER_LENGTH = struct.Struct("<I")


class ItemKind(enum.StrEnum):
    """What an item's payload is and where it is posted."""

    BATCH = "batch"  # a row batch (rows.md) as an Arrow IPC stream, posted to /v1/ingest
    FINISH = "finish"  # the finish call's JSON body, posted to the header's `path`
    REFERENCES = "references"  # a references call's JSON body, posted to the header's `path` (since 1.1)


@dataclass(frozen=True)
class SpillHeader:
    """The JSON header in front of an item's payload (spill.md, "Header")."""

    kind: ItemKind
    seq: int  # the writer's sequence number of the item
    rows: int = 0  # rows in a batch (0 for a JSON call)
    path: str = ""  # a JSON call's service path, e.g. /v1/runs/{run}/requests/{request}/finish
    version: FormatVersion = VERSION

    def to_metadata(self) -> dict[str, Any]:
        """The header as written (always the current version)."""
        return {"format": FORMAT, "format_version": str(VERSION), "kind": self.kind.value, "seq": self.seq,
                "rows": self.rows, "path": self.path}

    @classmethod
    def from_metadata(cls, md: Any) -> SpillHeader:
        """Parse and check a decoded header; FormatError naming what is wrong."""
        what = "spill item"
        if not isinstance(md, dict):
            raise FormatError(f"{what}: header is not a JSON object")
        if md.get("format", FORMAT) != FORMAT:
            raise FormatError(f"{what}: format {md['format']!r}, expected {FORMAT!r}")
        version = metadata_version({k: str(v) for k, v in md.items()}, what, VERSION, FormatVersion(1, 0))
        try:
            kind = ItemKind(md["kind"])
            seq, rows, path = md["seq"], md.get("rows", 0), md.get("path", "")
            if type(seq) is not int or type(rows) is not int or seq < 0 or rows < 0 or not isinstance(path, str):
                raise ValueError
        except (KeyError, ValueError):
            raise FormatError(f"{what}: bad header {md!r}") from None
        if kind != ItemKind.BATCH and not path:
            raise FormatError(f"{what}: a {kind.value} item without its path")
        return cls(kind, seq, rows, path, version)


def encode_item(header: SpillHeader, payload: bytes) -> bytes:
    """One item file's bytes: u32 header length, the JSON header, the payload (the one builder)."""
    text = json.dumps(header.to_metadata()).encode()
    return _HEADER_LENGTH.pack(len(text)) + text + payload


def decode_item(data: bytes) -> tuple[SpillHeader, bytes]:
    """(header, payload) of an item file's bytes (the one reader); FormatError when it is damaged."""
    if len(data) < _HEADER_LENGTH.size:
        raise FormatError(f"spill item of {len(data)} bytes has no header")
    (size,) = _HEADER_LENGTH.unpack_from(data)
    end = _HEADER_LENGTH.size + size
    if end > len(data):
        raise FormatError(f"spill item header of {size} bytes runs past the file's {len(data)} bytes")
    try:
        md = json.loads(data[_HEADER_LENGTH.size : end])
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"spill item header is not JSON: {exc}") from None
    return SpillHeader.from_metadata(md), data[end:]


def item_name(created_ns: int, writer_id: str, seq: int) -> str:
    """The item's file name; names sort in creation order."""
    return f"{created_ns:020d}-{writer_id}-{seq:012d}{SUFFIX}"


def created_ns(name: str) -> int:
    """The creation time (ns since the epoch) an item's file name starts with."""
    return int(name.split("-", 1)[0])
