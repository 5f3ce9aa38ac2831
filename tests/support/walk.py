"""A row's walk through the service: the calls one HTTP request makes between replay_service's modules, in order.

Each module stands on a floor, read from pyproject.toml's layer contracts (`service-floors`, then `store-floors`
inside the store, the store's package itself above its parts). A call *climbs* when the called function's module
stands on a higher floor than its caller's: the walk goes back up the house. `python -m tests.support.walk` prints
the ingest and the trainer-read walks (docs/architecture.md, "One row through the service").
"""

from __future__ import annotations

import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
_CONTRACTS = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
              ["contracts"]}


def _ranks(contract_id: str) -> dict[str, int]:
    """Each child of a layers contract's container -> its floor, the top floor highest."""
    layers = _CONTRACTS[contract_id]["layers"] if contract_id in _CONTRACTS else []
    return {name.strip(): len(layers) - i for i, layer in enumerate(layers)
            for name in layer.replace(":", "|").split("|")}


SERVICE, STORE = _ranks("service-floors"), _ranks("store-floors")


def floor(module: str) -> tuple[int, int]:
    """`module`'s floor: its service floor, and inside the store its store floor (the store's package on top)."""
    parts = module.split(".")
    top = SERVICE.get(parts[1], 0) if len(parts) > 1 else len(SERVICE) + 1
    if len(parts) > 1 and parts[1] == "store":
        return top, STORE.get(parts[2], 0) if len(parts) > 2 else len(STORE) + 1
    return top, 0


@dataclass(frozen=True)
class Step:
    """One call between two functions of the service: who called, what was called, and their floors."""

    caller: str  # module:function
    callee: str
    caller_floor: tuple[int, int]
    callee_floor: tuple[int, int]

    @property
    def climbs(self) -> bool:
        """Whether the called function stands on a higher floor than its caller."""
        return self.callee_floor > self.caller_floor


@dataclass
class Walk:
    """The calls of one traced request, in the order they were made."""

    steps: list[Step] = field(default_factory=list)

    @property
    def places(self) -> list[str]:
        """Every function called, in first-call order."""
        return list(dict.fromkeys(s.callee for s in self.steps))

    @property
    def rooms(self) -> list[str]:
        """Every module entered, in first-entry order."""
        return list(dict.fromkeys(s.callee.split(":")[0] for s in self.steps))

    @property
    def climbs(self) -> list[Step]:
        """The calls that go back up a floor."""
        return [s for s in self.steps if s.climbs]

    @property
    def returns(self) -> int:
        """Calls into another module that was entered before (a room visited again)."""
        seen: set[str] = set()
        count = 0
        for s in self.steps:
            room, came_from = s.callee.split(":")[0], s.caller.split(":")[0]
            if room != came_from and room in seen:
                count += 1
            seen.add(room)
        return count


def _where(frame: FrameType) -> str | None:
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("replay_service") or module == "replay_service.app":
        return None  # app.py: the HTTP frame around every request (its middleware's send), no floor of the walk
    return f"{module}:{frame.f_code.co_qualname}"


@contextmanager
def traced() -> Iterator[Walk]:
    """Within: every call from a service function to another service function, in every thread started after entry
    (and this one), is a step of the walk yielded. Start the app's threads (its test client) inside."""
    walk = Walk()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = _where(frame), _where(frame.f_back)
        if callee is None or caller is None or callee == caller:
            return
        walk.steps.append(Step(caller, callee, floor(caller.split(":")[0]), floor(callee.split(":")[0])))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield walk
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def walks(data_dir: Path) -> dict[str, Walk]:
    """The walks of one row batch's POST /v1/ingest and of one trainer rank's POST /v1/trainer/megatron, each after
    one untraced warm-up of the same call, on a service over `data_dir`."""
    import numpy as np
    from starlette.testclient import TestClient

    from replay_client import ReplayClient
    from replay_service.app import create_app
    from replay_service.settings import ServiceSettings
    from tests.support.data import batch_bytes, routes

    experts = routes(np.random.default_rng(1), 16)
    calls: dict[str, Callable[[ReplayClient, int], object]] = {
        "ingest": lambda client, seq: client.ingest(batch_bytes("walk", "w", seq, [f"r{seq}"] * 16, np.arange(16),
                                                                experts)),
        "trainer read": lambda client, seq: client.megatron_batch([("walk", "r0")]),
    }
    found: dict[str, Walk] = {}
    settings = ServiceSettings(data_dir=data_dir, fsync=False, hot_reads="thread")
    for name, call in calls.items():
        with traced() as walk:
            recording = walk.steps
            with TestClient(create_app(settings)) as http, ReplayClient(str(http.base_url), http=http) as client:
                call(client, 0)  # the warm-up: a first call also opens the run and its segments
                del recording[:]
                call(client, 1)
                found[name] = Walk(list(recording))
    return found


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, walk in walks(Path(tmp)).items():
            print(f"{name}: {len(walk.places)} places in {len(walk.rooms)} rooms, {walk.returns} returns to a room, "
                  f"{len(walk.climbs)} climbs")
            for room in walk.rooms:
                print(f"  {room}")
            for step in walk.climbs:
                print(f"  CLIMB {step.caller} -> {step.callee}")


if __name__ == "__main__":
    main()
