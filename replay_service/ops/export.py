"""`replay-service export RUN --to FILE.parquet`: a run's rows as one Parquet file, streamed by request.

`export_run(data_dir, run_id, target)` writes one row per request and position, as a route read serves them (GAP
rows included), with the columns of `export_schema`: `request`, `position` (row p routes token p+1's forward pass),
`token` (null if unknown), `experts` (`list<list<uint8|16>>`, [moe layer][k] in the run's MoE-layer order) and
`flags` (replay_format Flag bits, 0: clean); the file's metadata `routing_replay.run` holds the run's shape as JSON.
Read-only on the index and segments, so it may run beside the service; memory stays bounded: one request's rows (at
most `max_read_rows` per piece) and one row group at a time.

Design: docs/design/operations.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay_format import NO_TOKEN, Flag
from replay_service.errors import NotFound
from replay_service.settings import ServiceSettings
from replay_service.store import index_target
from replay_service.store.index import Index, count_column
from replay_service.store.requests.rows import RouteRows, RowReader
from replay_service.store.requests.summaries import expected_rows
from replay_service.store.runs import shape_of
from replay_service.store.segments.cache import SegmentCache
from replay_service.store.segments.places import open_segment_store

ROW_GROUP_ROWS = 1 << 16  # rows buffered before a row group is written


def export_schema(id_type: pa.DataType) -> pa.Schema:
    """The Parquet file's columns for a run whose ids are `id_type`."""
    return pa.schema([("request", pa.string()), ("position", pa.int32()), ("token", pa.int32()),
                      ("experts", pa.list_(pa.list_(id_type))), ("flags", pa.uint16())])


def _table(rows: RouteRows, schema: pa.Schema) -> pa.Table:
    n, layers, k = rows.num_rows, rows.shape.num_moe_layers, rows.shape.top_k
    flat = pa.array(np.ascontiguousarray(rows.experts).reshape(-1), schema.field("experts").type.value_type.value_type)
    inner = pa.FixedSizeListArray.from_arrays(flat, k).cast(pa.list_(flat.type))
    experts = pa.ListArray.from_arrays(pa.array(np.arange(0, n * layers + 1, layers, dtype=np.int32)), inner)
    tokens = pa.array(rows.token_ids, pa.int32(), mask=rows.token_ids == NO_TOKEN)
    return pa.Table.from_arrays([pa.array([rows.request_id] * n, pa.string()), pa.array(rows.positions, pa.int32()),
                                 tokens, experts, pa.array(rows.flags, pa.uint16())], schema=schema)


def export_run(data_dir: Path, run_id: str, target: Path, progress: Callable[[int, int], None] | None = None,
               segments_url: str | None = None, index_url: str | None = None) -> int:
    """Write run `run_id` of `data_dir` to `target` (Parquet); how many rows. NotFound when the run does not exist.

    `progress(done, total)` is called per request. Segments are read from `segments_url` (default:
    REPLAY_SEGMENTS_URL, or `<data_dir>/runs` when unset), the index from `index_url` (default: REPLAY_INDEX_URL,
    or `<data_dir>/index.sqlite` when unset) — the service's own settings, so it exports what the service serves.
    """
    settings = ServiceSettings(data_dir=data_dir)
    index = Index(index_url or index_target(settings), fsync=False)
    try:
        run = index.run(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} not found in {data_dir}")
        shape = shape_of(run)
        segments = open_segment_store(Path(data_dir), segments_url or settings.segments_url)
        reader = RowReader(index, SegmentCache(segments, settings.open_segment_cache,
                                               settings.open_segment_cache_bytes))
        late = count_column(Flag.CONFLICT)
        schema = export_schema(pa.from_numpy_dtype(shape.dtype)).with_metadata(
            {"routing_replay.run": json.dumps({"run_id": run_id, "num_moe_layers": shape.num_moe_layers,
                                               "top_k": shape.top_k, "num_experts": shape.num_experts,
                                               "moe_layers": list(shape.moe_layers)})})
        total = index.run_aggregate(run_id)["requests"]
        done = written = 0
        pending: list[pa.Table] = []
        with pq.ParquetWriter(str(target), schema) as out:
            cursor = ""
            while True:
                page = index.requests_page(run_id, None, cursor, 1000)
                for request in page:
                    end = expected_rows(request)
                    for lo in range(0, end, settings.max_read_rows):
                        hi = min(end, lo + settings.max_read_rows)
                        flags = index.late_flags(run_id, request["request_id"], lo, hi) if request[late] else {}
                        pending.append(_table(reader.route(run_id, request["request_id"], shape, lo, hi, flags),
                                              schema))
                        if sum(t.num_rows for t in pending) >= ROW_GROUP_ROWS:
                            written += _flush(out, pending)
                    done += 1
                    if progress is not None:
                        progress(done, total)
                if len(page) < 1000:
                    break
                cursor = page[-1]["request_id"]
            written += _flush(out, pending)
        return written
    finally:
        index.close()


def _flush(out: pq.ParquetWriter, pending: list[pa.Table]) -> int:
    """Write the buffered tables as one row group; how many rows."""
    if not pending:
        return 0
    table = pa.concat_tables(pending)
    pending.clear()
    out.write_table(table, row_group_size=max(1, table.num_rows))
    return table.num_rows
