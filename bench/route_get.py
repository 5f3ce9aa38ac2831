"""One route at a time: `GET /v1/runs/{run}/requests/{request}/routes` through a real server, against the files.

N requests of 4096 rows (48 x top-8 uint8 ids, 384 bytes a row), read one request per call,
each into one numpy array:
  - `ReplayClient.get_route` (Arrow route answer, views of the received body),
  - `ReplayClient.get_route_npy` (.npy answer),
  - plain httpx, as a script would write it: `httpx.Client.get(url).content` then
    `pa.ipc.open_stream` / `np.load` (Arrow and .npy).
The same two `ReplayClient` reads from a second service on a copy of the same data that reads every GET in a
thread (`REPLAY_HOT_READS=thread`, as before placement/on_loop.py), in the same rounds: what reading on the event
loop changes, end to end.
The floor of those clients, beside them: the same .npy answer, as many times, from a server that holds its bytes
and does nothing but send them (`bench/http_floor.py`), read by `ReplayClient`'s own transport and by plain
httpx. What the client's HTTP stack and the loopback socket cost alone: no service is faster from that client.
Baseline in the same run: one process memory-maps the store's segment files itself (warm page
cache) and copies the same requests' rows into one array (no HTTP, no checks): `bench/fetch.py`'s
`read_files_directly`. Every path is checked byte-equal to it.

Each round runs every path once, in turn (a load spike hits all of them alike); the medians of
the rounds, their spread (min-max) and the ratio to the baseline are printed. Asserts no time.

Then the service's own time per GET, without a socket or a client: the app (`create_app`, on the same data)
called as ASGI in this process, one request after another, for Arrow and .npy answers of the whole route and
of one row, three ways in turn each round: the endpoint as served (its parameters parsed by api/lean.py, a hot
read on the event loop: placement/on_loop.py); the same endpoint as it was before both (`_declared_route`: FastAPI's
per-parameter dependencies, the read in a thread; added to this app only, matched right after the real one); and
the work alone (`RouteStore.read_route` and `encode.route_answer`). The differences are what the HTTP layer costs.

    python bench/route_get.py [--requests 32] [--rows 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/route_get.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np
import pyarrow as pa
from fastapi import APIRouter, Depends, Header, Query
from starlette.concurrency import run_in_threadpool

from bench.fetch import print_rows_table, read_files_directly, timed_rounds
from bench.http_floor import BytesServer
from bench.segment_files import SHAPE, load_store
from bench.stopping import exit_on_sigterm
from replay_client import ReplayClient
from replay_client.client import npy_view
from replay_client.transport import Transport
from replay_format import LayerAxis
from replay_format.weight_versions import RecomputeRule
from replay_service.api import encode
from replay_service.api.auth import authorize
from replay_service.api.deps import RequestId, RunId, Settings, Store
from replay_service.api.models import RouteParams
from replay_service.api.parts_response import PartsResponse
from replay_service.app import create_app
from replay_service.settings import ServiceSettings
from tests.support.service import ServiceProcess


def paths(url: str, client: ReplayClient, plain: httpx.Client,
          requests: list[str]) -> dict[str, Callable[[], list[np.ndarray]]]:
    """Each way of reading every request, one GET per request, as `(rows, L, K)` arrays."""

    def route_url(rid: str) -> str:
        return f"{url}/v1/runs/bench/requests/{rid}/routes"

    def plain_arrow() -> list[np.ndarray]:
        out = []
        for rid in requests:
            table = pa.ipc.open_stream(plain.get(route_url(rid)).content).read_all()
            ids = table.column("experts").combine_chunks().flatten().to_numpy()
            out.append(ids.reshape(table.num_rows, SHAPE.num_moe_layers, SHAPE.top_k))
        return out

    def plain_npy() -> list[np.ndarray]:
        return [np.load(io.BytesIO(plain.get(route_url(rid), params={"format": "npy"}).content)) for rid in requests]

    return {
        "client get_route (Arrow)": lambda: [client.get_route("bench", rid).experts for rid in requests],
        "client get_route_npy": lambda: [client.get_route_npy("bench", rid) for rid in requests],
        "plain httpx, Arrow": plain_arrow,
        "plain httpx, .npy": plain_npy,
    }


def threaded_paths(client: ReplayClient, requests: list[str]) -> dict[str, Callable[[], list[np.ndarray]]]:
    """`ReplayClient`'s two reads from the service that reads every GET in a thread."""
    return {
        "client get_route, read in a thread": lambda: [client.get_route("bench", rid).experts for rid in requests],
        "client get_route_npy, read in a thread": lambda: [client.get_route_npy("bench", rid) for rid in requests],
    }


def floor_paths(url: str, transport: Transport, plain: httpx.Client,
                count: int) -> dict[str, Callable[[], list[np.ndarray]]]:
    """The .npy answer `count` times from `BytesServer` at `url`, by ReplayClient's transport and by plain httpx."""
    return {
        "floor: client transport, .npy": lambda: [npy_view(transport.fetch_bulk("GET", "/", params={"format": "npy"}))
                                                 for _ in range(count)],
        "floor: plain httpx, .npy": lambda: [np.load(io.BytesIO(plain.get(url, params={"format": "npy"}).content))
                                            for _ in range(count)],
    }


async def _asgi_get(app, path: str, query: bytes) -> int:
    """One GET through the ASGI app in this process; the answer's status."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(b"host", b"bench")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    status = 0

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        nonlocal status
        status = message.get("status", status)

    await app(scope, receive, send)
    return status


ROUTE_PATH = "/v1/runs/{run}/requests/{request}/routes"


def _declared_route(app) -> str:
    """The route GET as it was declared before api/lean.py and placement/on_loop.py (FastAPI solving each parameter,
    the read in a thread), added to `app` right after the served one (the same matching cost); its path template."""
    router = APIRouter(dependencies=[Depends(authorize)])
    path = "/bench/declared/{run}/requests/{request}/routes"

    @router.get(path, response_class=PartsResponse)
    async def declared(run: RunId, request: RequestId, store: Store, settings: Settings,
                       query: Annotated[RouteParams, Query()], accept: str | None = Header(None)) -> PartsResponse:
        kind = encode.pick_format(query.format, accept)
        selection = encode.Selection(query.recompute, query.weight_version)

        def work() -> encode.Answer:
            route = store.read_route(run, request, query.start, query.end, selection.rule, selection.weight_version)
            return encode.route_answer(run, route, query.start, kind, settings.max_json_rows, query.layer_axis,
                                       selection)

        answer = await run_in_threadpool(work)
        return PartsResponse(answer.parts, answer.media_type, answer.headers)

    app.include_router(router)
    routes = app.router.routes
    added = routes.pop(next(i for i, r in enumerate(routes) if getattr(r, "path", "") == path))
    served = next(i for i, r in enumerate(routes) if getattr(r, "path", "") == ROUTE_PATH)
    routes.insert(served + 1, added)
    return path


def server_time(data: Path, request: str, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """Microseconds per GET through the app in process (as served, and as declared before), and per direct read +
    encode, by answer (medians over every call)."""
    settings = ServiceSettings(data_dir=data, fsync=False)
    app = create_app(settings)
    declared = _declared_route(app).replace("{run}", "bench").replace("{request}", request)
    selection = encode.Selection(RecomputeRule.FIRST, None)
    answers = {"Arrow, 4096 rows": (b"", None, encode.RouteFormat.ARROW),
               "npy, 4096 rows": (b"format=npy", None, encode.RouteFormat.NPY),
               "Arrow, 1 row": (b"end=1", 1, encode.RouteFormat.ARROW),
               "npy, 1 row": (b"end=1&format=npy", 1, encode.RouteFormat.NPY)}
    path = f"/v1/runs/bench/requests/{request}/routes"

    async def measure() -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, list[float]]] = {}
        async with app.router.lifespan_context(app):
            store = app.state.store

            def direct(end: int | None, kind: encode.RouteFormat) -> None:
                route = store.read_route("bench", request, 0, end, selection.rule, selection.weight_version)
                encode.route_answer("bench", route, 0, kind, settings.max_json_rows, LayerAxis.MOE, selection)

            for name, (query, _, _) in answers.items():
                for target in (path, declared):
                    assert await _asgi_get(app, target, query) == 200, (name, target)
            for _ in range(rounds * calls):  # the three ways call by call, in turn: a spike hits one call, not a way
                for name, (query, end, kind) in answers.items():
                    times = out.setdefault(name, {})
                    for way, target in (("served", path), ("declared", declared)):
                        started = time.perf_counter()
                        await _asgi_get(app, target, query)
                        times.setdefault(way, []).append((time.perf_counter() - started) * 1e6)
                    started = time.perf_counter()
                    direct(end, kind)
                    times.setdefault("direct", []).append((time.perf_counter() - started) * 1e6)
        return {name: {k: statistics.median(v) for k, v in ways.items()} for name, ways in out.items()}

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4096, help="rows per request")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="GETs per round of the in-process measurement")
    args = parser.parse_args()
    requests = [f"r{i:03d}" for i in range(args.requests)]
    total_rows = args.requests * args.rows
    with tempfile.TemporaryDirectory() as tmp:
        data, copy = Path(tmp) / "data", Path(tmp) / "data-threaded"
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc, ReplayClient(proc.url) as client:
            load_store(client, requests, args.rows)
        shutil.copytree(data, copy)  # the service stopped: its files as it left them
        with ServiceProcess(data, env={"REPLAY_FSYNC": "false"}) as proc, ReplayClient(proc.url) as client, \
                ServiceProcess(copy, env={"REPLAY_FSYNC": "false", "REPLAY_HOT_READS": "thread"}) as threaded, \
                ReplayClient(threaded.url) as threaded_client, httpx.Client(timeout=60) as plain:
            one_route = plain.get(f"{proc.url}/v1/runs/bench/requests/{requests[0]}/routes",
                                  params={"format": "npy"}).content
            with BytesServer(one_route) as floor_url:
                transport = Transport(floor_url, 60, None)
                ways = {"direct segment files, one process": lambda: [read_files_directly(data, requests)],
                        **paths(proc.url, client, plain, requests),
                        **threaded_paths(threaded_client, requests),
                        **floor_paths(floor_url, transport, plain, len(requests))}
                expected = read_files_directly(data, requests).numpy()
                for name, way in ways.items():  # warm (page cache, segment cache, connections) and check bytes
                    got = np.concatenate(way())
                    want = np.concatenate([expected[:args.rows]] * len(requests)) if name.startswith("floor") \
                        else expected
                    assert np.array_equal(got, want), f"{name}: not the rows sent"
                load = os.getloadavg()[0]
                times = timed_rounds(ways, args.rounds)
                load_after = os.getloadavg()[0]
                transport.close()

        served = server_time(data, requests[0], args.calls, args.rounds)

    print(f"GET one route at a time: {args.requests} requests x {args.rows} rows, {SHAPE.num_moe_layers} x top-"
          f"{SHAPE.top_k} uint8 ({total_rows * SHAPE.row_width / 1e6:.0f} MB); {args.rounds} rounds, "
          f"1-min load {load:.2f} -> {load_after:.2f}")
    summary = print_rows_table(times, total_rows, "direct segment files, one process")
    print(f"The service's time per GET in process (ASGI, no socket), {args.rounds} x {args.calls} calls each, medians:")
    print(f"  {'answer':18s} {'as served':>10s} {'declared (before)':>18s} {'work alone':>11s} "
          f"{'HTTP layer served / declared':>29s}")
    for name, us in served.items():
        print(f"  {name:18s} {us['served']:7.0f} us {us['declared']:15.0f} us {us['direct']:8.0f} us "
              f"{us['served'] - us['direct']:14.0f} / {us['declared'] - us['direct']:.0f} us")
    print(json.dumps(summary | {"load_1min": round(load, 2),
                                "server_us": {k: {w: round(v) for w, v in us.items()} for k, us in served.items()}}))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
