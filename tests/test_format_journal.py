"""The run journal's lines (replay_format/journal.md): written, read back, read as written before versions, and
the lines a reader takes apart (torn) or refuses (named)."""

from __future__ import annotations

import json

import pytest

from replay_format.journal import (
    BadLine,
    JournalEntry,
    ReferencesAdded,
    RequestEnded,
    RunCreated,
    encode_entry,
    parse_journal,
)
from replay_format.request_notes import FinishStatus, Reference

ENTRIES = [
    JournalEntry(1_700_000_000_000_000_001, RunCreated(1_700_000_000.25)),
    JournalEntry(1_700_000_000_000_000_002, RequestEnded("a", 16, FinishStatus.FINISHED)),
    JournalEntry(1_700_000_000_000_000_003, RequestEnded("b", 9, FinishStatus.ABORTED)),
    JournalEntry(1_700_000_000_000_000_004, ReferencesAdded((Reference("c", 0, 4, "a"), Reference("c", 8, 9, "b")))),
]


def test_every_event_reads_back_as_written_with_its_version():
    data = b"".join(encode_entry(e) for e in ENTRIES)
    assert data.count(b"\n") == len(ENTRIES)
    assert all(json.loads(line)["format_version"] == "1.0" for line in data.splitlines())
    read = parse_journal(data, "r/journal.jsonl")
    assert read.entries == ENTRIES and read.bad == []


def test_lines_written_before_versions_read_as_1_0():
    """The service's lines as it wrote them before this format had a version (store/lifecycle/journal.py,
    2026-12-03)."""
    old = (b'{"t":5,"event":"run","created_at":1700000000.5}\n'
           b'{"t":6,"event":"end","request_id":"a","num_tokens":16,"status":"finished"}\n'
           b'{"t":7,"event":"references","references":[["c",0,4,"a"]]}\n')
    read = parse_journal(old, "r/journal.jsonl")
    assert read.bad == []
    assert read.entries == [JournalEntry(5, RunCreated(1700000000.5)),
                            JournalEntry(6, RequestEnded("a", 16, FinishStatus.FINISHED)),
                            JournalEntry(7, ReferencesAdded((Reference("c", 0, 4, "a"),)))]


def test_a_torn_line_is_skipped_and_the_entry_appended_after_it_is_taken():
    whole = [encode_entry(e) for e in ENTRIES]
    torn = whole[1][:20]  # a crash cut this append short; the retry's line went right after it
    data = whole[0] + torn + whole[1] + whole[2] + whole[3][:-9]  # and the last append torn too
    read = parse_journal(data, "r/journal.jsonl")
    assert read.entries == ENTRIES[:3] and read.bad == []


@pytest.mark.parametrize(("line", "why"), [
    ('{"format_version":"2.0","t":1,"event":"end","request_id":"a","num_tokens":1,"status":"finished"}',
     "format_version 2.0 is newer than this reader knows"),
    ('{"format_version":"one","t":1,"event":"run","created_at":1.0}', "is not MAJOR.MINOR"),
    ('{"t":-1,"event":"run","created_at":1.0}', "`t` must be a non-negative integer"),
    ('{"t":"1","event":"run","created_at":1.0}', "`t` must be a non-negative integer"),
    ('{"t":1,"event":"renamed","created_at":1.0}', "unknown event 'renamed'"),
    ('{"t":1,"created_at":1.0}', "unknown event None"),
    ('{"t":1,"event":"run","created_at":"yesterday"}', "event `run` with missing or wrong keys"),
    ('{"t":1,"event":"end","request_id":"a","num_tokens":1,"status":"open"}', "event `end` with missing or wrong"),
    ('{"t":1,"event":"end","request_id":"a","status":"finished"}', "event `end` with missing or wrong keys"),
    ('{"t":1,"event":"references","references":[["c",4,4,"a"]]}', "event `references` with missing or wrong"),
    ('{"t":1,"event":"references","references":[["c",0,4]]}', "event `references` with missing or wrong keys"),
    ('{"t":1,"event":"end","request_id":"a","num_tokens":1,"status":"finished"', "not a JSON object (damaged)"),
    ('\x00\x00\x00\x00', "not a JSON object (damaged)"),
])
def test_a_line_this_reader_cannot_take_is_named_and_the_others_are_read(line, why):
    data = encode_entry(ENTRIES[0]) + line.encode() + b"\n" + encode_entry(ENTRIES[1])
    read = parse_journal(data, "r/journal.jsonl")
    assert read.entries == ENTRIES[:2]
    assert [b.where for b in read.bad] == ["r/journal.jsonl line 2"]
    assert why in read.bad[0].why, read.bad[0]
    assert isinstance(read.bad[0], BadLine)
