"""The frameworks' recipes (examples/verl_agent_loop.py, examples/slime_generate.py) as they are, through a real
service.

- verl 0.9.1's own `SingleTurnAgentLoop`, its server manager a stand-in answering as verl's vLLM server does with
  R3 on (`TokenOutput.routed_experts`: vLLM's array, every model layer, T - 1 rows), wrapped in the recipe's
  `RecordingServerManager`: sixteen agent loops at once, each answer's routes stored equal to what it carried, and
  uploads in flight while other generations still run.
- The slime-style `generate(args, sample, sampling_params)` against a stand-in SGLang `/generate` (a real uvicorn on
  loopback, answering as SGLang 0.5.23: tests/test_sglang_responses.py's `generate_item`), many samples at once:
  each sample filled and its routes stored equal to SGLang's.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_client import AsyncReplayClient, ReplayClient
from replay_format import RunShape
from tests.support.data import routes
from tests.support.service import served_in_thread
from tests.test_sglang_responses import generate_item

pytestmark = pytest.mark.slow  # verl's agent loop imports most of verl

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16, moe_layers=(1, 2, 3), num_hidden_layers=4)


def _load(name: str):
    """An example file as a module, as its users import it."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Timeline:
    """When each generation and each upload ran, to show they overlapped."""

    def __init__(self) -> None:
        self.generating = self.most_generating = self.arrived = 0
        self.generations: list[tuple[float, float]] = []
        self.uploads: list[tuple[float, float]] = []

    def started(self) -> float:
        """A generation starts: how long it takes, longer for each later arrival (so the first answers, and their
        uploads, come while later ones still generate; by arrival, not by answers sent, which is 0 for every request
        that arrives at once: a whole-suite run under load, 2026-12-06, saw no upload overlap a generation)."""
        self.arrived += 1
        self.generating += 1
        self.most_generating = max(self.most_generating, self.generating)
        return 0.05 * self.arrived

    def overlapping_uploads(self) -> int:
        """Uploads that started while some generation was still running."""
        return sum(any(g0 < u0 < g1 for g0, g1 in self.generations) for u0, _ in self.uploads)


def _timed_uploads(client: AsyncReplayClient, timeline: Timeline, method: str) -> None:
    """Note when each of the client's `method` calls starts and ends (the recipe calls it as it is)."""
    send = getattr(client, method)

    async def timed(*args, **kwargs):
        started = time.monotonic()
        try:
            return await send(*args, **kwargs)
        finally:
            timeline.uploads.append((started, time.monotonic()))

    setattr(client, method, timed)


# ---- verl 0.9.1's agent loop ------------------------------------------------------------------------------------


class VllmServer:
    """verl's server manager, answering as verl's vLLM server does with `enable_rollout_routing_replay`
    (verl/workers/rollout/vllm_rollout/vllm_async_server.py: `TokenOutput(routed_experts=vLLM's array)`); each
    generation takes a while, longer for later requests."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.sent: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(5)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        started = time.monotonic()
        await asyncio.sleep(self.timeline.started())
        tokens = self.rng.integers(10, 500, 6).tolist()
        routed = SHAPE.to_model_axis(routes(self.rng, len(prompt_ids) + len(tokens) - 1, SHAPE))  # vLLM's capture
        self.sent[request_id] = routed
        self.timeline.generating -= 1
        self.timeline.generations.append((started, time.monotonic()))
        return TokenOutput(token_ids=tokens, routed_experts=routed, stop_reason="completed")


def test_verls_agent_loop_records_every_answer_while_others_generate(shared_service):
    pytest.importorskip("verl.experimental.agent_loop.single_turn_agent_loop")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from tests.support.vllm_model import save_tokenizer

    recipe = _load("verl_agent_loop")
    timeline = Timeline()
    server = VllmServer(timeline)
    path = shared_service.data_dir.parent / "verl-tokenizer"
    save_tokenizer(str(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 32, "response_length": 8}}})
    # words the tiny tokenizer reads back as themselves (tests/support/vllm_model.py, `text_safe`)
    prompts = [[{"role": "user", "content": " ".join(f"t{40 + (i * 7 + j) % 60}" for j in range(4 + i))}]
               for i in range(16)]

    async def rollout() -> tuple[list, list]:
        async with AsyncReplayClient(shared_service.url) as client:
            _timed_uploads(client, timeline, "upload_route")
            recorder = recipe.RecordingServerManager(server, client, "verl-recipe", num_experts=SHAPE.num_experts,
                                                     moe_layers=SHAPE.moe_layers)
            loop = SingleTurnAgentLoop(trainer_config=DictConfigWrap(config), server_manager=recorder,
                                       tokenizer=tokenizer, processor=None, dataset_cls=None,
                                       data_config=DictConfigWrap(OmegaConf.create({})))
            outputs = await asyncio.gather(*(loop.run({"temperature": 1.0}, raw_prompt=p) for p in prompts))
            return outputs, await recorder.drain()

    outputs, answers = asyncio.run(rollout())
    assert len(answers) == 16 and all(a.stored for a in answers)
    assert timeline.most_generating == 16 and timeline.overlapping_uploads() > 0
    with ReplayClient(shared_service.url) as client:
        for request_id, routed in server.sent.items():
            stored = client.get_route("verl-recipe", f"verl-{request_id}", strict=True, layer_axis="model")
            assert np.array_equal(stored.experts, routed), request_id
    assert {o.extra_fields["replay_request_id"] for o in outputs} == {f"verl-{r}" for r in server.sent}


# ---- a slime-style custom generate -----------------------------------------------------------------------------


@dataclass
class Sample:
    """The fields of slime's `Sample` (slime/utils/types.py) the hook reads and sets."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    index: int
    tokens: list[int]
    response: str = ""
    response_length: int = 0
    status: Status = Status.PENDING
    rollout_routed_experts: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)


class SglangServer:
    """SGLang's `/generate` as a real server's app (plain ASGI): answers as SGLang 0.5.23 does with
    `return_routed_experts` (int32, every model layer), after a while."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.sent: dict[tuple[int, ...], np.ndarray] = {}
        self.rng = np.random.default_rng(9)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        started = time.monotonic()
        await asyncio.sleep(self.timeline.started())
        prompt = request["input_ids"]
        output = self.rng.integers(10, 500, request["sampling_params"]["max_new_tokens"]).tolist()
        model = SHAPE.to_model_axis(routes(self.rng, len(prompt) + len(output) - 1, SHAPE)).astype(np.int32)
        self.sent[tuple(prompt)] = model
        self.timeline.generating -= 1
        self.timeline.generations.append((started, time.monotonic()))
        answer = json.dumps(generate_item(f"sgl-{len(self.sent)}", prompt, output, model,
                                          prompt_token_ids=request.get("return_prompt_token_ids", False))).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


def test_a_slime_style_generate_records_every_sample_while_others_generate(shared_service):
    recipe = _load("slime_generate")
    timeline = Timeline()
    server = SglangServer(timeline)
    with served_in_thread(server) as port:
        @dataclass
        class Args:  # the parts of slime's args the hook reads (the replay ones are this recipe's)
            sglang_router_ip: str = "127.0.0.1"
            sglang_router_port: int = port
            num_layers: int = SHAPE.num_hidden_layers
            moe_router_topk: int = SHAPE.top_k
            num_experts: int = SHAPE.num_experts
            replay_url: str = shared_service.url
            replay_run_id: str = "slime-recipe"
            replay_moe_layers: tuple = SHAPE.moe_layers
            replay_clients: Any = None

        args = Args()
        samples = [Sample(index=i, tokens=list(range(20 + i, 26 + 2 * i))) for i in range(12)]

        async def rollout() -> list[Sample]:
            _, replay = recipe._clients(args)
            _timed_uploads(replay, timeline, "upload_sglang_response")
            try:
                return list(await asyncio.gather(*(recipe.generate(args, s, {"max_new_tokens": 5}) for s in samples)))
            finally:
                http, replay = args.replay_clients
                await http.aclose()
                await replay.aclose()

        done = asyncio.run(rollout())
    assert timeline.most_generating == 12 and timeline.overlapping_uploads() > 0
    with ReplayClient(shared_service.url) as client:
        for sample in done:
            assert sample.status is Sample.Status.TRUNCATED and sample.response_length == 5
            prompt = tuple(sample.tokens[:-5])
            model = server.sent[prompt]
            assert np.array_equal(sample.rollout_routed_experts, model)
            stored = client.get_route("slime-recipe", sample.metadata["replay_request_id"], strict=True,
                                      layer_axis="model")
            assert np.array_equal(stored.experts.astype(np.int32), model)
            assert stored.token_ids.tolist() == list(sample.tokens[:-1])
