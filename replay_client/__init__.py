"""The routing-replay client: runs in the trainer process (and in any writer); needs numpy, pyarrow and httpx.

Contract: `ReplayClient` (client.py) and `AsyncReplayClient` (async_client.py, the same methods as coroutines) read
and write one service over HTTP and answer typed values: `Route` (route.py),
`TrainerBatch` (trainer.py), the records of records.py, `HealthReport` (health.py). torch and megatron-core are
imported only by the calls that use them (`TrainerBatch`'s tensors; router_replay.py's checks, fallback and plans).
`__all__` is the package's API; the vLLM id rules (openai_ids.py) are `replay_format.vllm_ids`'s.
Design: docs/design/trainer_client.md ("What the client offers").
"""

from replay_client.async_client import AsyncReplayClient
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
from replay_client.transport import AnswerTooLarge, Retries

__all__ = ["AnswerTooLarge", "AsyncReplayClient", "Endpoint", "ExpertLoad", "HealthReport", "IngestAnswer",
           "NotFoundError", "RecordedRows", "ReplayClient", "ReplayError", "ReplayPlan", "RequestSummary",
           "ResponseAnswer", "ResponseItemAnswer", "Retries", "Route", "RouterReplayError", "RoutingUnhealthy",
           "RunSummary", "Staleness", "StrictReadError", "TrainerBatch", "Verdict", "VersionRows", "check_config",
           "check_model", "choice_request_ids", "install_router_fallback", "plan_for_model", "plan_for_rank",
           "response_request_ids", "routes_from_stream", "stored_request_id"]
