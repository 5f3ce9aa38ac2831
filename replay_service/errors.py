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


class InvalidInput(ServiceError):
    """A parameter or body that is well-formed but not acceptable (a bad range, an unknown format name, ...)."""


class Conflict(ServiceError):
    """The input contradicts what is stored (another run shape, a reused seq, a finish that disagrees)."""


class StrictRefusal(Conflict):
    """A strict read met flagged or missing rows; `bad_rows` names the first ones."""

    def __init__(self, message: str, bad_rows: list[dict]) -> None:
        super().__init__(message)
        self.bad_rows = bad_rows


class TooLarge(ServiceError):
    """A body or an answer over a configured bound."""


class UnsupportedMediaType(ServiceError):
    """A body in a media type the endpoint does not take."""
