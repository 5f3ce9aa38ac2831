"""The store's SQL index: which rows of which segment hold a request, counters, idempotency keys, references.

    index.py       `Index` (reads) and `IndexTransaction` (writes): the typed API; callers never see SQL
    statements.py  the statements those methods run on the core tables, one group per table
    schema.py      the core tables (DDL per dialect), SCHEMA_VERSION and the migrations of older indexes
    records.py     value types and counter-column names (RequestStatus, HeldRows, RequestSpans,
                   RequestCounts, FeedEntry)
    backends/      where the rows live: a SQLite file (default) or a PostgreSQL database (REPLAY_INDEX_URL)

Import the public names from this package. The run-health and comparison tables, and their statements, are
store/tables/health.py and store/tables/compares.py.
"""

from replay_service.store.index.backends import Row
from replay_service.store.index.index import Index, IndexTransaction
from replay_service.store.index.records import (
    COUNTED_FLAGS,
    EXPECTED_ROWS,
    FeedEntry,
    HeldRows,
    RequestCounts,
    RequestSpans,
    RequestStatus,
    count_column,
    load_of,
)
from replay_service.store.index.schema import SCHEMA_VERSION

__all__ = ["COUNTED_FLAGS", "EXPECTED_ROWS", "SCHEMA_VERSION", "FeedEntry", "HeldRows", "Index", "IndexTransaction",
           "RequestCounts", "RequestSpans", "RequestStatus", "Row", "count_column", "load_of"]
