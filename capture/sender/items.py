"""What the sender posts, one call each, in order; and how its batcher thread makes them (`route_sender.py`).

An `Item` is a row batch (`replay_format.rows`), a request's finish, or prefix-cache references: its header is what a
spill file says (`replay_format.spill`), its payload the body. `ItemMaker` turns what was submitted, in order, into
items, numbering each with this writer's next `seq`. It is the batcher thread's alone, so it takes no lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from capture.sender.config import SenderConfig
from capture.sender.row_chunk import RowChunk
from replay_format.request_notes import Finish, Reference, references_body, references_path
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.spill import ItemKind, SpillHeader, created_ns, decode_item

# What waits to be batched, in order: rows, a request's end, or prefix-cache references.
Pending = RowChunk | Finish | list[Reference]


@dataclass
class Item:
    """One thing to post, in order: a row batch, a finish call or references (its header is what a spill file says)."""

    header: SpillHeader
    payload: bytes
    created_ns: int = field(default_factory=time.time_ns)  # spill files sort by it: creation order

    @property
    def kind(self) -> ItemKind:
        """What the item is: a row batch, a finish or references."""
        return self.header.kind

    @property
    def seq(self) -> int:
        """The writer's sequence number the service stores it under once."""
        return self.header.seq

    @property
    def rows(self) -> int:
        """Rows in a batch (0 for the other kinds)."""
        return self.header.rows

    @classmethod
    def from_spill_file(cls, name: str, data: bytes) -> Item:
        """The item a spill file holds (`replay_format.spill`); raises FormatError when it cannot be read."""
        header, payload = decode_item(data)
        return cls(header, payload, created_ns(name))


class ItemMaker:
    """Submitted entries to items in order, each with the writer's next `seq` (the batcher thread's own)."""

    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self._seq = 0
        # References wait for this writer's first row batch: the run exists by then (a GRPO group's
        # samples hit each other's blocks in the very first step), and the service resolves them either way.
        self._held_references: list[Reference] = []
        self._made_batch = False

    def items(self, taken: list[Pending], closing: bool = False) -> Iterator[Item]:
        """Pending entries to items in order: consecutive rows merge into batches of <= batch_rows.

        References go after the rows taken with them (once this writer made a batch, or at close).
        """
        chunks: list[RowChunk] = []
        for entry in taken:
            if isinstance(entry, RowChunk):
                chunks.append(entry)
                if sum(c.num_rows for c in chunks) >= self.config.batch_rows:
                    yield self._batch(chunks)
                    chunks = []
                continue
            if not isinstance(entry, Finish):  # references
                self._held_references += entry
                continue
            if chunks:
                yield self._batch(chunks)
                chunks = []
            header = SpillHeader(ItemKind.FINISH, self._next_seq(), path=entry.path(self.config.run_id))
            yield Item(header, entry.body())
        if chunks:
            yield self._batch(chunks)
        if self._held_references and (self._made_batch or closing):
            held, self._held_references = self._held_references, []
            yield Item(SpillHeader(ItemKind.REFERENCES, self._next_seq(), path=references_path(self.config.run_id)),
                       references_body(held))

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _batch(self, chunks: list[RowChunk]) -> Item:
        self._made_batch = True
        cfg = self.config
        rows = RowChunk.merged(chunks)
        seq = self._next_seq()
        meta = RowsMeta(cfg.run_id, cfg.writer_id, seq, cfg.shape, source=cfg.source)
        batch = build_rows(meta, rows.requests.to_arrow(), rows.positions, rows.experts, token_ids=rows.token_ids,
                           flags=rows.flags, weight_versions=rows.versions)
        return Item(SpillHeader(ItemKind.BATCH, seq, rows=rows.num_rows), encode_stream(batch))
