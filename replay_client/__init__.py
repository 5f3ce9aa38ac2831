"""The routing-replay client: runs in the trainer process (and in any writer); needs numpy, pyarrow and httpx.

    from replay_client import ReplayClient
    client = ReplayClient("http://127.0.0.1:8470")
    route = client.get_route("run-1", "req-7", strict=True)       # Route: views of the received body
    batch = client.megatron_batch([("run-1", "req-7")], cp_size=2, cp_rank=r)   # TrainerBatch
    log(batch.staleness(current="step-12").metrics())   # replayed rows per weight version (async RL)
    chat = client.get_trajectory("run-1", ["turn-1", "turn-2", "turn-3"])   # the turns as one route
    plan = plan_for_model(model, moe_layers)   # megatron-core: this rank's routers (router_replay.py)
    routes = client.get_openai_routes("run-1", completion, n=2)   # vLLM OpenAI server ids (openai_ids.py)
    metrics = client.check_batch("run-1", ids)   # the gate: RoutingUnhealthy, else metrics to log (health.py)
"""

from replay_client.client import NotFoundError, ReplayClient, ReplayError, Route, StrictReadError, routes_from_stream
from replay_client.health import HealthReport, RoutingUnhealthy, Verdict
from replay_client.openai_ids import Endpoint, choice_request_ids, response_request_ids, stored_request_id
from replay_client.records import (
    ExpertLoad,
    IngestAnswer,
    RequestSummary,
    ResponseAnswer,
    ResponseItemAnswer,
    RunSummary,
    VersionRows,
)
from replay_client.router_replay import (
    ReplayPlan,
    RouterReplayError,
    check_config,
    check_model,
    install_router_fallback,
    plan_for_model,
    plan_for_rank,
)
from replay_client.trainer import RecordedRows, Staleness, TrainerBatch

__all__ = ["Endpoint", "ExpertLoad", "HealthReport", "IngestAnswer", "NotFoundError", "RecordedRows", "ReplayClient",
           "ReplayError", "ReplayPlan", "RequestSummary", "ResponseAnswer", "ResponseItemAnswer", "Route",
           "RouterReplayError", "RoutingUnhealthy", "RunSummary", "Staleness", "StrictReadError", "TrainerBatch",
           "Verdict", "VersionRows", "check_config", "check_model", "choice_request_ids",
           "install_router_fallback", "plan_for_model", "plan_for_rank", "response_request_ids", "routes_from_stream",
           "stored_request_id"]
