"""The rules of run health: its checks, their default limits, and a run's overrides of them (not the row checks
of `replay_service.checks`).

Each `Check` has a figure over its scope (a run, its recent window, or a training batch): the row checks
(`ROW_FLAG_CHECKS`: ZERO, STALE, OUT_OF_RANGE, DUPLICATE, CONFLICT, GAP; and FALLBACK), UNRESOLVED references, OPEN
and MISSING requests (`BATCH_ONLY`), RECOMPUTED and STALENESS (no default limit), and the newest comparison's
ROUTER_MISMATCH and TOKEN_MISMATCH. `Thresholds` holds a `{"warn", "fail"}` limit per check: the defaults, merged
with a run's overrides (`PUT /v1/runs/{run}/health/thresholds`).

Design: docs/design/service_data.md; the defaults: docs/health.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from replay_format import Flag
from replay_service.errors import InvalidInput
from replay_service.health.verdict import Limit


class Check(enum.StrEnum):
    """The checks, in the order a report lists them."""

    ZERO = "ZERO"
    STALE = "STALE"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    DUPLICATE = "DUPLICATE"
    CONFLICT = "CONFLICT"
    GAP = "GAP"
    FALLBACK = "FALLBACK"
    UNRESOLVED = "UNRESOLVED"
    OPEN = "OPEN"
    MISSING = "MISSING"
    RECOMPUTED = "RECOMPUTED"
    STALENESS = "STALENESS"
    ROUTER_MISMATCH = "ROUTER_MISMATCH"
    TOKEN_MISMATCH = "TOKEN_MISMATCH"

    @property
    def flag(self) -> Flag | None:
        """The row flag this check counts (GAP included), None for the others."""
        return Flag[self.value] if self.value in Flag.__members__ else None


ROW_FLAG_CHECKS = (Check.ZERO, Check.STALE, Check.OUT_OF_RANGE, Check.DUPLICATE, Check.CONFLICT, Check.GAP)
BATCH_ONLY = frozenset({Check.OPEN, Check.MISSING})

ANY = 0.0
DEFAULTS: Mapping[Check, Limit] = {
    Check.ZERO: Limit(fail=ANY),
    Check.STALE: Limit(fail=ANY),
    Check.OUT_OF_RANGE: Limit(fail=ANY),
    Check.DUPLICATE: Limit(fail=ANY),
    Check.CONFLICT: Limit(warn=ANY),
    Check.GAP: Limit(fail=ANY),
    Check.FALLBACK: Limit(fail=ANY),
    Check.UNRESOLVED: Limit(fail=ANY),
    Check.OPEN: Limit(fail=ANY),
    Check.MISSING: Limit(fail=ANY),
    Check.RECOMPUTED: Limit(),
    Check.STALENESS: Limit(),
    Check.ROUTER_MISMATCH: Limit(warn=0.05),
    Check.TOKEN_MISMATCH: Limit(),
}


@dataclass(frozen=True)
class Thresholds:
    """Every check's limit: the defaults, with a run's overrides over them."""

    limits: Mapping[Check, Limit] = field(default_factory=lambda: dict(DEFAULTS))
    overridden: frozenset[Check] = frozenset()

    @classmethod
    def with_overrides(cls, overrides: Mapping[str, Mapping[str, float | None]]) -> Thresholds:
        """The defaults with `overrides` (check name -> `{"warn", "fail"}`, a missing key keeping its default);
        InvalidInput naming an unknown check or a limit that is not a number of at least 0."""
        limits = dict(DEFAULTS)
        for name, given in overrides.items():
            try:
                check = Check(name)
            except ValueError:
                raise InvalidInput(f"unknown health check {name!r}; the checks are {', '.join(Check)}") from None
            unknown = set(given) - {"warn", "fail"}
            if unknown:
                raise InvalidInput(f"health check {name}: unknown limit {sorted(unknown)[0]!r} (warn, fail)")
            base = DEFAULTS[check]
            warn, fail = given.get("warn", base.warn), given.get("fail", base.fail)
            for key, value in (("warn", warn), ("fail", fail)):
                if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                          or value < 0 or value != value):
                    raise InvalidInput(f"health check {name}: {key} must be a number >= 0 or null, got {value!r}")
            limits[check] = Limit(None if warn is None else float(warn), None if fail is None else float(fail))
        return cls(limits, frozenset(Check(n) for n in overrides))

    def to_json(self) -> dict[str, dict[str, float | None]]:
        """`{CHECK: {"warn", "fail"}}` for every check."""
        return {str(c): self.limits[c].to_json() for c in Check}
