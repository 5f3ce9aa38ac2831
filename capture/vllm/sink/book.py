"""Runs in the sink process: which request each row of a `StepFrame` is, which rows to keep, finish lengths.

Pure Python/numpy (no vLLM import), so it is tested directly. `external_id` maps vLLM's internal request ids to the
id the user gave vLLM (`"{i}_{external}"` for the children of `n > 1`); ids the service cannot store are dropped with
one error per request. `StepBook` keeps a request's verified rows only (rejected spec-decode drafts dropped; without a
sampler count, only the verified row), sends rows again on recompute (the service flags a differing re-write
CONFLICT), forwards prefix-cache references in stored ids, sends no finish for a request passed on to a decode
engine, and finishes a request with the scheduler's token count, else the highest position sent + 2.

Design: docs/design/sink_and_sender.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from capture.sender.row_chunk import RequestIndex
from capture.vllm.log import log
from replay_format import valid_id
from replay_format.request_notes import Finish, FinishStatus, Reference
from replay_format.step_frame import NO_SAMPLE, StepFrame

_SUFFIX = re.compile(r"^(?P<ext>.+)-[0-9a-f]{8}$")
_CHILD = re.compile(r"^(?P<idx>\d+)_(?P<parent>.+)$")


def external_id(internal: str) -> str:
    """The id the user gave vLLM for an internal (suffixed) request id."""
    m = _SUFFIX.match(internal)
    if m:
        return m.group("ext")
    m = _CHILD.match(internal)  # n>1 child of a suffixed parent
    if m:
        inner = _SUFFIX.match(m.group("parent"))
        if inner:
            return f"{m.group('idx')}_{inner.group('ext')}"
    return internal  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, or ids vLLM passes through


@dataclass
class RequestState:
    """What the book knows of one request (by its internal id)."""

    external: str
    max_position: int = -1
    rows_sent: int = 0
    storable: bool = True  # the service's id rule, checked once per request


@dataclass(frozen=True)
class KeptRows:
    """A step's rows the sink sends: which of the step's rows, and their request ids (external, one per kept row)."""

    requests: RequestIndex
    keep: np.ndarray  # bool [the step's rows]


@dataclass
class StepBook:
    """Tracks requests across steps (see module docstring)."""

    requests: dict[str, RequestState] = field(default_factory=dict)
    _bad_ids: set[str] = field(default_factory=set)
    dropped_rejected: int = 0
    dropped_bad_id: int = 0

    def _state(self, internal: str) -> RequestState:
        st = self.requests.get(internal)
        if st is None:
            ext = external_id(internal)
            st = self.requests[internal] = RequestState(ext, storable=valid_id(ext))
        return st

    def keep_mask(self, frame: StepFrame) -> np.ndarray:
        """Rows to keep: drops each spec-decoded request's rejected suffix."""
        keep = np.ones(frame.num_tokens, dtype=bool)
        if frame.drafts is None or frame.sampled is None or not frame.drafts.any():
            return keep
        qsl = frame.query_start_loc
        for i in np.flatnonzero(frame.drafts).tolist():
            start, end = int(qsl[i]), int(qsl[i + 1])
            valid = int(frame.sampled[i])
            if valid == NO_SAMPLE:  # no sampler output for it (e.g. aborted mid-step): keep the verified row only
                valid = 1
            valid = max(0, min(valid, end - start))
            keep[start + valid : end] = False
            self.dropped_rejected += end - start - valid
        return keep

    def row_ids(self, frame: StepFrame, keep: np.ndarray) -> KeptRows:
        """The step's rows to send: `keep` less the rows of ids the service cannot store, and their request ids.

        Rows of ids the service cannot store are removed from the mask. Vectorised: it
        runs every step, so nothing here loops over rows.
        """
        qsl = frame.query_start_loc
        states = [self._state(rid) for rid in frame.req_ids]
        if keep.all() and all(st.storable for st in states):  # the usual step: every row is kept
            counts = np.diff(qsl)
            for st, top, count in zip(states, frame.positions[qsl[1:] - 1].tolist(), counts.tolist()):
                if count:
                    st.max_position = max(st.max_position, top)
                    st.rows_sent += count
            index = np.repeat(np.arange(len(states), dtype=np.int32), counts)
            return KeptRows(RequestIndex([st.external for st in states], index), keep)
        keep = keep.copy()
        for i, st in enumerate(states):
            if not st.storable:
                if st.external not in self._bad_ids:
                    self._bad_ids.add(st.external)
                    log.error("routing-replay: request id %r cannot be stored (service id rule); its rows are dropped",
                              st.external)
                self.dropped_bad_id += int(keep[qsl[i] : qsl[i + 1]].sum())
                keep[qsl[i] : qsl[i + 1]] = False
        kept_before = np.concatenate(([0], np.cumsum(keep)))
        kept = kept_before[qsl[1:]] - kept_before[qsl[:-1]]
        index = np.repeat(np.arange(len(states), dtype=np.int32), kept)
        if index.size:
            # Highest kept position per request (positions rise within a request's rows).
            last_kept = np.maximum.reduceat(np.where(keep, frame.positions, -1), qsl[:-1][kept > 0])
            for i, top in zip(np.flatnonzero(kept > 0).tolist(), last_kept.tolist()):
                st = states[i]
                st.max_position = max(st.max_position, int(top))
                st.rows_sent += int(kept[i])
        return KeptRows(RequestIndex([st.external for st in states], index), keep)

    def reference(self, hit: Reference) -> Reference | None:
        """A prefix-cache hit (engine ids) in stored ids; None when either id cannot be stored.

        A request resumed after preemption can hit blocks it computed itself: its own rows are stored
        already, so such a hit is no reference.
        """
        st = self._state(hit.request_id)
        source = hit.source_request_id
        src = self.requests[source].external if source in self.requests else external_id(source)
        if not st.storable or src == st.external or not valid_id(src):
            return None
        return Reference(st.external, int(hit.start), int(hit.end), src)

    def forget(self, internal: str) -> None:
        """A request that ended here without a finish of its own (decoded on another engine): its rows were sent."""
        self.requests.pop(internal, None)

    def finish(self, internal: str, num_tokens: int | None = None, status: FinishStatus | None = None) -> Finish | None:
        """The end of a finished/aborted request in its stored id, or None if it never ran."""
        st = self.requests.pop(internal, None)
        if st is None or st.external in self._bad_ids:
            return None
        status = FinishStatus(status or FinishStatus.FINISHED)
        if num_tokens is None:
            num_tokens = st.max_position + 2
        else:
            # The engine ran a step past the request's end, whose row was sent: aborted while its step ran (vLLM 0.32
            # handles aborts between the forward and `update_from_output`, core.py `_process_aborts_queue`), or, under
            # asynchronous scheduling (vLLM 0.33's and 0.34's default), finished on a stop token while the next step,
            # which feeds that token, was already scheduled. Its length then covers the rows sent: a finish must not
            # cut them (the extra row is the last token's routing, which no trainer position reads).
            num_tokens = max(int(num_tokens), st.max_position + 2)
        return Finish(st.external, int(num_tokens), status)
