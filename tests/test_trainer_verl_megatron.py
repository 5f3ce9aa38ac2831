"""verl 0.9.1's own router-replay code, fed the client's verl answer, on real megatron-core parallel state.

Each gloo rank (tests/support/gloo.py) initialises megatron-core's `parallel_state` for a TP x CP x PP
grid and runs verl's `set_router_replay_data` (verl/utils/megatron/router_replay_utils.py) on the dense
`[batch, seq, layers, K]` batch `ReplayClient.verl_batch` returns: the padded path
(`preprocess_packed_seqs`) and the engine path verl 0.9.1 uses for R3 (`left_right_2_no_padding`,
`align_r3_router_replay_data`, `build_r3_replay_mask`, `preprocess_thd_engine`). Every router of every
rank must end up with exactly the rows the service's own slice for that rank
(`megatron_batch(convention="verl")`) gives it, on a model whose first three layers are dense, with
pipeline parallelism, on both layer axes. What could not run for real: nothing on this path; verl
resolves its accelerator at import (`device_name = "cuda"` here), so the rank sets it to "cpu".
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format import RunShape
from tests.support.data import batch_bytes, routes
from tests.support.trainers import verl_case, verl_rank_targets, verl_replay_topk

pytestmark = pytest.mark.slow  # four gloo ranks import verl and megatron-core (about a minute on two cores)

torch = pytest.importorskip("torch")
if importlib.util.find_spec("verl") is None:  # found, not imported: only the gloo ranks pay verl's import
    pytest.skip("verl 0.9.1 is not installed (pip install --no-deps verl==0.9.1)", allow_module_level=True)
gloo = pytest.importorskip("tests.support.gloo")

MOE_LAYER_FREQ = [0, 0, 0, 1, 1, 1, 1, 1]  # DeepSeek-V3-like: dense first layers
SHAPE = RunShape(num_moe_layers=5, top_k=2, num_experts=16, moe_layers=(3, 4, 5, 6, 7), num_hidden_layers=8)
SHAPES = {"vm-a": (5, 8), "vm-b": (11, 4), "vm-c": (6, 14), "vm-d": (7, 2)}  # (prompt, response); 13, 15, 20, 9
ORDER = list(SHAPES)
PW, RW = 12, 14
FLAGGED = {"vm-a": 6, "vm-c": 3}  # a ZERO row in the middle of these


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    rng = np.random.default_rng(41)
    full = {r: routes(rng, p + g - 1, SHAPE) for r, (p, g) in SHAPES.items()}
    for r, at in FLAGGED.items():
        full[r][at] = 0
    client.ingest(batch_bytes("verl-mc", "w", 0, [r for r in ORDER for _ in range(len(full[r]))],
                              np.concatenate([np.arange(len(full[r])) for r in ORDER]).astype(np.int32),
                              np.concatenate([full[r] for r in ORDER]), shape=SHAPE))
    for r, (p, g) in SHAPES.items():
        client.finish("verl-mc", r, p + g)
    return client, full


@pytest.fixture(scope="module")
def pool():
    """Four gloo ranks of their own: verl stays out of the eight the capture tests share, and they end here."""
    yield gloo.gloo_pool(4)
    gloo._POOLS.pop(4).close()


def _case(client, axis: str, path: str, tp: int, cp: int, pp: int, fp8: bool = False) -> tuple[dict, object]:
    return verl_case(client, [("verl-mc", r) for r in ORDER], [SHAPES[r][0] for r in ORDER],
                     [SHAPES[r][1] for r in ORDER], num_layers=8, moe_layer_freq=MOE_LAYER_FREQ,
                     num_experts=SHAPE.num_experts, top_k=SHAPE.top_k, axis=axis, path=path, tp=tp, cp=cp, pp=pp,
                     fp8=fp8, widths=(PW, RW))


@pytest.mark.parametrize("tp,cp,pp", [(2, 2, 1), (1, 2, 2), (2, 1, 2)])
@pytest.mark.parametrize("axis", ["model", "moe"])
@pytest.mark.parametrize("path", ["engine", "legacy"])
def test_every_router_of_every_rank_gets_the_services_slice(stored, pool, tp, cp, pp, axis, path):
    client, full = stored
    case, dense = _case(client, axis, path, tp, cp, pp)
    assert dense.experts.shape[1] == (8 if axis == "model" else 5)
    ranks = pool.run(verl_rank_targets, case)
    stages = {}
    for res in ranks:
        ours = client.megatron_batch([("verl-mc", r) for r in ORDER], convention="verl", missing="router",
                                     cp_size=cp, cp_rank=res["cp_rank"], tp_size=tp, tp_rank=res["tp_rank"])
        good = ours.valid.astype(bool)
        data = ours.replay_data()
        layers = [layer for layer, _, _ in res["routers"]]
        stages.setdefault(res["pp_rank"], layers)
        for layer, target, mask in res["routers"]:
            ids = data[ours.moe_layers.index(layer)].numpy()
            assert target.shape == ids.shape  # the same tokens on this rank, padding included
            assert np.array_equal(target[good], ids[good])  # recorded rows: the same ids at the same positions
            if path == "engine":
                # R3's mask (every row but each last one) with ours: verl replays exactly our recorded rows and
                # routes the flagged ones (fallback) and the last tokens itself
                assert np.array_equal(mask, good)
            else:
                assert mask is None
    # pipeline stages hold megatron-core's layer split; verl picked each router's layer on either axis
    assert stages == ({0: [3, 4, 5, 6, 7]} if pp == 1 else {0: [3], 1: [4, 5, 6, 7]})


def test_verls_own_replay_mask_routes_the_fallback_tokens_itself(stored, pool):
    """missing=router through verl 0.9.1's RouterReplay: the router's top-k on fallback tokens, replay elsewhere."""
    client, _ = stored
    case, _ = _case(client, "model", "engine", 2, 2, 1)
    ours = client.megatron_batch([("verl-mc", r) for r in ORDER], convention="verl", missing="router", cp_size=2,
                                 cp_rank=1, tp_size=2, tp_rank=0)
    fallback = ours.fallback.astype(bool)
    assert fallback.sum() >= 1  # a flagged row lands on this rank
    res = next(r for r in pool.run(verl_rank_targets, case) if (r["cp_rank"], r["tp_rank"]) == (1, 0))
    layer, target, mask = res["routers"][0]
    scores = np.random.default_rng(5).random((len(target), SHAPE.num_experts), dtype=np.float32)
    ids = verl_replay_topk(target, mask, scores, SHAPE.top_k)
    own = np.argsort(-scores, axis=1)[:, : SHAPE.top_k]
    assert np.array_equal(np.sort(ids[fallback], axis=1), np.sort(own[fallback], axis=1))
    good = ours.valid.astype(bool)
    assert np.array_equal(ids[good], ours.replay_data()[ours.moe_layers.index(layer)].numpy()[good])


@pytest.mark.parametrize("tp,cp", [(2, 2), (1, 4)])
def test_verl_fp8_padding(stored, pool, tp, cp):
    """`tf_config.fp8` e4m3: each sequence padded to lcm(16, align), the last one grown to a multiple of align*128."""
    client, _ = stored
    case, _ = _case(client, "moe", "legacy", tp, cp, 1, fp8=True)
    for res in pool.run(verl_rank_targets, case):
        ours = client.megatron_batch([("verl-mc", r) for r in ORDER], convention="verl", fp8_padding=True,
                                     missing="router", cp_size=cp, cp_rank=res["cp_rank"], tp_size=tp,
                                     tp_rank=res["tp_rank"])
        align = tp * cp * 2
        assert ours.layout.total_tokens % (align * 128) == 0 and ours.layout.pad_multiple == 16
        good = ours.valid.astype(bool)
        for layer, target, _ in res["routers"]:
            ids = ours.replay_data()[ours.moe_layers.index(layer)].numpy()
            assert target.shape == ids.shape and np.array_equal(target[good], ids[good])


# ---- weight versions: verl's own layout of the dense batch puts each token's version where our slice does ----

VERSIONS = {"vm-a": 7, "vm-b": 3, "vm-c": 11, "vm-d": None}  # rows from here on by version "4" (before: "3")


@pytest.fixture(scope="module")
def versioned(shared_service):
    from replay_format.rows import RowsMeta, build_rows, encode_stream
    from replay_format.weight_versions import WeightVersions

    client = ReplayClient(shared_service.url)
    rng = np.random.default_rng(43)
    for seq, (r, (p, g)) in enumerate(SHAPES.items()):
        n, switch = p + g - 1, VERSIONS[r]
        labels = None if switch is None else WeightVersions.of_labels(["3" if i < switch else "4" for i in range(n)])
        client.ingest(encode_stream(build_rows(RowsMeta("verl-mc-v", "w", seq, SHAPE), [r] * n,
                                               np.arange(n, dtype=np.int32), routes(rng, n, SHAPE),
                                               weight_versions=labels)))
        client.finish("verl-mc-v", r, p + g)
    return client


def _codes(labels: list[str | None]) -> np.ndarray:
    return np.array([0 if v is None else int(v) for v in labels], np.int64)


@pytest.mark.parametrize("tp,cp,pp,path", [(2, 2, 1, "engine"), (1, 2, 2, "legacy")])
def test_verls_routers_see_each_tokens_version_where_the_slice_puts_it(versioned, pool, tp, cp, pp, path):
    """The dense batch's per-token versions (`dense_versions()`, as labels 3/4, 0 for none) fed through verl
    0.9.1's `set_router_replay_data` in place of ids: every router of every rank holds, for each token it
    replays, the version our own slice for that rank (`megatron_batch(convention="verl")`) names."""
    client = versioned
    seqs = [("verl-mc-v", r) for r in ORDER]
    dense = client.verl_batch(seqs, prompt_lengths=[SHAPES[r][0] for r in ORDER], prompt_width=PW, response_width=RW,
                              layer_axis="model")
    table = [*dense.weight_versions, None]
    codes = _codes([table[i] for i in dense.dense_versions().numpy().reshape(-1).tolist()]).reshape(len(ORDER), -1)
    assert set(np.unique(codes).tolist()) == {0, 3, 4}
    response_mask = np.zeros((len(ORDER), RW), np.int64)
    for b, r in enumerate(ORDER):
        response_mask[b, : SHAPES[r][1]] = 1
    case = {"tp": tp, "cp": cp, "pp": pp, "num_layers": 8, "moe_layer_freq": MOE_LAYER_FREQ,
            "num_experts": SHAPE.num_experts, "top_k": SHAPE.top_k, "path": path,
            "routes": np.broadcast_to(codes[:, :, None, None], (*codes.shape, 8, SHAPE.top_k)).copy(),
            "attention_mask": dense.attention_mask().numpy(), "response_mask": response_mask}
    for res in pool.run(verl_rank_targets, case):
        ours = client.megatron_batch(seqs, convention="verl", cp_size=cp, cp_rank=res["cp_rank"], tp_size=tp,
                                     tp_rank=res["tp_rank"])
        good, want = ours.valid.astype(bool), _codes(ours.versions())
        assert set(want[good].tolist()) <= {0, 3, 4} and good.any()
        for _, target, _ in res["routers"]:
            assert np.array_equal(target[good], np.repeat(want[good, None], SHAPE.top_k, axis=1))
