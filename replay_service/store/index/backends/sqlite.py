"""The SQLite index backend (the default): one file beside the segments, one writing connection behind one lock.

Contract: WAL, synchronous=FULL (OFF without fsync). `begin` takes this process's lock, then the file's write lock
(`BEGIN IMMEDIATE`, waiting up to `BUSY_TIMEOUT_S` for another process's transaction): every transaction on the file is
serialised, so `lock_runs` has nothing to do. `query` runs inside its thread's open transaction (its writes seen), else
on a pooled read-only connection (every commit seen, no writer waited for). The schema version is `PRAGMA
user_version`; a newer one is `IndexTooNew`. `translated` turns driver errors into RunDeleted / StorageFull.
Design: docs/design/store.md ("The SQLite index").
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from replay_service.errors import IndexTooNew, RunDeleted, StorageFull
from replay_service.store.index.backends import Dialect, Params, Row, Transaction, translating

DIALECT = Dialect(
    name="sqlite", greatest="MAX", least="MIN", text="TEXT", integer="INTEGER", real="REAL", blob="BLOB",
    serial_key="INTEGER PRIMARY KEY", without_rowid=" WITHOUT ROWID",
    json_texts="SELECT value FROM json_each(?)",
    json_pieces="(SELECT key AS piece, value ->> 0 AS src, value ->> 1 AS lo, value ->> 2 AS hi FROM json_each(?))",
)
BUSY_TIMEOUT_S = 60.0  # how long a transaction waits for another process's (a worker's group commit: milliseconds)
RUN_DELETED_MARK = "run deleted while this batch was stored"  # the trigger's message (schema.RUN_DELETED)


def translated(exc: sqlite3.Error) -> Exception:
    """The domain error a driver error stands for, or the error itself."""
    if isinstance(exc, sqlite3.IntegrityError) and RUN_DELETED_MARK in str(exc):
        return RunDeleted(f"{RUN_DELETED_MARK}: nothing of this call was kept; a new batch of this run id starts a "
                          "fresh run")
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return StorageFull(f"the index's disk is full ({exc}): nothing was stored; retry once space is freed")
    return exc


def _translating() -> AbstractContextManager[None]:
    return translating(sqlite3.Error, translated)  # type: ignore[arg-type]


class SqliteTransaction:
    """An IMMEDIATE transaction on the backend's connection (its lock held until `finish`)."""

    def __init__(self, backend: SqliteBackend) -> None:
        self.backend = backend
        self.conn = backend.conn

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        with _translating():
            return self.conn.execute(sql, params)

    def execute_many(self, sql: str, params: Sequence[Params]) -> None:
        """One statement run once per parameter set, in one call."""
        with _translating():
            self.conn.executemany(sql, params)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested step: on an error only its writes are undone, and the error is raised."""
        self.execute("SAVEPOINT batch")
        try:
            yield
        except BaseException:
            if self.conn.in_transaction:  # SQLite may roll the whole transaction back itself (SQLITE_FULL)
                self.execute("ROLLBACK TO batch")
                self.execute("RELEASE batch")
            raise
        self.execute("RELEASE batch")

    @property
    def active(self) -> bool:
        """Whether the transaction is still open (SQLite ends it itself on some errors)."""
        return self.conn.in_transaction

    def lock_runs(self, run_ids: Sequence[str]) -> None:
        """Nothing to do: one writer at a time already (BEGIN IMMEDIATE under the backend's lock)."""

    def finish(self, commit: bool) -> None:
        """Commit or roll back, and let the next transaction in."""
        try:
            if commit or self.conn.in_transaction:  # SQLite may have rolled back itself already
                self.execute("COMMIT" if commit else "ROLLBACK")
        finally:
            self.backend._writer_thread = None
            self.backend.lock.release()


class SqliteBackend:
    """One SQLite file: one writing connection shared by every thread behind one re-entrant lock, and a pool of
    read-only connections for the queries of threads without a transaction."""

    dialect = DIALECT
    remote = False  # a local file: a read waits on no network (and, on a reader connection, on no writer)

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'OFF'}")
        self.lock = threading.RLock()
        self._writer_thread: int | None = None  # the thread whose transaction is open, while one is
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()  # idle reader connections
        self._opened: list[sqlite3.Connection] = []  # every reader connection made, to close them all
        self._opened_lock = threading.Lock()  # not `lock`: a reader is never made to wait for a transaction
        self._closed = False

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        """Every row of one statement: inside this thread's open transaction when there is one (its writes seen),
        else on a reader connection (every committed transaction seen, no writer waited for)."""
        if self._writer_thread == threading.get_ident():
            with self.lock, _translating():
                return self.conn.execute(sql, params).fetchall()
        reader = self._reader()
        try:
            with _translating():
                return reader.execute(sql, params).fetchall()
        finally:
            self._readers.put(reader)

    def _reader(self) -> sqlite3.Connection:
        """An idle reader connection, or a new one (read-only: a write through `query` is an error, not a commit)."""
        try:
            return self._readers.get_nowait()
        except queue.Empty:
            pass
        with self._opened_lock:
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            reader = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                     isolation_level=None, timeout=BUSY_TIMEOUT_S)
            reader.row_factory = sqlite3.Row
            self._opened.append(reader)
        return reader

    def begin(self) -> SqliteTransaction:
        """Open an IMMEDIATE transaction (waits for the one under way)."""
        self.lock.acquire()
        try:
            with _translating():
                self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        self._writer_thread = threading.get_ident()
        return SqliteTransaction(self)

    def ensure_schema(self, version: int, schema: str, migrate: Callable[[Transaction, int], None]) -> None:
        """Bring the file to `version` in one transaction (`migrate(tx, found)` first, then `schema`)."""
        found = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if found > version:
            raise IndexTooNew(f"the index file was written by a newer release (schema {found}; this one knows up to "
                              f"{version}): upgrade the service, or start this release on a copy made before")
        if found < version:
            tx = self.begin()
            try:
                migrate(tx, found)
                tx.execute(f"PRAGMA user_version = {int(version)}")
            except BaseException:
                tx.finish(commit=False)
                raise
            tx.finish(commit=True)
        self.conn.executescript(schema)

    def script(self, text: str) -> None:
        """Run several statements (schema text of a table kept elsewhere: compares.py)."""
        with self.lock:
            self.conn.executescript(text)

    def close(self) -> None:
        """Close the writing connection and every reader connection."""
        with self.lock, self._opened_lock:
            self._closed = True
            for reader in self._opened:
                reader.close()
            self.conn.close()
