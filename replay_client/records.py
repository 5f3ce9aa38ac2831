"""The client's JSON answers as typed records: frozen dataclasses mirroring the service's response models.

Contract: each record has the fields of the service's response model of the same name (its OpenAPI schema, `/docs`;
`tests/test_client_records.py` holds the two together), lists as tuples, nested models as records, weight-version
spans as `replay_format.weight_versions.VersionSpan`; `raw` keeps the answer as received. `from_json` takes what a
service sends: a field it does not send takes its default (an older service), a key the record lacks stays in `raw`
(a newer one). Dict-style reads (`record["rows"]`, `get`, `in`, `keys`, ...) still answer from `raw` for one release,
with a `DeprecationWarning` naming the attribute to use.
Design: docs/design/trainer_client.md ("Typed answer records").
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, Union, get_args, get_origin, get_type_hints

from replay_format import ReplayDeprecationWarning, RunShape
from replay_format.weight_versions import VersionSpan

__all__ = ["ExpertLoad", "IngestAnswer", "Record", "RequestSummary", "ResponseAnswer", "ResponseItemAnswer",
           "RunSummary", "VersionRows"]


class Record:
    """What every answer record shares: `from_json`, `to_json`, and for one release dict-style reads."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by @dataclass on each record
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Self:
        """The record of a JSON answer (module docstring: missing and extra keys)."""
        hints = _hints(cls)
        values = {name: _decode(hint, doc[name]) for name, hint in hints.items() if name in doc}
        make: Any = cls  # a dataclass: its fields are its parameters
        return make(**values, raw=dict(doc))

    def to_json(self) -> dict[str, Any]:
        """The answer as JSON: `raw` when the record was read from one, else its fields (tuples as lists)."""
        if self.raw:
            return dict(self.raw)
        return {name: _encode(getattr(self, name)) for name in _hints(type(self))}

    # ---- dict-style reads, deprecated (module docstring) ------------------------------------------------

    def _deprecated(self, what: str, use: str) -> Mapping[str, Any]:
        """The answer as the dict it was, after a DeprecationWarning: `what` is deprecated, `use` instead."""
        warnings.warn(f"{type(self).__name__}{what} is deprecated (the client's answers are typed records now): "
                      f"use {use}", ReplayDeprecationWarning, stacklevel=3)
        return self.raw or self.to_json()

    def _attribute(self, key: object) -> str:
        """What replaces reading `key` from the answer: its attribute, or `raw` for a key the record lacks."""
        if isinstance(key, str) and key in self.__dataclass_fields__ and key != "raw":
            return f".{key}"
        return f".raw[{key!r}]"

    def __getitem__(self, key: str) -> Any:
        return self._deprecated(f"[{key!r}]", self._attribute(key))[key]

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated: the answer's `key`, or `default` (dict-style, as the answers were)."""
        return self._deprecated(f".get({key!r})", self._attribute(key)).get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._deprecated(f": {key!r} in it", f"{key!r} in .raw")

    def keys(self) -> Any:
        """Deprecated: the answer's keys (dict-style)."""
        return self._deprecated(".keys()", "its attributes, or .to_json()").keys()

    def values(self) -> Any:
        """Deprecated: the answer's values (dict-style)."""
        return self._deprecated(".values()", "its attributes, or .to_json()").values()

    def items(self) -> Any:
        """Deprecated: the answer's items (dict-style; not on `ResponseAnswer`, whose `items` is its field)."""
        return self._deprecated(".items()", "its attributes, or .to_json()").items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._deprecated(": iterating its keys", "its attributes, or .to_json()"))


def _raw() -> Any:
    """The `raw` field: the answer as received ({} for a record built here); neither shown nor compared."""
    return field(default_factory=dict, repr=False, compare=False)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: Any) -> dict[str, Any]:
    """Each field's type but `raw`'s, in field order (read once per record class)."""
    hints = _HINTS.get(cls)
    if hints is None:
        every = get_type_hints(cls)
        hints = _HINTS[cls] = {name: every[name] for name in cls.__dataclass_fields__ if name != "raw"}
    return hints


def _decode(hint: Any, value: Any) -> Any:
    """A JSON value as the field typed `hint` holds it."""
    if value is None:
        return None
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:  # X | None
        kinds = [a for a in get_args(hint) if a is not type(None)]
        return _decode(kinds[0], value) if len(kinds) == 1 else value
    if origin is tuple:  # tuple[X, ...]
        item = get_args(hint)[0]
        return tuple(_decode(item, v) for v in value)
    if origin is dict:
        return dict(value)
    if hint is VersionSpan:
        return VersionSpan(str(value["version"]), int(value["start"]), int(value["end"]))
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value)
    return value


def _encode(value: Any) -> Any:
    """A field's value as JSON."""
    if isinstance(value, Record | VersionSpan):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return dict(value)
    return value


# ---- runs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VersionRows(Record):
    """A run's rows served (default rule) with one weight version (`version` None: rows of no known version)."""

    version: str | None
    rows: int
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True, kw_only=True)
class RunSummary(Record):
    """One run (`ReplayClient.run`, `runs`): its shape, counts of requests and rows, rows per flag.

    The service's `RunSummary` documents each field (`/docs`); `shape` is the run's `RunShape`.
    """

    run_id: str
    num_moe_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]
    num_hidden_layers: int = 0  # 0: not said (a service before model-axis reads); max(moe_layers) + 1
    dtype: str
    source: str | None = None
    created_at: float
    requests: int
    requests_ended: int
    rows: int
    referenced_rows: int = 0
    references: int = 0
    bytes: int
    bytes_per_id: float | None = None
    flagged: dict[str, int]
    weight_versions: tuple[VersionRows, ...] = ()
    recomputed: int = 0
    pinned: bool = False
    last_write: float | None = None
    raw: dict[str, Any] = _raw()

    @property
    def shape(self) -> RunShape:
        """The run's shape, as its rows and routes carry it."""
        return RunShape(self.num_moe_layers, self.top_k, self.num_experts, self.moe_layers, self.num_hidden_layers)


@dataclass(frozen=True, kw_only=True)
class ExpertLoad(Record):
    """Tokens routed to each expert per MoE layer over a run's clean rows (`ReplayClient.expert_load`).

    `counts[ordinal][expert]`; `imbalance` per MoE layer: max over mean tokens per expert.
    """

    run_id: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    rows: int
    counts: tuple[tuple[int, ...], ...]
    imbalance: tuple[float, ...]
    raw: dict[str, Any] = _raw()


# ---- requests --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RequestSummary(Record):
    """One request (`ReplayClient.request`, `requests`, `finish`): status, rows, rows per flag, weight versions.

    `status`: open, finished or aborted; `num_tokens` T once ended (then T - 1 rows are expected); `weight_versions`
    the versions of the rows served by the default rule as spans over positions. The service's `RequestSummary`
    documents each field (`/docs`).
    """

    request_id: str
    status: str
    num_tokens: int | None
    rows: int
    referenced_rows: int = 0
    expected_rows: int
    first_flagged_position: int | None
    flagged: dict[str, int]
    clean: bool
    weight_versions: tuple[VersionSpan, ...] = ()
    recomputed: int = 0
    first_recomputed: int | None = None
    raw: dict[str, Any] = _raw()


# ---- writes ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class IngestAnswer(Record):
    """What became of one row batch or one whole route (`ReplayClient.ingest`, `upload_route`,
    `upload_sglang_output`): `stored` by this call, or a `duplicate` of a stored one (nothing written)."""

    stored: bool
    duplicate: bool
    rows: int
    padding_dropped: int
    flagged: dict[str, int]
    bytes: int
    recomputed: int = 0
    padding_slots_dropped: int = 0
    raw: dict[str, Any] = _raw()


@dataclass(frozen=True, kw_only=True)
class ResponseItemAnswer(IngestAnswer):
    """What became of one item (choice) of an engine's answer: its `index` in the answer, the `request_id` its rows
    are stored under and the position of its first row (`start`)."""

    index: int
    request_id: str
    start: int


@dataclass(frozen=True, kw_only=True)
class ResponseAnswer(Record):
    """What became of each item of an engine's answer, in the answer's order (`ReplayClient.upload_vllm_response`,
    `upload_sglang_response`)."""

    items: tuple[ResponseItemAnswer, ...]  # type: ignore[assignment]  # the model's field: hides `Record.items()`
    raw: dict[str, Any] = _raw()
