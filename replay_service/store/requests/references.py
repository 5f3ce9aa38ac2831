"""Prefix-cache references: a request's positions served by the rows another request stored, stored once.

A reference says request R's positions `[start, end)` hold the rows source S stored at the same positions. Contract:
resolving copies no row, it mirrors S's spans into R (sliced to the range; R's counters grow by the positions it did
not serve yet), at whichever of the two arrives second (`Resolver.add`: a reference after S's rows;
`Resolver.propagate`: S's rows after the reference, at their commit), chains included, each piece exactly once, in
the one transaction of the run that stores it. A mirrored row at a position R already holds follows the repeat rule
(`judge_repeats`, checks/check.py).
Design: docs/design/store.md ("Prefix-cache references").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_format import RunShape
from replay_format.request_notes import Reference
from replay_format.weight_versions import WeightVersions
from replay_service.checks.check import judge_repeats
from replay_service.store.index import HeldRows, IndexTransaction, RequestCounts
from replay_service.store.requests.rows import Pieces, RowReader


@dataclass
class Resolution:
    """What one call resolved: references new to the store, rows newly served through references."""

    new: int = 0
    rows_resolved: int = 0


class Resolver:
    """Mirrors sources' rows into referencing requests, inside one index transaction of one run."""

    def __init__(self, tx: IndexTransaction, reader: RowReader, run_id: str, shape: RunShape) -> None:
        self.tx = tx
        self.reader = reader  # its index reads run on the transaction's connection: they see its writes
        self.run_id = run_id
        self.shape = shape

    def add(self, references: list[Reference]) -> Resolution:
        """Record references (a known one is a no-op) and mirror what their sources already hold."""
        done = Resolution()
        for ref in references:
            if not self.tx.insert_reference(self.run_id, ref.request_id, ref.start, ref.end, ref.source_request_id):
                continue
            done.new += 1
            for span in self.tx.spans(self.run_id, ref.source_request_id, ref.start, ref.end - 1):
                held = HeldRows(ref.source_request_id, span["segment_id"], span["path"], span["row_start"],
                                span["row_count"], span["pos_min"], span["pos_max"])
                mirrored, rows = self._mirror(held, ref)
                done.rows_resolved += rows + self.propagate(mirrored)
        return done

    def propagate(self, held: list[HeldRows]) -> int:
        """Mirror rows a request just came to hold into every request referencing it (chains included).

        Returns the rows newly served through references.
        """
        resolved = 0
        work = list(held)
        while work:  # in rounds: one query finds the references of every piece of a round
            found = self.tx.references_from(self.run_id, [(p.request_id, p.pos_min, p.pos_max) for p in work])
            pieces, work = work, []
            for i, request_id, start, end in found:
                mirrored, rows = self._mirror(pieces[i], Reference(request_id, start, end, pieces[i].request_id))
                work += mirrored
                resolved += rows
        return resolved

    def _mirror(self, held: HeldRows, ref: Reference) -> tuple[list[HeldRows], int]:
        """`held`'s rows at the reference's positions, as spans of the referencing request (those it lacks)."""
        rows = self.reader.rows_of(held.path, held.row_start, held.row_count, self.shape.row_width)
        positions = rows.positions  # a span's rows are sorted by position
        lo, hi = (int(i) for i in np.searchsorted(positions, [ref.start, ref.end]))
        if lo >= hi:
            return [], 0
        mirrored, resolved = [], 0
        already = self.tx.held_in_segment(self.run_id, ref.request_id, held.segment_id, int(positions[lo]),
                                          int(positions[hi - 1]))
        for a, b in _subtract((held.row_start + lo, held.row_start + hi), already):
            span_positions = positions[a - held.row_start : b - held.row_start]
            span = HeldRows(ref.request_id, held.segment_id, held.path, a, b - a, int(span_positions[0]),
                            int(span_positions[-1]))
            resolved += self._serve(span, rows.take(slice(a - held.row_start, b - held.row_start)))
            mirrored.append(span)
        return mirrored, resolved

    def _serve(self, span: HeldRows, rows: Pieces) -> int:
        """Insert one mirrored span (`rows` are its segment rows) and count its rows at positions the request did
        not serve yet."""
        request_id = span.request_id
        positions, experts, flags, versions = rows.positions, rows.experts, rows.flags, rows.versions
        first = np.concatenate(([True], positions[1:] != positions[:-1]))  # the row served per position
        positions, experts, flags, versions = positions[first], experts[first], flags[first], versions.take(first)
        stored = self.reader.stored_rows(self.run_id, request_id, self.shape, positions)
        repeat = np.zeros(len(positions), np.bool_)
        conflicts: list[int] = []
        recomputed: list[int] = []
        if len(stored.positions):
            m = len(stored.positions)
            every = np.concatenate([stored.positions, positions])
            order = np.argsort(every, kind="stable")  # per position: what R held first, then the mirrored row
            codes = WeightVersions.concat([stored.versions, versions]).index
            verdicts = judge_repeats(every[order].astype(np.int64), np.concatenate([stored.experts, experts])[order],
                                     codes[order])
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            repeat = verdicts.repeat[back][m:]
            conflicts = positions[verdicts.conflict[back][m:]].tolist()
            counted = stored.positions[verdicts.recompute[back][:m]]  # recomputes R held before: counted then
            recomputed = np.setdiff1d(positions[verdicts.recompute[back][m:]], counted).tolist()
        new = ~repeat
        n_new = int(np.count_nonzero(new))
        self.tx.insert_spans(self.run_id, [span])
        self.tx.add_counts(self.run_id, [RequestCounts.of_rows(request_id, positions[new], flags[new],
                                                               pos_max=int(positions[-1]), referenced=n_new)])
        spans = versions.take(new).spans(positions[new])
        self.tx.add_versions(self.run_id, request_id, [(s.version, s.start, s.end) for s in spans])
        for position in conflicts:
            self.tx.mark_conflict(self.run_id, request_id, int(position))
        self.tx.add_recomputed(self.run_id, request_id, recomputed)
        return n_new


def _subtract(span: tuple[int, int], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of row range `[lo, hi)` outside every `(row_start, row_count)` of `taken`."""
    parts = [span]
    for start, count in taken:
        cut = []
        for a, b in parts:
            if start + count <= a or start >= b:
                cut.append((a, b))
                continue
            if a < start:
                cut.append((a, start))
            if start + count < b:
                cut.append((start + count, b))
        parts = cut
    return parts
