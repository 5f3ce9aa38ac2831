"""Levels of a health verdict, and how one figure is judged against its limit."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Level(enum.IntEnum):
    """A check's or a verdict's level; a verdict is the worst level of its checks."""

    OK = 0
    WARN = 1
    FAIL = 2

    @property
    def label(self) -> str:
        """The name the API answers with: `ok`, `warn`, `fail`."""
        return self.name.lower()


@dataclass(frozen=True)
class Limit:
    """A check's limits: `fail` when the figure is above `fail`, else `warn` when above `warn` (None: never).

    A limit of 0 means "any": one row of the kind is enough.
    """

    warn: float | None = None
    fail: float | None = None

    def judge(self, value: float | None) -> Level:
        """The level of a figure (None, a figure that cannot be known here, is ok)."""
        if value is None:
            return Level.OK
        if self.fail is not None and value > self.fail:
            return Level.FAIL
        if self.warn is not None and value > self.warn:
            return Level.WARN
        return Level.OK

    def bound(self, level: Level) -> float | None:
        """The limit a figure passed to reach `level`."""
        return self.fail if level is Level.FAIL else self.warn

    def to_json(self) -> dict[str, float | None]:
        """`{"warn": .., "fail": ..}`."""
        return {"warn": self.warn, "fail": self.fail}
