"""`AsyncReplayClient` against `ReplayClient`, through real servers.

- The two clients have the same methods (names, parameters, answers' types); every method answers the same on a
  real service with the demo run (a write to a run of each client's own).
- From one event loop, uploads are in flight at once: a probe server (a real uvicorn on loopback) sees N requests
  together; `max_in_flight` bounds them; 429 and 503 are retried after `Retry-After`, never more than `retries`
  allow; an answer larger than `max_answer_bytes` is refused before it is read (both clients).
- `ReplayClient.in_background` hands back the call's answer as a future.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time

import numpy as np
import pytest

from replay_client import AnswerTooLarge, AsyncReplayClient, ReplayClient, ReplayError, Retries, Route, TrainerBatch
from replay_client.health import RoutingUnhealthy
from replay_format import RunShape
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, served_in_thread

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16)
ONLY_SYNC = {"close", "in_background"}  # the async client has aclose (and tasks: asyncio.create_task)


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(value) for name, value in vars(cls).items()
            if callable(value) and not name.startswith("_")}


def test_both_clients_have_the_same_methods():
    sync, async_ = public_methods(ReplayClient), public_methods(AsyncReplayClient)
    assert set(sync) - ONLY_SYNC == set(async_) - {"aclose"}
    for name in set(sync) - ONLY_SYNC - {"requests"}:
        assert sync[name] == async_[name], name  # the same parameters and the same typed answer
        assert inspect.iscoroutinefunction(getattr(AsyncReplayClient, name)), name


# ---- the same answers on a real service ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):  # a service of its own: the tests below through real servers are in the full suite
    with ServiceProcess(tmp_path_factory.mktemp("async") / "data", demo=True) as service:
        yield service


def same(a, b) -> None:
    """Equal answers: records field by field, routes and trainer batches array by array."""
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, Route):
        assert (a.run_id, a.request_id, a.moe_layers, a.layer_axis, a.num_hidden_layers) == \
               (b.run_id, b.request_id, b.moe_layers, b.layer_axis, b.num_hidden_layers)
        for field in ("positions", "experts", "flags", "token_ids"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert a.versions().per_row() == b.versions().per_row()
    elif isinstance(a, TrainerBatch):
        assert a.meta == b.meta and np.array_equal(a.experts, b.experts) and np.array_equal(a.valid, b.valid)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif dataclasses.is_dataclass(a):
        assert a == b
    else:
        assert a == b, (a, b)


def calls_of(run: str, compare_id: str) -> dict[str, tuple[tuple, dict]]:
    """Each reading method's arguments on the demo run (`run`: "demo")."""
    seqs = [(run, "clean-00"), (run, "clean-01")]
    return {
        "runs": ((), {}),
        "run": ((run,), {}),
        "request": ((run, "clean-00"), {}),
        "requests_page": ((run,), {"page_size": 7}),
        "expert_load": ((run,), {}),
        "get_route": ((run, "clean-01"), {"start": 3, "end": 40}),
        "get_routes": ((run, ["clean-00", "flagged-zero"]), {"layer_axis": "model"}),
        "get_trajectory": ((run, ["clean-00"]), {}),
        "get_route_npy": ((run, "clean-02"), {}),
        "megatron_batch": ((seqs,), {"tp_size": 2, "tp_rank": 1}),
        "verl_batch": ((seqs,), {"prompt_lengths": [10, 12], "prompt_width": 16, "response_width": 2048}),
        "compares": ((run,), {}),
        "compare_result": ((run, compare_id), {}),
        "compare_request": ((run, compare_id, "clean-00"), {"end": 9}),
        "agreement_series": ((run,), {}),
        "run_health": ((run,), {}),
        "batch_health": ((run, ["clean-00", "clean-01"]), {}),
        "check_batch": ((run, ["clean-00", "clean-01"]), {}),
        "health_thresholds": ((run,), {}),
    }


def write_calls(run: str) -> list[tuple[str, tuple, dict]]:
    """Writes, in order, into a run of their own: the same answers from both clients."""
    rng = np.random.default_rng(3)
    engine = SHAPE.to_model_axis(routes(rng, 9, SHAPE))
    return [
        ("ingest", (batch_bytes(run, "w", 0, ["r0"] * 5, np.arange(5), routes(rng, 5, SHAPE), shape=SHAPE),), {}),
        ("finish", (run, "r0", 6), {}),
        ("upload_route", (run, "r1", engine), {"num_experts": 16}),
        ("upload_sglang_output", (run, "r2", engine.astype(np.int32)), {"num_layers": 3, "top_k": 2,
                                                                         "num_experts": 16}),
        ("set_health_thresholds", (run, {"GAP": {"warn": 0, "fail": 0.5}}), {}),
        ("reset_health_thresholds", (run,), {}),
    ]


@pytest.mark.slow
def test_every_method_answers_as_the_sync_one(demo):
    sync = ReplayClient(demo.url)
    full = sync.get_route("demo", "clean-00")
    posted = sync.compare("demo", ["clean-00"] * len(full.positions), full.positions, full.experts, step=1)
    covered = set(calls_of("demo", posted["compare_id"])) | {name for name, _, _ in write_calls("x")}
    rest = {"compare", "check_batch", "requests", "upload_sglang_response", "upload_vllm_response",
            "get_openai_route", "get_openai_routes", "upload_vllm_output"}  # below, or in the recipes' tests
    assert covered | rest == set(public_methods(ReplayClient)) - ONLY_SYNC

    async def both() -> None:
        async with AsyncReplayClient(demo.url) as client:
            for name, (args, kwargs) in calls_of("demo", posted["compare_id"]).items():
                if name == "check_batch":
                    continue
                same(getattr(sync, name)(*args, **kwargs), await getattr(client, name)(*args, **kwargs))
            with pytest.raises(RoutingUnhealthy) as sync_refusal:
                sync.check_batch("demo", ["clean-00", "flagged-zero"])
            with pytest.raises(RoutingUnhealthy) as async_refusal:
                await client.check_batch("demo", ["clean-00", "flagged-zero"])
            assert str(sync_refusal.value) == str(async_refusal.value)
            assert [s async for s in client.requests("demo", page_size=5)] == list(sync.requests("demo", page_size=5))
            again = await client.compare("demo", ["clean-00"] * len(full.positions), full.positions, full.experts)
            assert again["router_mismatch"] == posted["router_mismatch"] == 0.0
            for (name, args, kwargs), (_, async_args, async_kwargs) in zip(write_calls("w-sync"),
                                                                           write_calls("w-async")):
                mine = getattr(sync, name)(*args, **kwargs)
                theirs = await getattr(client, name)(*async_args, **async_kwargs)
                if isinstance(mine, dict):
                    mine, theirs = {**mine, "run_id": None}, {**theirs, "run_id": None}
                same(mine, theirs)
            for rid in ("r0", "r1", "r2"):
                same(sync.get_route("w-sync", rid), dataclasses.replace(await client.get_route("w-async", rid),
                                                                        run_id="w-sync"))

    asyncio.run(both())
    sync.close()


@pytest.mark.slow
def test_a_call_in_the_background_answers_as_the_call(demo):
    with ReplayClient(demo.url) as client:
        upcoming = client.in_background(client.megatron_batch, [("demo", "clean-03")], tp_size=2, tp_rank=0)
        same(upcoming.result(timeout=60), client.megatron_batch([("demo", "clean-03")], tp_size=2, tp_rank=0))
        failing = client.in_background(client.get_route, "demo", "no-such-request")
        with pytest.raises(ReplayError, match="404"):
            failing.result(timeout=60)


# ---- in flight, bounded, retried, refused: a probe server --------------------------------------------------------


ANSWER = {"stored": True, "duplicate": False, "rows": 1, "padding_dropped": 0, "flagged": {}, "bytes": 1,
          "recomputed": 0}


class Probe:
    """A real server's app (plain ASGI) that answers every POST as an ingest does, after `hold` requests are in
    flight together (or `wait_s`: a hang guard), and records how many were in flight at once; `refuse` lists
    statuses to answer first, in order, with `retry_after`."""

    def __init__(self, hold: int = 1, refuse: tuple[int, ...] = (), retry_after: str | None = None,
                 wait_s: float = 10.0) -> None:
        self.hold, self.refuse, self.retry_after, self.wait_s = hold, list(refuse), retry_after, wait_s
        self.in_flight = self.most = 0
        self.arrivals: list[float] = []
        self.enough: asyncio.Event | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.arrivals.append(time.monotonic())
        if self.refuse:
            status = self.refuse.pop(0)
            headers = [(b"content-type", b"application/json")]
            if self.retry_after is not None:
                headers.append((b"retry-after", self.retry_after.encode()))
            await self._answer(send, status, {"detail": "busy"}, headers)
            return
        self.enough = self.enough or asyncio.Event()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.hold:
            self.enough.set()
        try:
            await asyncio.wait_for(self.enough.wait(), self.wait_s)
        except TimeoutError:
            pass
        self.in_flight -= 1
        if not self.in_flight:
            self.enough = None  # the next group waits for its own
        await self._answer(send, 200, ANSWER, [(b"content-type", b"application/json")])

    @staticmethod
    async def _answer(send, status: int, doc: dict, headers: list) -> None:
        body = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _uploads(client: AsyncReplayClient, count: int):
    route = np.zeros((4, 3, 2), np.uint8)
    return asyncio.gather(*(client.upload_route("probe", f"r{i}", route, num_experts=16) for i in range(count)))


@pytest.mark.slow
def test_uploads_from_one_event_loop_are_in_flight_together():
    probe = Probe(hold=12)
    with served_in_thread(probe) as port:
        async def run() -> list:
            async with AsyncReplayClient(f"http://127.0.0.1:{port}") as client:
                return await _uploads(client, 12)

        answers = asyncio.run(run())
    assert probe.most == 12 and all(a.stored for a in answers)


@pytest.mark.slow
def test_max_in_flight_bounds_the_calls_sent_at_once():
    probe = Probe(hold=4, wait_s=1.0)
    with served_in_thread(probe) as port:
        async def run() -> list:
            async with AsyncReplayClient(f"http://127.0.0.1:{port}", max_in_flight=4) as client:
                return await _uploads(client, 16)

        answers = asyncio.run(run())
    assert probe.most == 4 and len(answers) == 16


@pytest.mark.slow
@pytest.mark.parametrize("status", [503, 429])
def test_a_refusal_with_retry_after_is_retried_after_it(status):
    probe = Probe(refuse=(status,), retry_after="1")
    with served_in_thread(probe) as port:
        async def run():
            async with AsyncReplayClient(f"http://127.0.0.1:{port}") as client:
                return await _uploads(client, 1)

        (answer,) = asyncio.run(run())
        assert answer.stored and len(probe.arrivals) == 2
        assert probe.arrivals[1] - probe.arrivals[0] >= 0.9  # it waited as Retry-After said
        probe.refuse = [status]
        with ReplayClient(f"http://127.0.0.1:{port}") as client:  # the sync client alike
            assert client.upload_route("probe", "s", np.zeros((4, 3, 2), np.uint8), num_experts=16).stored
        assert len(probe.arrivals) == 4 and probe.arrivals[3] - probe.arrivals[2] >= 0.9


@pytest.mark.slow
def test_retries_end():
    probe = Probe(refuse=(503,) * 10, retry_after="0")
    with served_in_thread(probe) as port:
        async def run():
            async with AsyncReplayClient(f"http://127.0.0.1:{port}", retries=Retries(attempts=2)) as client:
                return await _uploads(client, 1)

        with pytest.raises(ReplayError, match="HTTP 503: busy"):
            asyncio.run(run())
        assert len(probe.arrivals) == 3  # the try and two more
        with ReplayClient(f"http://127.0.0.1:{port}", retries=Retries(attempts=0)) as client:
            with pytest.raises(ReplayError, match="HTTP 503"):
                client.upload_route("probe", "s", np.zeros((4, 3, 2), np.uint8), num_experts=16)
        assert len(probe.arrivals) == 4


@pytest.mark.slow
def test_an_answer_larger_than_allowed_is_refused_before_it_is_read(demo):
    with ReplayClient(demo.url, max_answer_bytes=1000) as client:
        with pytest.raises(AnswerTooLarge, match="more than max_answer_bytes=1000"):
            client.get_route("demo", "clean-00")
        assert client.run("demo").run_id == "demo"  # the client goes on (small JSON answers are not bounded)

    async def run() -> None:
        async with AsyncReplayClient(demo.url, max_answer_bytes=1000) as client:
            with pytest.raises(AnswerTooLarge, match="more than max_answer_bytes=1000"):
                await client.get_route("demo", "clean-00")
            assert (await client.get_route_npy("demo", "clean-00", end=2)).shape[0] == 2

    asyncio.run(run())
