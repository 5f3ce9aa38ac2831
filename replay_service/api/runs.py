"""Runs: list, summary, expert load; delete and pin (retention: store/lifecycle/retention.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from replay_service.api import encode
from replay_service.api.deps import RunId, Store
from replay_service.api.models import ERRORS, ExpertLoad, RunDeleteAnswer, RunList, RunSummary

router = APIRouter(prefix="/v1", tags=["runs"], responses=ERRORS)


@router.get("/runs", summary="All runs with counts per flag, bytes, age and pin", response_model=RunList)
def list_runs(store: Store) -> dict:
    return {"runs": [run.to_json() for run in store.runs()]}


@router.get("/runs/{run}", summary="One run: shape, requests, rows, counts per flag", response_model=RunSummary)
def run_summary(run: RunId, store: Store) -> dict:
    return store.run_summary(run).to_json()


@router.delete("/runs/{run}", summary="Delete a run's rows and files (safe beside reads and writes of it)",
               response_model=RunDeleteAnswer)
async def delete_run(run: RunId, store: Store) -> dict:
    removed = await run_in_threadpool(store.delete_run, run)  # file removal takes a while on a large run
    return {"run_id": removed.run_id, "rows": removed.rows, "bytes": removed.bytes, "files": removed.files}


@router.put("/runs/{run}/pin", summary="Pin a run: retention never deletes it", response_model=RunSummary)
def pin_run(run: RunId, store: Store) -> dict:
    return store.pin(run, True).to_json()


@router.delete("/runs/{run}/pin", summary="Unpin a run: retention may delete it again", response_model=RunSummary)
def unpin_run(run: RunId, store: Store) -> dict:
    return store.pin(run, False).to_json()


@router.get("/runs/{run}/expert-load", summary="Tokens routed to each expert, per MoE layer (clean rows)",
            response_model=ExpertLoad)
def expert_load(run: RunId, store: Store) -> dict:
    shape, load = store.expert_load(run)
    return encode.expert_load(run, shape, load)
