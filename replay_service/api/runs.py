"""Run-level reads: list, summary, expert load."""

from __future__ import annotations

from fastapi import APIRouter

from replay_service import encode
from replay_service.api.deps import RunId, Store
from replay_service.api.models import ERRORS, ExpertLoad, RunList, RunSummary

router = APIRouter(prefix="/v1", tags=["runs"], responses=ERRORS)


@router.get("/runs", summary="All runs with counts per flag", response_model=RunList)
def list_runs(store: Store) -> dict:
    return {"runs": store.runs()}


@router.get("/runs/{run}", summary="One run: shape, requests, rows, counts per flag", response_model=RunSummary)
def run_summary(run: RunId, store: Store) -> dict:
    return store.run_summary(run)


@router.get("/runs/{run}/expert-load", summary="Tokens routed to each expert, per MoE layer (clean rows)",
            response_model=ExpertLoad)
def expert_load(run: RunId, store: Store) -> dict:
    shape, load = store.expert_load(run)
    return encode.expert_load(run, shape, load)
