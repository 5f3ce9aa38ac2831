"""Run journal lines: what the index knows that no segment says, one JSON line per event (spec: journal.md).

`replay_service.store.lifecycle.journal` appends them (`encode_entry`, after the index transaction that made the event
committed) and `replay-service reindex` reads them back (`parse_journal`) to rebuild a lost index. A line
without a version (written before this module) is read as 1.0: the keys are the same.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from replay_format.core import FormatError, FormatVersion, metadata_version
from replay_format.request_notes import FinishStatus, Reference

VERSION = FormatVersion(1, 0)
LEGACY = FormatVersion(1, 0)  # lines written before versions existed: the same keys


class EventKind(enum.StrEnum):
    """A journal line's `event`."""

    RUN = "run"  # a run was created
    END = "end"  # a request's end as the index records it
    REFERENCES = "references"  # prefix-cache references received


@dataclass(frozen=True)
class RunCreated:
    """A run's creation time (its summary's `created_at`, Unix seconds)."""

    created_at: float


@dataclass(frozen=True)
class RequestEnded:
    """A request's end as the index now records it (a later end of the same request replaces it)."""

    request_id: str
    num_tokens: int
    status: FinishStatus


@dataclass(frozen=True)
class ReferencesAdded:
    """Prefix-cache references received (known ones too: replaying them is a no-op)."""

    references: tuple[Reference, ...]


JournalEvent = RunCreated | RequestEnded | ReferencesAdded


@dataclass(frozen=True)
class JournalEntry:
    """One line: when it was appended (ns since the epoch: reindex merges it with the segments by time) and what."""

    t: int
    event: JournalEvent


@dataclass(frozen=True)
class BadLine:
    """A complete line a reader could not take: where (the file or object, and the line's number from 1), and why."""

    where: str
    why: str


@dataclass(frozen=True)
class JournalLines:
    """What a journal file or object holds: its entries in the order appended, and the lines refused.

    A torn line (an append a crash cut short) is neither: skipped, as journal.md says."""

    entries: list[JournalEntry] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)

    def __add__(self, other: JournalLines) -> JournalLines:
        return JournalLines(self.entries + other.entries, self.bad + other.bad)


def encode_entry(entry: JournalEntry) -> bytes:
    """One journal line, newline included (the one builder; always the current version)."""
    event = entry.event
    fields: dict[str, Any]
    if isinstance(event, RunCreated):
        fields = {"event": EventKind.RUN.value, "created_at": event.created_at}
    elif isinstance(event, RequestEnded):
        fields = {"event": EventKind.END.value, "request_id": event.request_id, "num_tokens": event.num_tokens,
                  "status": event.status.value}
    else:
        fields = {"event": EventKind.REFERENCES.value,
                  "references": [[r.request_id, r.start, r.end, r.source_request_id] for r in event.references]}
    line = {"format_version": str(VERSION), "t": entry.t, **fields}
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


def parse_journal(data: bytes, name: str) -> JournalLines:
    """The entries of journal lines (the one reader); `name` (the file or object) goes into each BadLine.

    An append a crash cut short leaves bytes with no newline: at the end of the data they are skipped; the
    service's next append went right after them (O_APPEND), so a line holding torn bytes and then a complete object
    is read as that object. A line ended by its newline that holds no JSON object (damaged), or one that is no entry
    this reader knows (a newer major, a missing or wrong key), is a `BadLine`."""
    entries: list[JournalEntry] = []
    bad: list[BadLine] = []
    *ended, tail = data.split(b"\n")
    for number, raw in enumerate(ended + [tail], start=1):
        line = _complete_object(raw)
        if line is None:
            if raw.strip() and number <= len(ended):
                bad.append(BadLine(f"{name} line {number}", "journal line: not a JSON object (damaged)"))
            continue
        try:
            entries.append(_entry(line))
        except FormatError as exc:
            bad.append(BadLine(f"{name} line {number}", str(exc)))
    return JournalLines(entries, bad)


def _complete_object(raw: bytes) -> dict | None:
    """The line's JSON object; for a torn line, the complete one appended after the torn bytes; None if none."""
    for start in (0, raw.rfind(b"{")):  # ids hold no `{` (ID_RULE): an entry's object starts at the line's last one
        if start < 0:
            continue
        try:
            line = json.loads(raw[start:])
        except ValueError:  # UnicodeDecodeError too
            continue
        if isinstance(line, dict):
            return line
    return None


def _entry(line: dict) -> JournalEntry:
    """One parsed line as an entry; FormatError naming what is wrong."""
    what = "journal line"
    version = line.get("format_version")
    metadata_version({} if version is None else {"format_version": str(version)}, what, VERSION, LEGACY)
    t = line.get("t")
    if type(t) is not int or t < 0:
        raise FormatError(f"{what}: `t` must be a non-negative integer (ns), got {t!r}")
    event = line.get("event")
    if not isinstance(event, str) or event not in EventKind.__members__.values():
        raise FormatError(f"{what}: unknown event {event!r}")
    kind = EventKind(event)
    try:
        return JournalEntry(t, _event(kind, line))
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{what}: event `{kind.value}` with missing or wrong keys: {line!r}"[:500]) from None


def _event(kind: EventKind, line: dict) -> JournalEvent:
    if kind is EventKind.RUN:
        created_at = line["created_at"]
        if not isinstance(created_at, int | float) or isinstance(created_at, bool) or not math.isfinite(created_at):
            raise ValueError
        return RunCreated(float(created_at))
    if kind is EventKind.END:
        request_id, num_tokens = line["request_id"], line["num_tokens"]
        if not isinstance(request_id, str) or type(num_tokens) is not int or num_tokens < 0:
            raise ValueError
        return RequestEnded(request_id, num_tokens, FinishStatus(line["status"]))
    references = []
    for request_id, start, end, source in line["references"]:
        if not (isinstance(request_id, str) and isinstance(source, str) and type(start) is int
                and type(end) is int and 0 <= start < end):
            raise ValueError
        references.append(Reference(request_id, start, end, source))
    return ReferencesAdded(tuple(references))
