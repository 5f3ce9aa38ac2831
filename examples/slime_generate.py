"""slime's custom generate function, recording each SGLang answer's routes in the replay service.

slime calls `--custom-generate-function-path examples.slime_generate.generate` as `await generate(args, sample,
sampling_params)` for each sample, many at once, and trains on what it sets on the sample. This one asks SGLang's
`/generate` (through slime's router) for the sample's tokens with `return_routed_experts` (and
`return_prompt_token_ids`, so the service keeps each row's token), fills the sample as
slime's own generate does (`tokens`, `response`, `response_length`, `status`, `rollout_routed_experts`), and posts
SGLang's answer as it is to the replay service through `AsyncReplayClient` (one per event loop, kept on `args`)
before it returns, under `slime-<sample.index>` (kept in `sample.metadata["replay_request_id"]`). The other
samples' generations go on while it uploads.

slime is not on PyPI: this is written to its documented hook (slime's docs, "Custom generate function"; `Sample` in
`slime/utils/types.py`) and run by tests/test_recipes.py against a stand-in SGLang server that answers as SGLang
0.5.23 does; docs/guides/slime_generate.md shows it.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np

from replay_client import AsyncReplayClient


def _clients(args: Any) -> tuple[httpx.AsyncClient, AsyncReplayClient]:
    """The HTTP client to SGLang and the replay client, made once per run (on `args`, as slime keeps its state)."""
    if getattr(args, "replay_clients", None) is None:
        args.replay_clients = (httpx.AsyncClient(timeout=600), AsyncReplayClient(args.replay_url))
    return args.replay_clients


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's hook: generate `sample`'s answer with SGLang, store its routes, hand the sample back filled."""
    http, replay = _clients(args)
    answer = (await http.post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", json={
        "input_ids": sample.tokens, "sampling_params": sampling_params, "return_routed_experts": True,
        "return_prompt_token_ids": True})).json()  # the tokens too: the service keeps each row's token
    meta = answer["meta_info"]
    output = list(answer["output_ids"])
    sample.tokens = sample.tokens + output
    sample.response += answer["text"]
    sample.response_length += len(output)
    sample.status = sample.Status.TRUNCATED if meta["finish_reason"]["type"] == "length" else sample.Status.COMPLETED
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), meta.get("routed_experts_dtype", "int32"))
    sample.rollout_routed_experts = ids.reshape(len(sample.tokens) - 1, args.num_layers, args.moe_router_topk)
    stored = f"slime-{sample.index}"
    sample.metadata["replay_request_id"] = stored
    await replay.upload_sglang_response(args.replay_run_id, answer, request_ids=[stored],
                                        num_experts=args.num_experts, num_layers=args.num_layers,
                                        top_k=args.moe_router_topk, moe_layers=args.replay_moe_layers)
    return sample
