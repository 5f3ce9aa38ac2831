"""Domain errors of the service: what went wrong, never how HTTP says it.

Storage, ingest, reads and trainer layouts raise these (and `replay_format.FormatError`
for bytes that break a format's spec). Only `replay_service.api.errors` turns them into
status codes, in one table.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every domain error; `message` is shown to the caller as `detail`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(ServiceError):
    """A run, request or comparison that does not exist."""


class RunDeleted(NotFound):
    """A run deleted while a read or a write of it was under way (store/lifecycle/retention.py): nothing of it is
    served."""

    @classmethod
    def during_read(cls, run_id: str) -> RunDeleted:
        """The error a read answers when its run was deleted after the read took it."""
        return cls(f"run {run_id!r} was deleted while this read was under way")


class InvalidInput(ServiceError):
    """A parameter or body that is well-formed but not acceptable (a bad range, an unknown format name, ...)."""


class Conflict(ServiceError):
    """The input contradicts what is stored (another run shape, a reused seq, a finish that disagrees)."""


class StrictRefusal(Conflict):
    """A strict read met flagged or missing rows; `bad_rows` names the first ones."""

    def __init__(self, message: str, bad_rows: list[dict]) -> None:
        super().__init__(message)
        self.bad_rows = bad_rows


class Unauthenticated(ServiceError):
    """No bearer token, or one the tokens file does not list (api/auth.py)."""


class Forbidden(ServiceError):
    """A known token without the role a route needs, outside its run prefix, or writing another writer's request."""


class TooLarge(ServiceError):
    """A body or an answer over a configured bound."""


class UnsupportedMediaType(ServiceError):
    """A body in a media type the endpoint does not take."""


class BodyTimeout(ServiceError):
    """A request body that did not arrive in time (slower than the configured minimum rate)."""


class ClientClosed(ServiceError):
    """The client closed its connection before its request had arrived (an upload aborted mid-body): nothing of it
    is stored, and nobody is left to answer."""


class StorageFull(ServiceError):
    """The data directory's disk (or quota) is full: nothing was stored, a retry after space returns succeeds."""


class DamagedSegment(ServiceError):
    """A stored segment failed its checksum or cannot be read: its rows are never served (store/segments/integrity.py).

    `path` is the segment's path under the data directory; `newly_found` is True the first time this process
    found it damaged (metrics count segments once, refused requests each time).
    """

    def __init__(self, message: str, path: str, newly_found: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.newly_found = newly_found


class IndexNeedsRebuild(ServiceError):
    """The index is missing or empty beside stored segments: the service does not start (run `reindex`)."""


class SegmentStoreUnreachable(ServiceError):
    """The segment store (REPLAY_SEGMENTS_URL) cannot be listed, read or written: at start-up the service does not
    start; afterwards the request that needed it is refused (503) and nothing of it is stored or served.

    `store` names the store (its URL) for the answer's JSON.
    """

    def __init__(self, message: str, store: str = "") -> None:
        super().__init__(message)
        self.store = store


class IndexUnreachable(ServiceError):
    """The index database (REPLAY_INDEX_URL) cannot be reached: nothing is answered from it (503); at start-up the
    service does not start."""


class IndexTooNew(ServiceError):
    """The index was written by a newer release (a schema version this one does not know): the service does not
    start."""
