"""Run-level reads: list, summary, expert load."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter

from replay_service.api.deps import RunId, Store

router = APIRouter(prefix="/v1", tags=["runs"])


@router.get("/runs", summary="All runs with counts per flag")
def list_runs(store: Store) -> dict:
    return {"runs": store.runs()}


@router.get("/runs/{run}", summary="One run: shape, requests, rows, counts per flag")
def run_summary(run: RunId, store: Store) -> dict:
    return store.run_summary(run)


@router.get("/runs/{run}/expert-load", summary="Tokens routed to each expert, per MoE layer (clean rows)")
def expert_load(run: RunId, store: Store) -> dict:
    shape, load = store.expert_load(run)
    rows_counted = int(load[0].sum() // shape.top_k) if load.size else 0
    mean = load.mean(axis=1)
    imbalance = np.divide(load.max(axis=1), mean, out=np.zeros_like(mean, dtype=float), where=mean > 0)
    return {
        "run_id": run,
        "num_layers": shape.num_moe_layers,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "moe_layers": list(shape.moe_layers),
        "rows": rows_counted,
        "counts": load.tolist(),
        "imbalance": [round(float(x), 4) for x in imbalance],
    }
