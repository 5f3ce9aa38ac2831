"""verl's agent loop recording every answer's routes in the replay service, through `AsyncReplayClient`.

verl 0.9.1's agent loops (`verl/experimental/agent_loop/`) get each answer from `server_manager.generate(...)`: with
`enable_rollout_routing_replay` on, verl's vLLM server puts vLLM's own `routed_experts` (every model layer, rows for
the prompt and the answer but the last token) into the `TokenOutput`. `RecordingServerManager` wraps the server
manager an agent loop is given: it hands every answer back at once and starts its upload as a task, so the loop's
other generations, reward calls and uploads go on meanwhile. The id it stores under goes back to the agent loop in
`extra_fields["replay_request_id"]`; `drain()` awaits every upload started (call it before the batch is trained: an
upload that failed raises there).

    client = AsyncReplayClient(url)                      # one per event loop (the agent loop worker's)
    recorder = RecordingServerManager(server_manager, client, run_id="rl-run-7", num_experts=128)
    loop = SingleTurnAgentLoop(trainer_config=..., server_manager=recorder, ...)
    outputs = await asyncio.gather(*(loop.run(sampling_params, raw_prompt=p) for p in prompts))
    await recorder.drain()

docs/guides/verl_agent_loop.md shows it; tests/test_recipes.py runs this file as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_client import AsyncReplayClient, IngestAnswer


class RecordingServerManager:
    """verl's server manager, with every answer's `routed_experts` uploaded to the replay service in the background."""

    def __init__(self, inner: Any, client: AsyncReplayClient, run_id: str, num_experts: int,
                 moe_layers: Sequence[int] | None = None) -> None:
        """`inner`: the server manager verl gives the agent loop; `moe_layers`: the model layers with a router,
        needed when the run is new and the model has dense layers (vLLM's array holds every model layer)."""
        self.inner = inner
        self.client = client
        self.run_id = run_id
        self.num_experts = num_experts
        self.moe_layers = moe_layers
        self.uploads: list[asyncio.Task[IngestAnswer]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        """verl's `generate`, answered as the server answered; an answer with routes starts its upload."""
        output = await self.inner.generate(request_id=request_id, prompt_ids=prompt_ids,
                                           sampling_params=sampling_params, **kwargs)
        if output.routed_experts is not None and output.stop_reason != "aborted":
            stored = f"verl-{request_id}"
            output.extra_fields["replay_request_id"] = stored
            self.uploads.append(asyncio.create_task(self.client.upload_route(
                self.run_id, stored, np.asarray(output.routed_experts), num_experts=self.num_experts,
                moe_layers=self.moe_layers)))
        return output

    async def drain(self) -> list[IngestAnswer]:
        """Wait for every upload started so far; their answers (the first failure raises)."""
        uploads, self.uploads = self.uploads, []
        return list(await asyncio.gather(*uploads))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the rest of verl's server manager, as it is
