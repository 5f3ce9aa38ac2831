"""The routing-replay client: runs in the trainer process (and in any writer); needs numpy, pyarrow and httpx.

    from replay_client import ReplayClient
    client = ReplayClient("http://127.0.0.1:8470")
    route = client.get_route("run-1", "req-7", strict=True)       # Route: views of the received body
    batch = client.megatron_batch([("run-1", "req-7")], cp_size=2, cp_rank=r)   # TrainerBatch

`replay_service.client` re-exports the same names (the design names it).
"""

from replay_client.client import NotFoundError, ReplayClient, ReplayError, Route, StrictReadError, routes_from_stream
from replay_client.trainer import TrainerBatch

__all__ = ["NotFoundError", "ReplayClient", "ReplayError", "Route", "StrictReadError", "TrainerBatch",
           "routes_from_stream"]
