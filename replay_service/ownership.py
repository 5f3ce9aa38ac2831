"""Who is writing: the caller's identity as the store sees it, and the rule that a request has one writer.

The HTTP layer (`api/auth.py`) authenticates a request and sets `acting` for it; the store reads it where
rows or an end are committed (`ingest/commit.py`, `RouteStore.finish`), inside the index transaction that
claims the request, so two writers racing for a new request cannot both win. A context variable, not a
parameter: the ingest pipeline's stages between the route and the commit need not carry it, and a store
used in process (tests, `reindex`, the demo loader) has no actor and checks nothing.

Without a tokens file (loopback only, see `cli serve`) nobody is authenticated: `acting` stays None and
requests have no owner.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from replay_service.errors import Forbidden


@dataclass(frozen=True)
class Actor:
    """An authenticated caller: `owner` names its token (a digest, never the token), `admin` may act for anyone."""

    owner: str
    admin: bool
    run_prefix: str = ""  # "" = every run

    def require_run(self, run_id: str) -> None:
        """Forbidden unless this caller's run prefix allows `run_id`."""
        if not run_id.startswith(self.run_prefix):
            raise Forbidden(f"this token is limited to runs whose id starts with {self.run_prefix!r}; "
                            f"run {run_id!r} does not")


acting: ContextVar[Actor | None] = ContextVar("replay_acting", default=None)


def current_actor() -> Actor | None:
    """The authenticated caller of the request being served, None when none is (no tokens file, or in process)."""
    return acting.get()


def require_owner(run_id: str, request_id: str, owner: str | None) -> None:
    """Forbidden when request `request_id` is owned by another writer than the current caller (admins may)."""
    actor = current_actor()
    if actor is None or actor.admin or owner is None or owner == actor.owner:
        return
    raise Forbidden(f"request {request_id!r} of run {run_id!r} was written by another token; only that writer "
                    "(or an admin token) may add rows to it or finish it")


class RequestOwners(Protocol):
    """Who owns which request, inside one index transaction (`store.index.IndexTransaction` is one).

    The store stands above this module: `claim_requests` names what it needs of the store's transaction here.
    """

    def owners(self, run_id: str, request_ids: list[str]) -> dict[str, str]:
        """The owners of those of `request_ids` that have one (request id -> owner)."""
        ...

    def claim(self, run_id: str, request_id: str, owner: str) -> None:
        """Make `owner` the request's owner when it has none (creating its row)."""
        ...


def claim_requests(tx: RequestOwners, run_id: str, request_ids: list[str]) -> None:
    """Forbidden when any of the requests is another writer's; else the caller claims the unowned ones.

    Runs in the transaction that writes to them, so of two writers racing for a new request exactly
    one owns it. Nothing to do without an authenticated caller (no tokens file, or the store in process).
    """
    actor = current_actor()
    if actor is None:
        return
    owners = tx.owners(run_id, request_ids)
    for request_id, owner in owners.items():
        require_owner(run_id, request_id, owner)
    for request_id in dict.fromkeys(request_ids):
        if request_id not in owners:
            tx.claim(run_id, request_id, actor.owner)
