"""Index backends: where the index's rows live (SQLite file, default; PostgreSQL for several replicas).

The statements (store/index/statements.py, schema.py) are written once for both dialects (`Dialect` fills in
the few words that differ) and run through the typed `Index`/`IndexTransaction`. A backend holds what is its
own: the connection(s), transactions and savepoints, the schema-version record, per-run commit locks that hold
across processes, and translating its driver's errors into the domain errors callers expect
(`RunDeleted`, `StorageFull`, `IndexUnreachable`). Rows come back as mappings by column name on both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Row = Mapping[str, Any]  # a result row: sqlite3.Row or a psycopg dict row, both indexed by column name
Params = Sequence[Any] | Mapping[str, Any]


@dataclass(frozen=True)
class Dialect:
    """The words of SQL that differ between the backends; statements are written with `?` / `:name`."""

    name: str
    greatest: str  # two-argument maximum (SQLite's scalar MAX)
    least: str
    text: str  # every text column (PostgreSQL: byte order, as SQLite compares, so cursors agree with ORDER BY)
    integer: str  # every integer column (PostgreSQL: 64-bit; counters and byte totals pass 2**31)
    real: str
    blob: str
    serial_key: str  # an integer primary key given in insertion order
    without_rowid: str  # table suffix
    json_texts: str  # a query of the texts of a JSON array given as one parameter
    json_pieces: str  # FROM item: each element of a JSON array of [text, lo, hi] as piece, src, lo, hi


class Cursor(Protocol):
    """What a statement answers (sqlite3.Cursor, psycopg.Cursor)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Transaction(Protocol):
    """One open transaction of a backend, used by one thread."""

    def execute(self, sql: str, params: Params = ()) -> Cursor: ...

    def execute_many(self, sql: str, params: Sequence[Params]) -> None: ...

    def savepoint(self) -> AbstractContextManager[None]: ...

    @property
    def active(self) -> bool: ...

    def lock_runs(self, run_ids: Sequence[str]) -> None: ...

    def finish(self, commit: bool) -> None: ...


class Backend(Protocol):
    """One index database."""

    dialect: Dialect
    remote: bool  # a read may wait on the network (a database server), not only on this machine

    def query(self, sql: str, params: Params = ()) -> list[Row]: ...

    def begin(self) -> Transaction: ...

    def ensure_schema(self, version: int, schema: str, migrate: Callable[[Transaction, int], None]) -> None: ...

    def script(self, text: str) -> None: ...

    def close(self) -> None: ...


def is_url(target: str | Path) -> bool:
    """Whether an index target is a PostgreSQL URL (else a SQLite file path)."""
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def open_backend(target: str | Path, fsync: bool = True) -> Backend:
    """The backend of a target: a `postgresql://` URL, or the path of a SQLite file."""
    if is_url(target):
        from replay_service.store.index.backends.postgres import PostgresBackend

        return PostgresBackend(str(target))
    from replay_service.store.index.backends.sqlite import SqliteBackend

    return SqliteBackend(Path(target), fsync=fsync)


@contextmanager
def translating(driver_error: type[Exception], translated: Callable[[Exception], Exception]) -> Iterator[None]:
    """Raise the domain error (replay_service.errors) a driver's error stands for; others pass through unchanged."""
    try:
        yield
    except driver_error as exc:
        domain = translated(exc)
        if domain is exc:
            raise
        raise domain from exc
