"""The embedded route store: a directory of Arrow IPC segment files plus a SQLite index.

Layout under the data directory:

    index.sqlite                      spans, counters, idempotency keys (WAL)
    runs/<run_id>/<uuid>.arrow        one segment per acknowledged ingest batch

An ingest is acknowledged after its segment is fsynced and renamed into place
and its index rows are committed (synchronous=FULL). Reading a request asks the
index for its spans (segment, row range, position range) and slices the
memory-mapped segments: no file of the run is scanned.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from replay_format import Flag, RunShape

from replay_format.rows import RowsMeta
from replay_service import checks
from replay_service.buffers import BufferPool
from replay_service.decode import IncomingRows
from replay_service.errors import Conflict, InvalidInput, NotFound
from replay_service.settings import ServiceSettings
from replay_service.store.compares import CompareStore
from replay_service.store.files import SegmentCache, sweep_unindexed, write_segment
from replay_service.store.index import COUNT_COLUMNS, COUNTED_FLAGS, Index, moe_layers_json
from replay_service.store.reads import RouteRows, assemble_route


@dataclass
class IngestResult:
    stored: bool  # False: this (run, writer, seq) was stored before; nothing written
    rows: int
    padding_dropped: int = 0
    flagged: dict[str, int] = field(default_factory=dict)
    bytes: int = 0


@dataclass
class _RunState:
    shape: RunShape
    load: np.ndarray  # (L, E) int64: clean rows' expert counts
    lock: threading.Lock = field(default_factory=threading.Lock)
    check_content: bool = False


def _request_keys(run_id: str, request_ids: list[str]) -> np.ndarray:
    # Keys for the in-memory STALE table only; Python's salted hash is fine there.
    return np.array([hash((run_id, r)) & 0x7FFFFFFFFFFFFFFF for r in request_ids], np.int64)


class RouteStore:
    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.root = Path(settings.data_dir)
        self.segments_root = self.root / "runs"
        self.segments_root.mkdir(parents=True, exist_ok=True)
        self.index = Index(self.root / "index.sqlite", fsync=settings.fsync)
        self.swept = sweep_unindexed(self.segments_root, self.index.indexed_paths())
        self.cache = SegmentCache(self.segments_root, settings.open_segment_cache)
        self.staging = BufferPool(keep=settings.max_concurrent_ingests)  # segment images before they are written
        self.recent = checks.RecentRows(settings.stale_table_rows)
        self.compares = CompareStore(self.root / "compares", self.index, fsync=settings.fsync)
        self._runs: dict[str, _RunState] = {}
        self._runs_lock = threading.Lock()
        checks.warm_up()

    def close(self) -> None:
        self.index.close()

    # ---- runs -------------------------------------------------------------

    def _load_run(self, run_id: str) -> _RunState | None:
        with self._runs_lock:
            state = self._runs.get(run_id)
            if state is not None:
                return state
            row = self.index.one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
            if row is None:
                return None
            shape = RunShape(row["num_layers"], row["top_k"], row["num_experts"], tuple(_json_list(row["moe_layers"])))
            load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
            if row["load"] is not None:
                load[:] = np.frombuffer(row["load"], np.int64).reshape(load.shape)
            state = self._new_state(shape, load)
            self._runs[run_id] = state
            return state

    def _new_state(self, shape: RunShape, load: np.ndarray) -> _RunState:
        bits = checks.route_entropy_bits(shape.num_moe_layers, shape.top_k, shape.num_experts)
        return _RunState(shape, load, check_content=bits >= self.settings.stale_min_entropy_bits)

    def _run_for_ingest(self, meta: RowsMeta) -> _RunState:
        state = self._load_run(meta.run_id)
        if state is None:
            with self._runs_lock:
                state = self._runs.get(meta.run_id)
                if state is None:
                    shape = meta.shape
                    with self.index.transaction() as tx:
                        tx.execute(
                            "INSERT INTO runs (run_id, num_layers, top_k, num_experts, moe_layers, source, created_at)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (meta.run_id, shape.num_moe_layers, shape.top_k, shape.num_experts,
                             moe_layers_json(shape.moe_layers), meta.source, time.time()),
                        )
                    state = self._new_state(shape, np.zeros((shape.num_moe_layers, shape.num_experts), np.int64))
                    self._runs[meta.run_id] = state
        if state.shape != meta.shape:
            raise Conflict(
                f"run {meta.run_id!r} stores rows of {state.shape.num_moe_layers} layers x top-{state.shape.top_k} "
                f"of {state.shape.num_experts} experts (MoE layers {list(state.shape.moe_layers)}); this batch has "
                f"{meta.shape.num_moe_layers} x top-{meta.shape.top_k} of {meta.shape.num_experts} "
                f"(MoE layers {list(meta.shape.moe_layers)})")
        return state

    def run_shape(self, run_id: str) -> RunShape:
        state = self._load_run(run_id)
        if state is None:
            raise NotFound(f"run {run_id!r} not found")
        return state.shape

    def has_run(self, run_id: str) -> bool:
        return self._load_run(run_id) is not None

    # ---- ingest -----------------------------------------------------------

    def _stored_digest(self, meta: RowsMeta) -> str | None:
        row = self.index.one(
            "SELECT digest FROM segments WHERE run_id = ? AND writer_id = ? AND seq = ?",
            (meta.run_id, meta.writer_id, meta.seq),
        )
        return row["digest"] if row else None

    def ingest(self, rows: IncomingRows) -> IngestResult:
        meta = rows.meta
        state = self._run_for_ingest(meta)
        shape = state.shape

        padding = (rows.flags & Flag.PADDING) != 0
        padding_per_request = np.bincount(rows.request_index[padding], minlength=len(rows.request_ids))
        if padding.any():
            keep = ~padding
            rows = IncomingRows(meta, rows.request_ids, rows.request_index[keep], rows.positions[keep],
                                rows.token_ids[keep], rows.experts[keep], rows.flags[keep])
        order_key = (rows.request_index.astype(np.int64) << 32) | rows.positions.astype(np.int64)
        if rows.num_rows > 1 and not np.all(order_key[1:] >= order_key[:-1]):
            order = np.argsort(order_key, kind="stable")
            order_key = order_key[order]
            rows = IncomingRows(meta, rows.request_ids, rows.request_index[order], rows.positions[order],
                                rows.token_ids[order], rows.experts[order], rows.flags[order])

        load = np.zeros_like(state.load)
        content_flags, hashes = checks.check_rows(
            rows.experts, shape.num_moe_layers, shape.top_k, shape.num_experts, np.zeros(rows.num_rows, np.bool_), load
        )
        digest = f"{rows.num_rows}:{int(hashes.sum(dtype=np.uint64))}:{int(order_key.sum(dtype=np.int64))}"
        previous = self._stored_digest(meta)
        if previous is not None:
            return self._duplicate(meta, previous, digest, rows.num_rows)

        flags = content_flags | (rows.flags & Flag.STALE)
        # Same position twice inside this batch: identical is a resend, different is a conflict.
        same_pos = np.flatnonzero(order_key[1:] == order_key[:-1])
        # `shadowed`: rows at a position an earlier row already holds; the earlier one is served.
        shadowed = np.zeros(rows.num_rows, np.bool_)
        for i in same_pos:
            shadowed[i + 1] = True
            if not np.array_equal(rows.experts[i], rows.experts[i + 1]):
                flags[i] |= Flag.CONFLICT
                flags[i + 1] |= Flag.CONFLICT

        if state.check_content:
            keys = _request_keys(meta.run_id, rows.request_ids)[rows.request_index]
            stale = self.recent.check_and_add(hashes, keys, rows.positions, rows.token_ids, (flags == 0) & ~shadowed)
            flags[stale] |= Flag.STALE

        # The segment is durable before the run lock is taken: concurrent ingests overlap
        # their checks, writes and fsyncs; the lock covers only the index transaction.
        rel_path = f"{meta.run_id}/{uuid.uuid4().hex}.arrow"
        size = write_segment(self.segments_root / rel_path, _segment_batch(rows, flags, shape), self.staging,
                             fsync=self.settings.fsync, direct=self.settings.direct_io)
        try:
            with state.lock:
                previous = self._stored_digest(meta)  # a concurrent retry may have landed meanwhile
                if previous is not None:
                    (self.segments_root / rel_path).unlink(missing_ok=True)
                    return self._duplicate(meta, previous, digest, rows.num_rows)
                earlier_conflicts = self._check_overlaps(meta.run_id, rows, shadowed)
                if shadowed.any():  # only served rows count towards expert load
                    uncount = shadowed & (content_flags == 0)
                    unload = np.zeros_like(load)
                    checks.check_rows(rows.experts[uncount], shape.num_moe_layers, shape.top_k, shape.num_experts,
                                      np.zeros(int(uncount.sum()), np.bool_), unload)
                    load -= unload
                self._commit(meta, state, rows, flags, shadowed, padding_per_request, earlier_conflicts,
                             rel_path, size, digest, load)
                state.load += load
        except Exception:
            (self.segments_root / rel_path).unlink(missing_ok=True)
            raise
        counted = flags[~shadowed]
        flagged = {f.name: int(np.count_nonzero(counted & f)) for f in COUNTED_FLAGS if f != Flag.PADDING}
        if earlier_conflicts:
            flagged["CONFLICT"] += len(earlier_conflicts)
        return IngestResult(True, rows.num_rows, int(padding.sum()), {k: v for k, v in flagged.items() if v}, size)

    def _duplicate(self, meta: RowsMeta, previous: str, digest: str, num_rows: int) -> IngestResult:
        if previous != digest:
            raise Conflict(
                f"writer {meta.writer_id!r} already stored seq {meta.seq} in run {meta.run_id!r} with other rows; "
                "a retry must resend the same batch, new rows need a new seq")
        return IngestResult(False, num_rows)

    def _check_overlaps(self, run_id: str, rows: IncomingRows, shadowed: np.ndarray) -> list[tuple]:
        """Compare incoming rows with stored rows at the same positions.

        Every such incoming row is shadowed (kept on disk; the stored row is the
        one served and counted). A different one makes the served row CONFLICT:
        returns those (request, position) for the index's row_flags.
        """
        earlier: list[tuple] = []
        for lo, hi in _request_spans(rows):
            request_id = rows.request_ids[rows.request_index[lo]]
            pos = rows.positions[lo:hi]
            spans = self.index.query(
                "SELECT s.row_start, s.row_count, g.path FROM spans s JOIN segments g USING (segment_id)"
                " WHERE s.run_id = ? AND s.request_id = ? AND s.pos_max >= ? AND s.pos_min <= ?",
                (run_id, request_id, int(pos[0]), int(pos[-1])),
            )
            for span in spans:
                stored = self.cache.get(span["path"]).slice(span["row_start"], span["row_count"])
                stored_pos = stored.column("position").to_numpy()
                common, in_new, in_old = np.intersect1d(pos, stored_pos, assume_unique=False, return_indices=True)
                if not common.size:
                    continue
                stored_experts = stored.column("experts").flatten().to_numpy().reshape(len(stored_pos), -1)
                for position, i_new, i_old in zip(common.tolist(), (in_new + lo).tolist(), in_old.tolist()):
                    shadowed[i_new] = True
                    if not np.array_equal(rows.experts[i_new], stored_experts[i_old]):
                        earlier.append((request_id, position))
        return earlier

    def _commit(self, meta, state, rows, flags, shadowed, padding_per_request, earlier_conflicts,
                rel_path, size, digest, load) -> None:
        with self.index.transaction() as tx:
            cur = tx.execute(
                "INSERT INTO segments (run_id, writer_id, seq, path, rows, bytes, digest) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (meta.run_id, meta.writer_id, meta.seq, rel_path, rows.num_rows, size, digest),
            )
            segment_id = cur.lastrowid
            seen_requests = set()
            for lo, hi in _request_spans(rows):
                req_idx = int(rows.request_index[lo])
                request_id = rows.request_ids[req_idx]
                seen_requests.add(req_idx)
                pos = rows.positions[lo:hi]
                tx.execute(
                    "INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (meta.run_id, request_id, segment_id, lo, hi - lo, int(pos[0]), int(pos[-1])),
                )
                fresh = ~shadowed[lo:hi]
                span_flags = flags[lo:hi][fresh]
                counts = [int(np.count_nonzero(span_flags & f)) for f in COUNTED_FLAGS]
                counts[-1] = int(padding_per_request[req_idx])
                flagged_pos = pos[fresh][span_flags != 0]
                first_flagged = int(flagged_pos[0]) if flagged_pos.size else None
                self._bump_request(tx, meta.run_id, request_id, int(np.count_nonzero(fresh)), int(pos[-1]),
                                   int(np.bitwise_or.reduce(span_flags)) if span_flags.size else 0, first_flagged, counts)
            for req_idx in np.flatnonzero(padding_per_request).tolist():
                if req_idx not in seen_requests:  # a request whose rows were all padding this batch
                    counts = [0] * len(COUNTED_FLAGS)
                    counts[-1] = int(padding_per_request[req_idx])
                    self._bump_request(tx, meta.run_id, rows.request_ids[req_idx], 0, -1, 0, None, counts)
            for request_id, position in earlier_conflicts:
                known = tx.execute(
                    "SELECT flags FROM row_flags WHERE run_id = ? AND request_id = ? AND position = ?",
                    (meta.run_id, request_id, position),
                ).fetchone()
                if known is not None and known["flags"] & Flag.CONFLICT:
                    continue
                tx.execute(
                    "INSERT INTO row_flags VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE SET flags = flags | excluded.flags",
                    (meta.run_id, request_id, position, int(Flag.CONFLICT)),
                )
                tx.execute(
                    "UPDATE requests SET n_conflict = n_conflict + 1, flag_bits = flag_bits | ?,"
                    " first_flagged = MIN(COALESCE(first_flagged, ?), ?) WHERE run_id = ? AND request_id = ?",
                    (int(Flag.CONFLICT), position, position, meta.run_id, request_id),
                )
            tx.execute(
                "UPDATE runs SET bytes = bytes + ?, load = ? WHERE run_id = ?",
                (size, (state.load + load).tobytes(), meta.run_id),
            )

    @staticmethod
    def _bump_request(tx, run_id, request_id, new_rows, pos_max, flag_bits, first_flagged, counts) -> None:
        sets = ", ".join(f"{c} = {c} + ?" for c in COUNT_COLUMNS)
        tx.execute(
            "INSERT INTO requests (run_id, request_id) VALUES (?, ?) ON CONFLICT DO NOTHING", (run_id, request_id)
        )
        tx.execute(
            f"UPDATE requests SET rows = rows + ?, pos_max = MAX(pos_max, ?), flag_bits = flag_bits | ?,"
            f" first_flagged = CASE WHEN ? IS NULL THEN first_flagged ELSE MIN(COALESCE(first_flagged, ?), ?) END,"
            f" {sets} WHERE run_id = ? AND request_id = ?",
            (new_rows, pos_max, flag_bits, first_flagged, first_flagged, first_flagged, *counts, run_id, request_id),
        )

    # ---- finish -----------------------------------------------------------

    def finish(self, run_id: str, request_id: str, num_tokens: int, status: str) -> dict:
        if not self.has_run(run_id):
            raise NotFound(f"run {run_id!r} not found")
        with self.index.transaction() as tx:
            row = tx.execute(
                "SELECT final_tokens, status FROM requests WHERE run_id = ? AND request_id = ?", (run_id, request_id)
            ).fetchone()
            if row is not None and row["final_tokens"] is not None and (
                row["final_tokens"] != num_tokens or row["status"] != status
            ):
                raise Conflict(
                    f"request {request_id!r} was already {row['status']} with {row['final_tokens']} tokens; "
                    f"got {status} with {num_tokens}")
            tx.execute(
                "INSERT INTO requests (run_id, request_id) VALUES (?, ?) ON CONFLICT DO NOTHING", (run_id, request_id)
            )
            tx.execute(
                "UPDATE requests SET final_tokens = ?, status = ? WHERE run_id = ? AND request_id = ?",
                (num_tokens, status, run_id, request_id),
            )
        return self.request_summary(run_id, request_id)

    # ---- reads ------------------------------------------------------------

    def request_row(self, run_id: str, request_id: str):
        if not self.has_run(run_id):
            raise NotFound(f"run {run_id!r} not found")
        row = self.index.one("SELECT * FROM requests WHERE run_id = ? AND request_id = ?", (run_id, request_id))
        if row is None:
            raise NotFound(f"request {request_id!r} not found in run {run_id!r}")
        return row

    def request_summary(self, run_id: str, request_id: str) -> dict:
        return request_summary(self.request_row(run_id, request_id))

    def read_route(self, run_id: str, request_id: str, start: int = 0, end: int | None = None) -> RouteRows:
        """Rows `[start, end)` of a request, dense by position: a missing position is a GAP row."""
        shape = self.run_shape(run_id)
        row = self.request_row(run_id, request_id)
        expected = _expected_rows(row)
        if end is None:
            end = expected
        if start < 0 or end < start:
            raise InvalidInput(f"bad range start={start} end={end}")
        if end - start > self.settings.max_read_rows:
            raise InvalidInput(
                f"range {start}..{end} is {end - start} rows, more than one read returns "
                f"(REPLAY_MAX_READ_ROWS={self.settings.max_read_rows}); read it in pieces with start/end")
        spans = self.index.query(
            "SELECT s.row_start, s.row_count, g.path FROM spans s JOIN segments g USING (segment_id)"
            " WHERE s.run_id = ? AND s.request_id = ? AND s.pos_max >= ? AND s.pos_min < ?"
            " ORDER BY s.segment_id",
            (run_id, request_id, start, end),
        )
        pieces = [self.cache.get(s["path"]).slice(s["row_start"], s["row_count"]) for s in spans]
        extra = {}
        if row["n_conflict"]:
            extra = {
                r["position"]: r["flags"]
                for r in self.index.query(
                    "SELECT position, flags FROM row_flags WHERE run_id = ? AND request_id = ? AND position >= ? AND position < ?",
                    (run_id, request_id, start, end),
                )
            }
        return assemble_route(request_id, shape, pieces, start, end, extra)

    def runs(self) -> list[dict]:
        out = []
        for run in self.index.query("SELECT * FROM runs ORDER BY run_id"):
            out.append(self._run_summary(run))
        return out

    def run_summary(self, run_id: str) -> dict:
        run = self.index.one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return self._run_summary(run)

    def _run_summary(self, run) -> dict:
        sums = ", ".join(f"COALESCE(SUM({c}), 0) AS {c}" for c in COUNT_COLUMNS)
        agg = self.index.one(
            f"SELECT COUNT(*) AS requests, COALESCE(SUM(rows), 0) AS rows,"
            f" COALESCE(SUM(status != 'open'), 0) AS ended,"
            f" COALESCE(SUM(MAX(COALESCE(final_tokens - 1, pos_max + 1) - rows, 0)), 0) AS gap, {sums}"
            f" FROM requests WHERE run_id = ?",
            (run["run_id"],),
        )
        flagged = {c[2:].upper(): agg[c] for c in COUNT_COLUMNS}
        flagged["GAP"] = agg["gap"]
        return {
            "run_id": run["run_id"],
            "num_layers": run["num_layers"],
            "top_k": run["top_k"],
            "num_experts": run["num_experts"],
            "moe_layers": _json_list(run["moe_layers"]),
            "dtype": str(RunShape(run["num_layers"], run["top_k"], run["num_experts"]).dtype),
            "source": run["source"],
            "created_at": run["created_at"],
            "requests": agg["requests"],
            "requests_ended": agg["ended"],
            "rows": agg["rows"],
            "bytes": run["bytes"],
            "flagged": flagged,
        }

    def list_requests(self, run_id: str, flag: Flag | None, cursor: str | None, limit: int) -> dict:
        if not self.has_run(run_id):
            raise NotFound(f"run {run_id!r} not found")
        where = ["run_id = ?"]
        params: list = [run_id]
        if cursor:
            where.append("request_id > ?")
            params.append(cursor)
        if flag is not None:
            if flag == Flag.GAP:
                where.append("COALESCE(final_tokens - 1, pos_max + 1) - rows > 0")
            else:
                where.append(f"n_{flag.name.lower()} > 0")
        rows = self.index.query(
            f"SELECT * FROM requests WHERE {' AND '.join(where)} ORDER BY request_id LIMIT ?", (*params, limit + 1)
        )
        items = [request_summary(r) for r in rows[:limit]]
        return {"items": items, "next_cursor": items[-1]["request_id"] if len(rows) > limit else None}

    def expert_load(self, run_id: str) -> tuple[RunShape, np.ndarray]:
        state = self._load_run(run_id)
        if state is None:
            raise NotFound(f"run {run_id!r} not found")
        with state.lock:
            return state.shape, state.load.copy()


def _request_spans(rows: IncomingRows) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of one request each (rows are sorted by request on ingest)."""
    bounds = np.flatnonzero(np.diff(rows.request_index)) + 1
    return list(zip([0, *bounds.tolist()], [*bounds.tolist(), rows.num_rows]))


def _json_list(text: str) -> list[int]:
    return list(json.loads(text))


def _expected_rows(row) -> int:
    """A finished request of T tokens has T-1 rows; an open one, up to the last position seen."""
    if row["final_tokens"] is not None:
        return max(row["final_tokens"] - 1, 0)
    return row["pos_max"] + 1


def request_summary(row) -> dict:
    expected = _expected_rows(row)
    flagged = {c[2:].upper(): row[c] for c in COUNT_COLUMNS}
    flagged["GAP"] = max(expected - row["rows"], 0)
    return {
        "request_id": row["request_id"],
        "status": row["status"],
        "num_tokens": row["final_tokens"],
        "rows": row["rows"],
        "expected_rows": expected,
        "first_flagged_position": row["first_flagged"],
        "flagged": flagged,
        "clean": not any(v for k, v in flagged.items() if k != "PADDING"),
    }


def _segment_batch(rows: IncomingRows, flags: np.ndarray, shape: RunShape) -> pa.RecordBatch:
    return rows.to_record_batch(flags)
