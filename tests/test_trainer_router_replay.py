"""replay_client.router_replay against real megatron-core 0.16.1 code on CPU.

- Missing routes: a real `TopKRouter.routing` (the router's forward after its gate, which insists on CUDA) in
  REPLAY_FORWARD / REPLAY_BACKWARD, with and without `install_router_fallback`.
- Guards: real `TransformerConfig`s; the fused-router branch of megatron-core's own routing function.
- Plans: real `GPTModel` chunks built as pipeline rank r of a PP x VPP grid (a fake process group stands in
  for the other ranks: megatron-core only asks it for ranks and sizes while building), compared with the
  plan computed from the config alone, then replayed end to end from a trainer batch of a real service.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format import RunShape
from tests.support.data import store_requests
from tests.support.trainers import built_rank

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core.transformer.moe.router_replay")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from replay_client.router_replay import (  # noqa: E402
    MISSING_ROUTE,
    ReplayPlan,
    RouterReplayError,
    check_config,
    check_model,
    install_router_fallback,
    plan_for_model,
    plan_for_rank,
    router_fallback,
    router_fallback_installed,
    stage_layers,
    uninstall_router_fallback,
)

E, K = 16, 4
FORWARD, BACKWARD = RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD
NO_GROUPS = ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)


@pytest.fixture(autouse=True)
def clean_replay_state():
    """Every test starts and ends with megatron-core's own method and no router instances."""
    uninstall_router_fallback()
    RouterReplay.clear_global_router_replay_instances()
    yield
    uninstall_router_fallback()
    RouterReplay.clear_global_router_replay_instances()


def _config(**overrides) -> TransformerConfig:
    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
              moe_enable_routing_replay=True, moe_router_load_balancing_type="none", use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _router(**overrides) -> TopKRouter:
    router = TopKRouter(_config(**overrides), pg_collection=NO_GROUPS)
    router.set_layer_number(1)
    return router


def _one_hot(ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids, True)


def _targets(n: int, seed: int, missing: list[int]) -> torch.Tensor:
    """Distinct ids per row, unrelated to the router's own choice; the rows in `missing` all -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    ids[missing] = MISSING_ROUTE
    return ids


ROUTERS = {
    "softmax-pre": dict(moe_router_pre_softmax=True),
    "softmax-post": dict(moe_router_pre_softmax=False),  # top-k on the logits, softmax over the K chosen
    "sigmoid": dict(moe_router_score_function="sigmoid"),
    "group-limited": dict(moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2),
    "scaled": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
}


# ---- missing routes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_a_missing_route_takes_the_routers_own_top_k_and_the_rest_is_replayed(kind):
    router = _router(**ROUTERS[kind])
    s, b = 7, 3  # [s, b] as the router sees hidden states
    logits = torch.randn(s, b, E, generator=torch.Generator().manual_seed(1))
    own_probs, own_map = router.routing(logits)  # no action: the router's own routing
    missing = [0, 5, 6, 20]  # first, middle, last token
    target = _targets(s * b, seed=2, missing=missing)
    rest = torch.ones(s * b, dtype=torch.bool)
    rest[missing] = False
    install_router_fallback()
    router.router_replay.set_target_indices(target)
    router.router_replay.set_router_replay_action(FORWARD)
    probs, routing_map = router.routing(logits)
    # the missing tokens route exactly as the router alone does, probabilities included
    assert torch.equal(routing_map[missing], own_map[missing])
    assert torch.equal(probs[missing], own_probs[missing])
    # every other token goes to exactly its replayed experts, which are mostly not the router's own
    assert torch.equal(routing_map[rest], _one_hot(target[rest]))
    assert not torch.equal(routing_map[rest], own_map[rest])
    assert (probs[routing_map] > 0).all()


def test_without_the_fallback_a_missing_route_crashes_the_router():
    """megatron-core 0.16.1 gathers the scores at id -1 (moe/router_replay.py:151): on CPU an IndexError-like
    RuntimeError, on CUDA a device-side assert. It never routes the token to a wrong expert silently."""
    router = _router(moe_router_pre_softmax=True)
    logits = torch.randn(4, 2, E)
    router.router_replay.set_target_indices(_targets(8, seed=3, missing=[5]))
    router.router_replay.set_router_replay_action(FORWARD)
    with pytest.raises(RuntimeError, match="index -1 is out of bounds"):
        router.routing(logits)
    install_router_fallback()
    _, routing_map = router.routing(logits)
    assert routing_map.sum(dim=1).eq(K).all()


def test_backward_recompute_routes_as_its_forward_did_micro_batch_by_micro_batch():
    """Activation recompute pops each micro-batch's entry in REPLAY_BACKWARD: missing rows reuse the forward's
    choice even when the recomputed logits differ (they may in the last bit on GPU; here, wholly)."""
    router = _router(moe_router_pre_softmax=True)
    replay = router.router_replay
    install_router_fallback()
    gen = torch.Generator().manual_seed(4)
    forwards = []
    for mb in range(2):  # forward of micro-batches 0 and 1, then their backward recomputes
        target = _targets(12, seed=10 + mb, missing=[3, 4, 11])
        replay.set_target_indices(target)
        replay.set_router_replay_action(FORWARD)
        _, routing_map = router.routing(torch.randn(6, 2, E, generator=gen))
        forwards.append(routing_map)
    replay.set_router_replay_action(BACKWARD)
    for mb in range(2):
        other_logits = torch.randn(6, 2, E, generator=gen)
        _, routing_map = router.routing(other_logits)
        assert torch.equal(routing_map, forwards[mb])
    assert replay.replay_backward_list == []


def test_record_mode_and_no_action_are_untouched():
    router = _router(moe_router_pre_softmax=True)
    logits = torch.randn(5, 1, E)
    own_probs, own_map = router.routing(logits)
    with router_fallback():
        assert router_fallback_installed()
        probs, routing_map = router.routing(logits)
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        router.routing(logits)
        recorded = router.router_replay.get_recorded_indices()
    assert not router_fallback_installed()  # the context restored megatron-core's method
    assert torch.equal(probs, own_probs) and torch.equal(routing_map, own_map)
    assert torch.equal(_one_hot(recorded), own_map)


def test_install_is_idempotent_and_refuses_an_unknown_megatron_signature(monkeypatch):
    original = RouterReplay.get_replay_topk
    install_router_fallback()
    wrapped = RouterReplay.get_replay_topk
    install_router_fallback()
    assert RouterReplay.get_replay_topk is wrapped and wrapped.__wrapped__ is original
    with router_fallback():  # already installed: leaves it installed after
        pass
    assert router_fallback_installed()
    uninstall_router_fallback()
    assert RouterReplay.get_replay_topk is original

    def other_version(self, scores, topk, default_compute_topk=None):
        return default_compute_topk(scores, topk)

    monkeypatch.setattr(RouterReplay, "get_replay_topk", other_version)
    with pytest.raises(RouterReplayError, match="does not know where replayed ids are consumed"):
        install_router_fallback()


def test_a_row_mixing_minus_one_with_ids_is_refused():
    """NeMo-RL's rule: only a whole row of -1 means "no route"; anything else negative is corruption."""
    router = _router(moe_router_pre_softmax=True)
    target = _targets(6, seed=5, missing=[1])
    target[4, 2] = MISSING_ROUTE
    router.router_replay.set_target_indices(target)
    router.router_replay.set_router_replay_action(FORWARD)
    install_router_fallback()
    with pytest.raises(RouterReplayError, match=r"mix negative and real ids \(first rows \[4\]"):
        router.routing(torch.randn(3, 2, E))


def test_a_replay_tensor_shorter_than_the_routers_tokens():
    """Unfixed, megatron-core gathers only the rows it is given: the other tokens get no expert, silently."""
    router = _router(moe_router_pre_softmax=True)
    router.router_replay.set_target_indices(_targets(6, seed=6, missing=[]))
    router.router_replay.set_router_replay_action(FORWARD)
    _, routing_map = router.routing(torch.randn(5, 2, E))  # 10 tokens, 6 rows
    assert routing_map.sum(dim=1).tolist() == [K] * 6 + [0] * 4
    install_router_fallback()
    with pytest.raises(RouterReplayError, match=r"shape \(6, 4\) for a router of 10 tokens x top-4"):
        router.routing(torch.randn(5, 2, E))


# ---- guards -------------------------------------------------------------------------------------------------


def test_check_config_names_every_setting_that_defeats_replay_and_its_fix():
    check_config(_config())  # a plain top-k router with replay enabled passes
    cases = {
        "moe_router_fusion=True": dict(moe_router_fusion=True),
        "moe_enable_routing_replay=False": dict(moe_enable_routing_replay=False),
        "moe_router_load_balancing_type='sinkhorn'": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1),
        "moe_router_force_load_balancing=True": dict(moe_router_force_load_balancing=True),
        "moe_expert_capacity_factor=1.25": dict(moe_expert_capacity_factor=1.25),
    }
    fixes = ["set moe_router_fusion=False", "set moe_enable_routing_replay=True", "use a top-k type",
             "set it False", "set moe_expert_capacity_factor=None"]
    for (setting, overrides), fix in zip(cases.items(), fixes):
        with pytest.raises(RouterReplayError) as err:
            check_config(_config(**overrides))
        assert setting in str(err.value) and fix in str(err.value), str(err.value)
    with pytest.raises(RouterReplayError) as err:  # several at once: all named
        check_config(_config(moe_router_fusion=True, moe_expert_capacity_factor=2.0))
    assert "moe_router_fusion=True" in str(err.value) and "moe_expert_capacity_factor=2.0" in str(err.value)


def test_the_fused_router_never_consults_router_replay(monkeypatch):
    """megatron-core 0.16.1's `topk_routing_with_score_function(fused=True)` returns TE's fused top-k
    (megatron/core/transformer/moe/moe_utils.py:652-666) before the replay hook. TE is not on this machine: its
    kernel is stood in for by the unfused routing without replay (what the fused kernel computes). The replayed
    ids are ignored and `get_replay_topk` is never called; check_model refuses the router."""
    calls = []
    real_topk = moe_utils.topk_routing_with_score_function

    def te_fused_topk(logits, topk, **kw):
        return real_topk(logits, topk, use_pre_softmax=kw["use_pre_softmax"], score_function=kw["score_function"])

    monkeypatch.setattr(moe_utils, "HAVE_TE", True, raising=False)
    monkeypatch.setattr(moe_utils, "fused_topk_with_score_function", te_fused_topk, raising=False)
    original = RouterReplay.get_replay_topk
    monkeypatch.setattr(RouterReplay, "get_replay_topk", lambda self, *a: calls.append(a) or original(self, *a))
    fused = _router(moe_router_pre_softmax=True, moe_router_fusion=True)
    logits = torch.randn(4, 2, E)
    _, own_map = fused.routing(logits)
    target = _targets(8, seed=7, missing=[])
    fused.router_replay.set_target_indices(target)
    fused.router_replay.set_router_replay_action(FORWARD)
    _, routing_map = fused.routing(logits)
    assert torch.equal(routing_map, own_map) and not torch.equal(routing_map, _one_hot(target))
    assert calls == []
    unfused = _router(moe_router_pre_softmax=True)
    unfused.router_replay.set_target_indices(target)
    unfused.router_replay.set_router_replay_action(FORWARD)
    assert torch.equal(unfused.routing(logits)[1], _one_hot(target)) and len(calls) == 1
    with pytest.raises(RouterReplayError, match="moe_router_fusion=True"):
        check_model(fused)
    check_model(unfused)
    with pytest.raises(RouterReplayError, match="no megatron-core TopKRouter"):
        check_model(torch.nn.Linear(2, 2))


# ---- plans: which recorded layer feeds which router ------------------------------------------------------


PATTERN = [0, 1, 1, 1, 1, 1, 1, 1]  # a dense first layer, as DeepSeek-V3 / GLM-4.5 / Kimi K2 (first_k_dense)
LAYOUTS = {
    # name: (pp, vpp, overrides, {rank: (model layers of its decoder routers, MTP routers)})
    "pp1-dense-first": (1, None, dict(num_layers=6, moe_layer_freq=[0, 0, 1, 1, 1, 1]), {0: ([2, 3, 4, 5], 0)}),
    "pp2-vpp2-mtp": (2, 2, dict(num_layers=8, moe_layer_freq=PATTERN, mtp_num_layers=1),
                     {0: ([1, 4, 5], 0), 1: ([2, 3, 6, 7], 1)}),
    "pp2-uneven": (2, None, dict(num_layers=8, moe_layer_freq=PATTERN, num_layers_in_first_pipeline_stage=3),
                   {0: ([1, 2], 0), 1: ([3, 4, 5, 6, 7], 0)}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_plan_from_the_config_is_the_plan_of_the_built_model(name):
    pp, vpp, overrides, expected = LAYOUTS[name]
    for rank, (model_layers, mtp) in expected.items():
        with built_rank(pp, rank, vpp, **overrides) as (config, chunks):
            built = plan_for_model(chunks)
            planned = plan_for_rank(config, rank)
            assert built == planned, (rank, built, planned)
            assert built.model_layers == model_layers and built.mtp_routers == mtp
            # the plan's instances are the model's, in construction order (which set_replay_data uses)
            assert list(built.instances) == RouterReplay.global_router_replay_instances
        RouterReplay.clear_global_router_replay_instances()


def test_virtual_pipeline_chunks_hold_non_contiguous_layers():
    _, vpp, overrides, _ = LAYOUTS["pp2-vpp2-mtp"]
    config = _config(hidden_size=16, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp,
                     pipeline_dtype=torch.float32, **overrides)
    assert [list(stage_layers(config, 1, v)) for v in range(vpp)] == [[2, 3], [6, 7]]
    assert [list(stage_layers(config, 0, v)) for v in range(vpp)] == [[0, 1], [4, 5]]
    plan = plan_for_rank(config, 1, moe_layers=range(1, 8))
    assert plan.moe_ordinals == [1, 2, 5, 6] and plan.slots == (1, 2, 5, 6, None)
    with pytest.raises(RouterReplayError, match="not this config's"):
        plan_for_rank(config, 1, moe_layers=range(0, 7))


def test_a_pipeline_layout_is_read_from_the_built_model_only():
    config = _config(num_layers=4, hidden_size=16, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                     pipeline_model_parallel_layout="Ett|ttL")
    with pytest.raises(RouterReplayError, match=r"use plan_for_model\(model\)"):
        plan_for_rank(config, 1)


def test_mtp_routers_need_the_fallback_and_route_themselves():
    plan = ReplayPlan(slots=(3, None), moe_layers=(1, 2, 3, 4), top_k=K)
    data = [torch.zeros(5, K, dtype=torch.int64)]
    with pytest.raises(RouterReplayError, match=r"call install_router_fallback\(\) first"):
        plan.replay_data(data)
    install_router_fallback()
    out = plan.replay_data(data)
    assert out[0] is data[0] and out[1].shape == (5, K) and out[1].eq(MISSING_ROUTE).all()
    with pytest.raises(RouterReplayError, match="2 replay tensors for this rank's 1 decoder routers"):
        plan.replay_data(data * 2)


def test_a_rank_with_vpp_and_mtp_replays_every_recorded_layer_end_to_end(shared_service):
    """Rank 1 of PP 2 x VPP 2, 8 layers (layer 0 dense), one MTP layer: the trainer batch fetched with the plan's
    MoE ordinals, fed through the plan, makes every decoder router follow its own model layer's recorded
    route and the MTP router choose for itself. Unfixed: megatron-core's list refuses the stage's layers (one
    router too many), and the contiguous range a non-VPP stage would hold replays other layers, silently."""
    pp, vpp, overrides, _ = LAYOUTS["pp2-vpp2-mtp"]
    client = ReplayClient(shared_service.url)
    shape = RunShape(num_moe_layers=7, top_k=K, num_experts=E, moe_layers=tuple(range(1, 8)), num_hidden_layers=8)
    full = store_requests(client, "rr-vpp", {"v-a": 9, "v-b": 6}, shape=shape)
    sequences = [("rr-vpp", "v-a"), ("rr-vpp", "v-b")]
    gen = torch.Generator().manual_seed(8)
    with built_rank(pp, 1, vpp, **overrides) as (config, chunks):
        plan = plan_for_model(chunks, shape.moe_layers)
        assert plan.model_layers == [2, 3, 6, 7] and plan.mtp_routers == 1
        batch = client.megatron_batch(sequences, moe_ordinals=plan.moe_ordinals)
        assert batch.moe_layers == plan.model_layers
        n, real = batch.num_tokens, batch.valid.astype(bool)
        recorded = {layer: np.concatenate([np.concatenate([full[r][:, layer - 1], np.zeros((1, K), np.uint8)])
                                           for r in ("v-a", "v-b")]) for layer in range(1, 8)}
        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        logits = [torch.randn(n, 1, E, generator=gen) for _ in routers]
        own = [r.routing(x)[1] for r, x in zip(routers, logits)]

        def replayed(data_setter):
            RouterReplay.clear_global_indices()
            data_setter()
            RouterReplay.set_global_router_replay_action(FORWARD)
            out = [r.routing(x)[1] for r, x in zip(routers, logits)]
            RouterReplay.clear_global_router_replay_action()
            return out

        with pytest.raises(ValueError, match=r"number of replay tensors \(4\) does not match instances \(5\)"):
            RouterReplay.set_replay_data(batch.replay_data())
        install_router_fallback()
        maps = replayed(lambda: plan.set_replay_data(batch.replay_data()))
        for router, routing_map, own_map in zip(routers, maps, own):
            if router.layer_number > config.num_layers:  # the MTP layer: its own choice on every token
                assert torch.equal(routing_map, own_map)
                continue
            want = _one_hot(torch.from_numpy(recorded[router.layer_number - 1].astype(np.int64)))
            assert torch.equal(routing_map[real], want[real]), router.layer_number
        # the non-VPP guess (rank 1 holds layers 4..7): as many layers, so nothing complains, and the
        # routers of layers 2 and 3 replay layers 4 and 5 (6 and 7 happen to line up)
        naive = client.megatron_batch(sequences, model_layer_range=(4, 8))
        assert len(naive.replay_data()) == len(plan.moe_ordinals)
        maps = replayed(lambda: plan.set_replay_data(naive.replay_data()))
        wrong = [router.layer_number - 1 for router, m in zip(routers, maps) if router.layer_number <= 8
                 and not torch.equal(m[real], _one_hot(torch.from_numpy(
                     recorded[router.layer_number - 1].astype(np.int64)))[real])]
        assert wrong == [2, 3]


# ---- what verl does with a route's length (docs/guides/trainers.md, consumer notes) ----------------------------------


def test_verl_r3_takes_t_or_t_minus_1_rows_and_leaves_each_last_token_native():
    """verl 0.9.1's own code: `align_r3_router_replay_data` keeps T rows, appends a zero row to T-1 rows and
    refuses any other count; `build_r3_replay_mask` replays every token but the last of each sequence with a
    response. (Before that, its agent loop copies min(rows, T) rows into a zero tensor of T rows,
    verl/experimental/agent_loop/agent_loop.py:129-141: longer routes are truncated there, shorter ones zero-filled.)"""
    utils = pytest.importorskip("verl.utils.megatron.router_replay_utils")

    def jagged(parts):
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)

    input_ids = jagged([torch.zeros(5, dtype=torch.long), torch.zeros(3, dtype=torch.long)])
    routes = jagged([torch.ones(4, 2, K, dtype=torch.int16), torch.ones(3, 2, K, dtype=torch.int16)])
    aligned = utils.align_r3_router_replay_data(routes, input_ids).unbind()
    assert [tuple(t.shape) for t in aligned] == [(5, 2, K), (3, 2, K)]
    assert not aligned[0][-1].any() and aligned[0][:-1].eq(1).all() and aligned[1].eq(1).all()
    with pytest.raises(RuntimeError, match="3 route rows for 5 input tokens"):
        utils.align_r3_router_replay_data(jagged([torch.ones(3, 2, K), torch.ones(3, 2, K)]), input_ids)
    mask = utils.build_r3_replay_mask(input_ids, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert [t.tolist() for t in mask.unbind()] == [[True] * 4 + [False], [True, True, False]]
