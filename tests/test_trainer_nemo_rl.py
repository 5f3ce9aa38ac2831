"""NeMo-RL's missing-route convention, from the service to real megatron-core 0.16.1 routers on CPU.

NeMo-RL (NVIDIA-NeMo/RL, not importable here: its rule restated, file and line cited) hands Megatron one
`[T, layers, K]` route per sequence of `T` tokens:
- `ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL = -1` (nemo_rl/models/generation/interfaces.py:35): a token
  without a captured route is a whole row of -1 (vllm/utils.py:234 for routes vLLM did not return,
  experience/rollouts.py:323 `backfill_missing_routed_experts` for turns without any);
- the final token, which has no route, gets the default route `arange(K)` (vllm/utils.py:220-227);
- its Megatron install wraps `RouterReplay.get_replay_topk` so all -1 rows take the router's own top-k and
  rows that are only partly negative are corruption (models/megatron/router_replay.py:255-361, 200-252).
The client's `missing="router"` answer must be that tensor on every token the model uses, and
`install_router_fallback` must route it as NeMo-RL's wrapper does.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format import RunShape
from tests.support.data import store_requests

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core.transformer.moe.router_replay")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from replay_client.router_replay import MISSING_ROUTE, install_router_fallback, uninstall_router_fallback  # noqa: E402

E, K = 16, 4
SHAPE = RunShape(num_moe_layers=3, top_k=K, num_experts=E, moe_layers=(1, 3, 4), num_hidden_layers=5)
LENGTHS = {"n-a": 12, "n-b": 7}
FLAGGED = {"n-a": [4, 5], "n-b": [0]}  # ZERO rows: no trustworthy route for those tokens


@pytest.fixture
def routers():
    """One real TopKRouter per MoE layer, replay enabled, megatron-core's own RouterReplay list in layer order."""
    uninstall_router_fallback()
    RouterReplay.clear_global_router_replay_instances()
    config = TransformerConfig(num_layers=5, hidden_size=16, num_attention_heads=2, num_moe_experts=E,
                               moe_router_topk=K, moe_enable_routing_replay=True, moe_router_pre_softmax=True,
                               moe_router_load_balancing_type="none", use_cpu_initialization=True)
    groups = ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    out = [TopKRouter(config, pg_collection=groups) for _ in SHAPE.moe_layers]
    yield out
    uninstall_router_fallback()
    RouterReplay.clear_global_router_replay_instances()


def nemo_rl_routes(recorded: np.ndarray, tokens: int, no_route: list[int]) -> np.ndarray:
    """NeMo-RL's `[T, L, K]` for one sequence (the rule above): routes, -1 rows where none, arange(K) last."""
    out = np.broadcast_to(np.arange(K, dtype=np.int64), (tokens, recorded.shape[1], K)).copy()
    out[: tokens - 1] = recorded
    out[no_route] = MISSING_ROUTE
    return out


def test_missing_router_answers_nemo_rls_tensor_and_the_fallback_routes_it(shared_service, routers):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "nemo", LENGTHS, shape=SHAPE, flagged=FLAGGED)
    order = list(LENGTHS)
    batch = client.megatron_batch([("nemo", r) for r in order], missing="router")  # THD, packed
    expected = np.concatenate([nemo_rl_routes(full[r].astype(np.int64), LENGTHS[r], FLAGGED[r]) for r in order])
    last = np.cumsum([LENGTHS[r] for r in order]) - 1
    used = np.ones(batch.num_tokens, bool)
    used[last] = False  # the final token: NeMo-RL replays arange(K), the client a filler; no later token reads it
    data = batch.replay_data()
    got = np.stack([t.numpy() for t in data], axis=1)
    assert got.shape == expected.shape
    assert np.array_equal(got[used], expected[used])
    no_route = (got == MISSING_ROUTE).all(axis=(1, 2))  # every layer's row, as NeMo-RL marks a token
    assert no_route.sum() == 3 and not (got[~no_route] < 0).any()  # whole rows only: never partly -1
    assert not batch.valid[no_route].any()

    # megatron-core's RouterReplay with the fallback: NeMo-RL's routing, token by token
    gen = torch.Generator().manual_seed(11)
    logits = [torch.randn(batch.num_tokens, 1, E, generator=gen) for _ in routers]
    own = [router.routing(x)[1] for router, x in zip(routers, logits)]
    install_router_fallback()
    RouterReplay.set_replay_data(data)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for layer, (router, x) in enumerate(zip(routers, logits)):
        _, routing_map = router.routing(x)
        assert torch.equal(routing_map[no_route], own[layer][no_route])
        replayed = torch.zeros(batch.num_tokens, E, dtype=torch.bool).scatter_(1, data[layer].clamp(min=0), True)
        assert torch.equal(routing_map[~no_route], replayed[~no_route])
