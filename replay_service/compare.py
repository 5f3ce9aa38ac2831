"""POST /v1/runs/{run}/compare: a trainer's own routing against the recorded one.

The body is an Arrow IPC stream in the DESIGN.md row schema (the trainer's
top-k ids per token, e.g. Megatron `RouterReplay` in RECORD mode); `run_id`,
`writer_id` and `seq` may be left out of the metadata, `num_layers`, `top_k`
and `num_experts` must match the run. Rows the trainer marked `PADDING` are
ignored. Each trainer row is compared with the clean recorded row at the same
position; trainer rows with no clean recorded row (flagged, or never recorded)
are counted in `missing_rows` and left out of every figure.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from replay_format import Flag, RunShape

from replay_format.rows import RowsMeta
from replay_service import agreement
from replay_service.decode import parse_meta, read_arrow_body, rows_from_table
from replay_service.errors import Conflict, InvalidInput, NotFound
from replay_service.store import RouteStore

WORST_TOKENS = 20
WORST_LAYERS = 10


@dataclass
class RequestMismatch:
    request_id: str
    positions: np.ndarray  # int32 (n,): positions compared
    mismatch: np.ndarray  # bool (n, L)


def decode_compare(body: bytes, run: str, shape: RunShape):
    table = read_arrow_body(body)
    md = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    missing = [k for k in ("num_moe_layers", "top_k", "num_experts") if k not in md
               and not (k == "num_moe_layers" and "num_layers" in md and "format_version" not in md)]
    if missing:
        raise InvalidInput(f"schema metadata lacks {', '.join(missing)} (they must match run {run!r})")
    given_run = md.get("run_id", run)
    if given_run != run:
        raise InvalidInput(f"schema metadata run_id={given_run!r} but the URL names run {run!r}")
    md.setdefault("writer_id", "trainer")
    md.setdefault("seq", "0")
    md["run_id"] = run
    md.setdefault("source", "trainer")
    meta = parse_meta(md)
    if (meta.shape.num_moe_layers, meta.shape.top_k, meta.shape.num_experts) != (
        shape.num_moe_layers, shape.top_k, shape.num_experts
    ):
        raise Conflict(
            f"the trainer's rows are {meta.shape.num_moe_layers} layers x top-{meta.shape.top_k} of "
            f"{meta.shape.num_experts} experts; run {run!r} records {shape.num_moe_layers} x top-{shape.top_k} "
            f"of {shape.num_experts}")
    rows = rows_from_table(table, RowsMeta(run, meta.writer_id, meta.seq, shape, meta.source))
    usable = (rows.flags & Flag.PADDING) == 0
    if usable.any() and int(rows.experts[usable].max()) >= shape.num_experts:
        raise InvalidInput(f"the trainer's rows hold an id >= num_experts={shape.num_experts}")
    return rows, usable


def run_compare(store: RouteStore, run: str, body: bytes, label: str | None,
                compare_id: str | None = None) -> tuple[dict, list[RequestMismatch]]:
    shape = store.run_shape(run)
    rows, usable = decode_compare(body, run, shape)
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
        "created_at": time.time(),
        "requests": len(rows.request_ids),
        "tokens": result["tokens"],
        "router_mismatch": result["router_mismatch"],
        "token_mismatch": result["token_mismatch"],
        "jaccard": result["jaccard"],
        "missing_rows": missing_rows,
        "per_layer": result["per_layer"],
        "worst_layers": result["worst_layers"],
        "worst_tokens": result["worst_tokens"],
    }
    return doc, per_request
