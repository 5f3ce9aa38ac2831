"""The client, under the name the design gives it: a re-export of `replay_client` (which runs in the trainer)."""

from replay_client.client import NotFoundError, ReplayClient, ReplayError, Route, StrictReadError, routes_from_stream

__all__ = ["NotFoundError", "ReplayClient", "ReplayError", "Route", "StrictReadError", "routes_from_stream"]
