"""Operations: health (with the release's version), Prometheus metrics and the tokens' reload."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from replay_service import __version__
from replay_service.api.auth import NO_TOKENS_FILE, Tokens
from replay_service.api.deps import Metrics, Settings, Store
from replay_service.api.models import ErrorBody, Health
from replay_service.errors import Conflict, InvalidInput

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness and store status", response_model=Health,
            responses={503: {"description": "The index or the segment store does not answer"}})
def healthz(store: Store, settings: Settings) -> dict:
    """Counts the index's runs and asks the segment store once: a replica cut off from either answers 503, so a
    load balancer's health check takes it out (docs/scale_out.md)."""
    runs = store.run_count()
    store.segments.ping()
    return {"status": "ok", "runs": runs, "data_dir": str(settings.data_dir), "version": __version__,
            "pid": os.getpid()}


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(m: Metrics) -> Response:
    """Every metric of the service: under several workers, summed over them (metrics.py)."""
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)


class TokensReloaded(BaseModel):
    """The tokens every process of the service checks from now on."""

    generation: int = Field(description="1 at start, one more per reload (this call or SIGHUP to `serve`)")
    tokens: int = Field(description="tokens the file lists")
    file: str = Field(description="the tokens file read (REPLAY_TOKENS_FILE)")


@router.post("/v1/admin/reload-tokens", summary="Read the tokens file again, for every worker at once",
             response_model=TokensReloaded, responses={
                 422: {"model": ErrorBody, "description": "the tokens file cannot be read or does not parse (`detail` "
                                                          "names the line): the tokens in force stay"},
                 409: {"model": ErrorBody, "description": "the service has no tokens file: it checks no tokens"}})
def reload_tokens(request: Request) -> dict:
    """Reads REPLAY_TOKENS_FILE again and, only when every line parses, switches every worker of the service to it at
    once: from this answer on, each request on any connection is checked against the new tokens (an admin token)."""
    tokens: Tokens = request.app.state.tokens
    if tokens.source is None:
        raise Conflict(NO_TOKENS_FILE)
    try:
        done = tokens.reload()
    except ValueError as exc:
        raise InvalidInput(f"tokens not reloaded: {exc}; the tokens in force (generation {tokens.generation}) "
                           "stay") from None
    return {"generation": done.generation, "tokens": done.tokens, "file": str(done.source)}
