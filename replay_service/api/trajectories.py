"""Trajectory reads: the turns of one conversation or rollout as one route (replay_service/trajectory.py)."""

from __future__ import annotations

from fastapi import APIRouter, Header
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from replay_format import LayerAxis
from replay_format.route import encode_routes
from replay_format.trajectory import NO_TURN, TrajectoryMeta
from replay_format.weight_versions import RecomputeRule
from replay_service.api import encode
from replay_service.api.deps import RunId, Settings, Store
from replay_service.api.models import (
    CONFLICT,
    ERRORS,
    LAYER_AXIS_HELP,
    ROUTE_MEDIA_TYPES,
    RouteJson,
    RouteJsonRow,
    binary_answer,
)
from replay_service.api.parts_response import PartsResponse
from replay_service.errors import InvalidInput
from replay_service.trajectory import Trajectory, read_trajectory

router = APIRouter(prefix="/v1", tags=["requests"], responses=ERRORS)


class TrajectoryQuery(BaseModel):
    """The turns of one trajectory, in order (`POST /v1/runs/{run}/routes/trajectory`)."""

    model_config = ConfigDict(extra="forbid")

    turns: list[str] = Field(min_length=1, description="request ids of the turns, first to last: each turn's "
                             "sequence starts with the one before it (a multi-turn conversation, or a partial "
                             "rollout resubmitted as a new request)")
    recompute: RecomputeRule = Field(RecomputeRule.FIRST, description="first (default): each position from the "
                                     "first turn that holds a row there, each turn's rows as it sampled (earlier "
                                     "turns immutable); latest: from the last turn that holds one (the newest "
                                     "computation). Within a turn, the same rule")
    strict: bool = Field(False, description="409 instead of data when any row is flagged or missing")
    format: str | None = Field(None, description="arrow | npy | json (overrides Accept)")
    layer_axis: LayerAxis = Field(LayerAxis.MOE, description=LAYER_AXIS_HELP)


class TurnSpanJson(BaseModel):
    """Positions `[start, end)` served from turn `turn` (`request_id`)."""

    turn: int = Field(description="index into `turns`")
    request_id: str
    start: int
    end: int


class TrajectoryJsonRow(RouteJsonRow):
    """One row of a trajectory, for people."""

    turn: int | None = Field(description="index of the turn it came from; null for a GAP row")


class TrajectoryJson(RouteJson):
    """A trajectory as JSON (`format=json`): a route named after the last turn, and where each row came from."""

    turns: list[str] = Field(description="the turns' request ids, in the order asked")
    spans: list[TurnSpanJson] = Field(description="ascending, disjoint; a position in none is a GAP row")
    differing: int = Field(description="positions where a later turn recorded other ids than the row held before")
    rows: list[TrajectoryJsonRow]  # type: ignore[assignment]  # each row also says its turn


@router.post(
    "/runs/{run}/routes/trajectory",
    summary="Several requests (the turns of a conversation or a resubmitted rollout) as one route: each position "
            "from one turn by rule, with each row's turn and weight version",
    response_class=PartsResponse,
    responses={200: {**binary_answer(*ROUTE_MEDIA_TYPES, description="Arrow: route.md with the trajectory keys "
                                      "(trajectory.md); .npy: (n, layers, K) ids; JSON: TrajectoryJson; every "
                                      "format: X-Trajectory-* headers"), "model": TrajectoryJson}, **CONFLICT},
)
async def trajectory_route(run: RunId, body: TrajectoryQuery, store: Store, settings: Settings,
                           accept: str | None = Header(None)) -> PartsResponse:
    kind = encode.pick_format(body.format, accept)

    def work() -> encode.Answer:
        got = read_trajectory(store, run, body.turns, body.recompute, settings.max_batch_requests)
        if body.strict:
            encode.refuse_if_flagged(got.route, settings.strict_report_rows, f"the trajectory of {len(body.turns)} "
                                     "turns")
        return answer(run, got, kind, settings.max_json_rows, body.layer_axis)

    built = await run_in_threadpool(work)
    return PartsResponse(built.parts, built.media_type, built.headers)


def answer(run: str, got: Trajectory, kind: encode.RouteFormat, max_json_rows: int,
           axis: LayerAxis) -> encode.Answer:
    """The trajectory in `kind`: the route answer of its rows, each row's turn in the body (Arrow, JSON) and the
    headers."""
    route, info = got.route, got.info
    selection = encode.Selection(info.rule)
    if kind == encode.RouteFormat.JSON:
        if route.num_rows > max_json_rows:
            raise InvalidInput(f"{route.num_rows} rows is more than JSON serves ({max_json_rows}); use format=arrow "
                               "or npy")
        doc = encode.route_json(run, route, 0, route.num_rows, axis, selection)
        for row, turn in zip(doc["rows"], got.turn.tolist()):
            row["turn"] = None if turn == NO_TURN else turn
        doc.update(turns=list(info.turns), spans=[s.to_json() for s in info.spans], differing=info.differing)
        headers = {"X-Replay-Recompute": info.rule.value, **info.headers()}
        return encode.Answer(kind.media_type, [to_json(doc)], headers)
    # as a route read of the same rows answers (its headers; the .npy body, views of the rows), plus the turns
    plain = encode.route_answer(run, route, 0, kind, max_json_rows, axis, selection)
    headers = {**plain.headers, **info.headers()}
    if kind == encode.RouteFormat.NPY:
        return encode.Answer(kind.media_type, plain.parts, headers)
    # Arrow: the same stream with the trajectory's metadata keys (its parts are views of the rows: cheap to redo)
    meta = TrajectoryMeta(run, route.shape, requests=1, start=0, end=route.num_rows, layer_axis=axis,
                          recompute=info.rule, trajectory=info)
    parts = [p for chunk in encode_routes(meta, [encode.request_route(route, axis)]) for p in chunk]
    return encode.Answer(kind.media_type, encode.joined_small(parts), headers)
