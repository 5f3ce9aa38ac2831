"""POST /v1/runs/{run}/compare: a trainer's own routing against the recorded one.

The body is a compare body (replay_format/compare.md: a row batch of the trainer's top-k per
token, e.g. Megatron `RouterReplay` in RECORD mode). Rows the trainer marked `PADDING` are
ignored. Each trainer row is compared with the clean recorded row at the same position;
trainer rows with no clean recorded row (flagged, or never recorded) are counted in
`missing_rows` and left out of every figure. `agreement` computes the figures.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from replay_format import Flag
from replay_format.compare import RequestMismatch, ShapeMismatch, read_compare_body
from replay_service.compare import agreement
from replay_service.errors import Conflict, InvalidInput, NotFound
from replay_service.store import RouteStore

WORST_TOKENS = 20
WORST_LAYERS = 10


@dataclass(frozen=True)
class Posted:
    """Where in training a comparison was made: its step and the weight version of the trainer's routing."""

    step: int | None = None
    weight_version: str | None = None


def run_compare(store: RouteStore, run: str, body: bytes | memoryview, label: str | None,
                posted: Posted = Posted(), compare_id: str | None = None) -> tuple[dict, list[RequestMismatch]]:
    """Compare a compare body with run `run`'s recorded rows: (the answer, per-request mismatch bits to store)."""
    shape = store.run_shape(run)
    try:
        rows = read_compare_body(body, run, shape)
    except ShapeMismatch as exc:
        raise Conflict(str(exc)) from None
    usable = (rows.flags & Flag.PADDING) == 0
    tally = agreement.Tally(shape.num_moe_layers)
    per_request: list[RequestMismatch] = []
    missing_rows = 0
    for req_idx, request_id in enumerate(rows.request_ids):
        pick = np.flatnonzero((rows.request_index == req_idx) & usable)
        if not pick.size:
            continue
        positions = rows.positions[pick]
        order = np.argsort(positions, kind="stable")
        pick, positions = pick[order], positions[order]
        if (positions[1:] == positions[:-1]).any():
            dup = int(positions[1:][positions[1:] == positions[:-1]][0])
            raise InvalidInput(f"request {request_id!r}: position {dup} appears twice in the trainer's rows")
        try:
            route = store.read_route(run, request_id, int(positions[0]), int(positions[-1]) + 1)
        except NotFound:
            missing_rows += len(pick)  # nothing recorded for this request
            continue
        slots = positions - int(positions[0])
        have = slots < route.num_rows
        clean = np.zeros(len(pick), np.bool_)
        clean[have] = route.flags[slots[have]] == 0
        missing_rows += int(np.count_nonzero(~clean))
        pick, positions, slots = pick[clean], positions[clean], slots[clean]
        trainer = rows.experts[pick].reshape(-1, shape.num_moe_layers, shape.top_k)
        recorded = route.experts_3d()[slots]
        differs, jaccard = agreement.compare_rows(trainer, recorded)
        agreement.add_request(tally, request_id, positions, differs, jaccard, WORST_TOKENS)
        per_request.append(RequestMismatch(request_id, positions.astype(np.int32), differs))
    result = agreement.finish(tally, shape.moe_layers, WORST_LAYERS)
    doc = {
        "compare_id": compare_id or uuid.uuid4().hex[:16],
        "run_id": run,
        "label": label,
        "step": posted.step,
        "weight_version": posted.weight_version,
        "created_at": time.time(),
        "requests": len(rows.request_ids),
        "missing_rows": missing_rows,
        **result,
    }
    return doc, per_request


def record_compare(store: RouteStore, run: str, body: bytes | memoryview, label: str | None,
                   posted: Posted = Posted(), compare_id: str | None = None) -> dict:
    """`run_compare`, then store the comparison (its answer and its per-token bits); the answer."""
    doc, per_request = run_compare(store, run, body, label, posted, compare_id)
    store.compares.save(doc, per_request)
    return doc


def compare_request_detail(store: RouteStore, run: str, compare_id: str, request_id: str, start: int,
                           end: int | None, max_rows: int) -> dict:
    """The `CompareRequestDetail` answer: positions in `[start, end)` compared and their per-layer mismatch bits."""
    item = store.compares.request_mismatch(run, compare_id, request_id)
    positions = item.positions
    if end is None:
        end = int(positions[-1]) + 1 if len(positions) else start
    if end < start:
        raise InvalidInput(f"bad range start={start} end={end}")
    keep = (positions >= start) & (positions < end)
    if int(keep.sum()) > max_rows:
        raise InvalidInput(f"{int(keep.sum())} positions is more than JSON serves ({max_rows}); use start/end")
    return {
        "request_id": request_id,
        "start": start,
        "end": end,
        "num_moe_layers": item.mismatch.shape[1],
        "positions": positions[keep].tolist(),
        "mismatch": item.mismatch[keep].astype(np.uint8).tolist(),
    }
