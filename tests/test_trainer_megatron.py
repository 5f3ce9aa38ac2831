"""Megatron-core RouterReplay fed by the client: the real megatron-core 0.16.1 router code on CPU.

The reference token order is built here independently of replay_service.trainer.layouts:
Megatron's hidden states are [s, b, h] and TopKRouter flattens them with
`view(-1, num_experts)`, so in BSHD the router's token i is (s, b) = divmod(i, B);
THD packs sequences back to back.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient, ReplayError
from replay_format import RunShape
from tests.support.data import QWEN3_SHAPE, batch_bytes, routes, store_requests

torch = pytest.importorskip("torch")
router_replay = pytest.importorskip("megatron.core.transformer.moe.router_replay")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
RouterReplay = router_replay.RouterReplay
RouterReplayAction = router_replay.RouterReplayAction

L, K, E = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k, QWEN3_SHAPE.num_experts
LENGTHS = {"m-a": 37, "m-b": 64, "m-c": 9, "m-d": 50}


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "mg", LENGTHS)
    return client, full


@pytest.fixture
def routers():
    RouterReplay.clear_global_router_replay_instances()
    instances = [RouterReplay() for _ in range(L)]
    yield instances
    RouterReplay.clear_global_router_replay_instances()


def _replay(instances, data, num_tokens, seed=0):
    """Run every layer's real top-k routing in REPLAY_FORWARD on random logits; (ids, probs, map, logits)."""
    RouterReplay.set_replay_data(data)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for inst in instances:
        logits = torch.randn(num_tokens, E, generator=gen)
        probs, routing_map = moe_utils.topk_routing_with_score_function(
            logits, K, use_pre_softmax=True, score_function="softmax", router_replay=inst
        )
        scores = torch.softmax(logits, dim=-1)
        gathered, ids = inst.get_replay_topk(scores, K)  # (probs, indices), as megatron returns them
        out.append((ids, gathered, probs, routing_map, scores))
    return out


def _sets_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)


def test_thd_replays_recorded_ids_for_every_real_token(stored, routers):
    client, full = stored
    order = ["m-a", "m-b", "m-c", "m-d"]
    batch = client.megatron_batch([("mg", r) for r in order], packing="thd")
    # reference: packed order, every sequence's T tokens, the last without a row
    expected = np.concatenate([np.concatenate([full[r], np.zeros((1, L, K), np.uint8)]) for r in order])
    has_row = np.concatenate([np.r_[np.ones(LENGTHS[r] - 1, bool), False] for r in order])
    assert batch.num_tokens == sum(LENGTHS.values()) and batch.layout.cu_seqlens == [0, 37, 101, 110, 160]
    assert np.array_equal(batch.valid.astype(bool), has_row)
    data = batch.replay_data()
    assert len(data) == L and all(t.dtype == torch.int64 and t.shape == (batch.num_tokens, K) for t in data)
    assert all(t.is_contiguous() for t in data)
    for layer, (ids, gathered, probs, routing_map, scores) in enumerate(_replay(routers, data, batch.num_tokens)):
        ids = ids.numpy()
        assert np.array_equal(ids[has_row], expected[has_row, layer].astype(np.int64))
        # the gathered probabilities are the scores of exactly those experts
        assert torch.equal(gathered, scores.gather(1, torch.from_numpy(ids)))
        # megatron's own routing map marks exactly the recorded experts, with non-zero probability
        assert routing_map.sum(dim=1).eq(K).all()
        want = torch.zeros(batch.num_tokens, E, dtype=torch.bool)
        want.scatter_(1, torch.from_numpy(ids), True)
        assert torch.equal(routing_map, want)
        assert (probs[routing_map] > 0).all()
    # rows without a recording: router-valid (distinct, in range, never all zero) and masked
    filler = batch.experts[~has_row]
    ordered = np.sort(filler, axis=-1)
    assert filler.size and (filler.max() < E) and (ordered[..., 1:] != ordered[..., :-1]).all()
    assert filler.reshape(len(filler), -1).any(axis=1).all()
    assert not batch.valid_tensor()[torch.from_numpy(~has_row)].any()


def test_bshd_is_sequence_first_and_a_batch_first_swap_is_caught(stored, routers):
    client, full = stored
    order = ["m-a", "m-c", "m-d"]
    batch = client.megatron_batch([("mg", r) for r in order], packing="bshd")
    b, s = len(order), batch.layout.seq_length
    assert s == max(LENGTHS[r] for r in order) and batch.num_tokens == b * s
    dense = np.zeros((b, s, L, K), np.int64)
    real = np.zeros((b, s), bool)
    for i, r in enumerate(order):
        dense[i, : LENGTHS[r] - 1] = full[r]
        real[i, : LENGTHS[r] - 1] = True
    # the model sees [s, b]: router token i is (s, b) = divmod(i, B)
    seq_first, seq_first_real = dense.transpose(1, 0, 2, 3).reshape(b * s, L, K), real.T.reshape(-1)
    batch_first = dense.reshape(b * s, L, K)
    replayed = np.stack([r[0].numpy() for r in _replay(routers, batch.replay_data(), batch.num_tokens)], axis=1)
    assert np.array_equal(batch.valid.astype(bool), seq_first_real)
    assert _sets_equal(replayed[seq_first_real], seq_first[seq_first_real]).all()
    # the same check against a batch-first reading fails: the swap replays other tokens' experts
    assert not _sets_equal(replayed[seq_first_real], batch_first[seq_first_real]).all()
    # and a batch-first layout fed to the router is caught against the model's token order
    RouterReplay.clear_global_indices()
    swapped = [torch.from_numpy(np.ascontiguousarray(batch_first[:, layer])) for layer in range(L)]
    replayed_swapped = np.stack([r[0].numpy() for r in _replay(routers, swapped, b * s)], axis=1)
    wrong = ~_sets_equal(replayed_swapped[seq_first_real], seq_first[seq_first_real]).all(axis=1)
    assert wrong.mean() > 0.5


def test_pipeline_stage_gets_its_layers_only(stored):
    client, full = stored
    batch = client.megatron_batch([("mg", "m-c")], moe_ordinals=list(range(24, 48)))
    assert batch.experts.shape == (9, 24, K) and batch.moe_ordinals == list(range(24, 48))
    assert np.array_equal(batch.experts[:8], full["m-c"][:, 24:])
    stage = client.megatron_batch([("mg", "m-c")], model_layer_range=(0, 12))
    assert len(stage.replay_data()) == 12 and np.array_equal(stage.experts[:8], full["m-c"][:, :12])


def test_a_stage_slice_names_its_moe_ordinals_and_model_layers(shared_service):
    """A run whose MoE layers are not 0..L-1: ordinals index `moe_layers`, the range selects model layers."""
    client = ReplayClient(shared_service.url)
    shape = RunShape(num_moe_layers=4, top_k=2, num_experts=8, moe_layers=(3, 5, 7, 9))
    full = store_requests(client, "mg-stage", {"st-a": 6}, shape=shape)
    by_range = client.megatron_batch([("mg-stage", "st-a")], model_layer_range=(5, 9))
    assert by_range.moe_ordinals == [1, 2] and by_range.moe_layers == [5, 7] and by_range.meta.num_moe_layers == 2
    assert np.array_equal(by_range.experts[:5], full["st-a"][:, 1:3])
    by_ordinal = client.megatron_batch([("mg-stage", "st-a")], moe_ordinals=[2, 3])
    assert by_ordinal.moe_layers == [7, 9] and np.array_equal(by_ordinal.experts[:5], full["st-a"][:, 2:])


def test_pre_rename_stage_fields_are_refused_not_ignored(stored):
    """`layers` / `model_layers` were renamed; ignoring them would silently serve every MoE layer."""
    client, _ = stored
    for old in ({"layers": [0]}, {"model_layers": [0, 12]}):
        doc = {"sequences": [{"run": "mg", "request": "m-c"}], **old}
        response = client.http.post("/v1/trainer/megatron", json=doc)
        assert response.status_code == 422 and next(iter(old)) in response.json()["detail"], response.text


def test_start_serves_rows_from_a_position_on(stored):
    client, full = stored
    batch = client.megatron_batch([{"run": "mg", "request": "m-b", "start": 40}])
    assert batch.num_tokens == 64 - 40 and batch.position[0] == 40
    assert np.array_equal(batch.experts[:-1], full["m-b"][40:]) and batch.valid[-1] == 0


def test_flagged_rows_become_masked_filler_or_a_strict_refusal(shared_service):
    client = ReplayClient(shared_service.url)
    full = store_requests(client, "mg-flag", {"f-a": 30}, flagged={"f-a": [7]})
    batch = client.megatron_batch([("mg-flag", "f-a")], missing="filler")
    assert batch.valid[7] == 0 and batch.experts[7].any() and int(batch.valid.sum()) == 28
    assert np.array_equal(batch.experts[8:29], full["f-a"][8:])
    with pytest.raises(ReplayError) as err:
        client.megatron_batch([("mg-flag", "f-a")], missing="strict")
    assert err.value.status == 409 and "position 7" in err.value.detail


def test_bad_layout_requests_are_named(stored):
    client, _ = stored
    cases = [
        ({"sequences": [{"run": "mg", "request": "nope"}]}, 404, "nope"),
        ({"sequences": [{"run": "mg", "request": "m-a"}], "cp_size": 2, "cp_rank": 2}, 422, "cp_rank"),
        ({"sequences": [{"run": "mg", "request": "m-a", "num_tokens": 20}]}, 422, "as long as the input or one short"),
        ({"sequences": [{"run": "mg", "request": "m-a"}], "packing": "bshd", "seq_length": 10}, 422, "seq_length"),
        ({"sequences": [{"run": "mg", "request": "m-a"}], "moe_ordinals": [48]}, 422, "MoE ordinals"),
        ({"sequences": [{"run": "mg", "request": "m-a"}], "packing": "thd", "pad_multiple": 3, "tp_size": 2}, 422,
         "split"),
    ]
    for doc, status, words in cases:
        response = client.http.post("/v1/trainer/megatron", json=doc)
        assert response.status_code == status, (doc, response.text)
        assert words in response.json()["detail"], response.json()


def test_record_mode_routing_posted_to_compare_gives_the_planted_mismatch(stored, routers):
    """The trainer workflow: the router in RECORD mode, its choices posted to /compare."""
    client, full = stored
    order = ["m-a", "m-b"]
    batch = client.megatron_batch([("mg", r) for r in order])
    real = batch.valid.astype(bool)
    gen = torch.Generator().manual_seed(3)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    planted = np.flatnonzero(real)[::10]  # layer 3 of every 10th real token routes elsewhere
    for layer, inst in enumerate(routers):
        logits = torch.randn(batch.num_tokens, E, generator=gen)
        boost = torch.zeros(batch.num_tokens, E)
        boost.scatter_(1, torch.from_numpy(batch.experts[:, layer].astype(np.int64)), 10.0)
        if layer == 3:
            for t in planted:
                other = np.setdiff1d(np.arange(E), batch.experts[t, layer])[:K]
                boost[t] = 0
                boost[t, torch.from_numpy(other)] = 10.0
        moe_utils.topk_routing_with_score_function(logits + boost, K, score_function="softmax", router_replay=inst)
    recorded = batch.recorded_rows(RouterReplay.get_recorded_data(), [("mg", r) for r in order])
    assert len(recorded.request_ids) == len(recorded.positions) == len(recorded.experts) == int(real.sum())
    result = client.compare("mg", *recorded, label="record-mode")
    n = int(real.sum())
    # each sequence's last token has no row: not posted, so a healthy step misses none
    assert result["tokens"] == n and result["missing_rows"] == 0
    assert result["router_mismatch"] == pytest.approx(len(planted) / (n * L), abs=1e-15)
    assert result["token_mismatch"] == pytest.approx(len(planted) / n, abs=1e-15)
    assert result["jaccard"] == pytest.approx(1 - len(planted) / (n * L), abs=1e-12)  # disjoint sets: Jaccard 0
    assert result["worst_layers"] == [3]


# ---- the missing-row policy and the model-layer axis ------------------------------------------------------


@pytest.fixture(scope="module")
def holed(shared_service):
    """A request with a flagged row (7, ZERO) and a row never sent (12, GAP) in the middle, and a clean one."""
    client = ReplayClient(shared_service.url)
    rng = np.random.default_rng(31)
    rows = {"h-a": routes(rng, 29), "h-b": routes(rng, 20)}
    rows["h-a"][7] = 0
    keep = np.r_[0:12, 13:29]
    ids = ["h-a"] * len(keep) + ["h-b"] * 20
    positions = np.concatenate([keep, np.arange(20)]).astype(np.int32)
    client.ingest(batch_bytes("mg-hole", "w", 0, ids, positions, np.concatenate([rows["h-a"][keep], rows["h-b"]])))
    client.finish("mg-hole", "h-a", 30)
    client.finish("mg-hole", "h-b", 21)
    return client, rows


def test_the_default_refuses_a_flagged_or_missing_row_of_a_real_token(holed):
    client, _ = holed
    with pytest.raises(ReplayError) as err:
        client.megatron_batch([("mg-hole", "h-a")])
    assert err.value.status == 409 and "2 tokens" in err.value.detail and "missing=router" in err.value.detail
    assert [(r["position"], r["flags"]) for r in err.value.body["bad_rows"]] == [(7, ["ZERO"]), (12, ["GAP"])]
    # the last token has no row by design: a clean request is served under the default
    assert client.megatron_batch([("mg-hole", "h-b")]).missing == "strict"


@pytest.mark.parametrize("cp,tp", [(1, 1), (2, 2)])
def test_missing_router_leaves_exactly_the_broken_real_tokens_to_the_router(holed, cp, tp):
    client, rows = holed
    order = ["h-b", "h-a"]
    fallback_at = []
    for c in range(cp):
        for t in range(tp):
            batch = client.megatron_batch([("mg-hole", r) for r in order], missing="router", cp_size=cp, cp_rank=c,
                                          tp_size=tp, tp_rank=t)
            assert batch.missing == "router"
            fb = batch.fallback.astype(bool)
            assert not (fb & batch.valid.astype(bool)).any()
            fallback_at += [(order[s], p) for s, p in zip(batch.sequence[fb], batch.position[fb])]
            # padding and last tokens stay filler: router-valid, masked, never left to the router
            last = np.array([p == {"h-a": 29, "h-b": 20}[order[s]] if s >= 0 else False
                             for s, p in zip(batch.sequence, batch.position)])
            assert not fb[(batch.sequence < 0) | last].any()
            data = batch.replay_data()
            assert len(data) == L and all(t.dtype == torch.int64 for t in data)
            for layer, ids in enumerate(data):
                ids = ids.numpy()
                assert (ids[fb] == -1).all() and (ids[~fb] >= 0).all()  # whole rows of -1: NeMo-RL's sentinel
                good = batch.valid.astype(bool)
                want = np.stack([rows[order[s]][p, layer] for s, p in zip(batch.sequence[good], batch.position[good])])
                assert np.array_equal(ids[good], want)
            assert torch.equal(batch.replay_mask(), torch.from_numpy(~fb))
    assert sorted(fallback_at) == [("h-a", 7), ("h-a", 12)]


def test_strict_is_an_alias_and_a_contradiction_is_named(holed):
    client, _ = holed
    filler = client.megatron_batch([("mg-hole", "h-a")], strict=False)
    assert filler.missing == "filler" and not filler.fallback.any() and filler.valid[[7, 12]].sum() == 0
    doc = {"sequences": [{"run": "mg-hole", "request": "h-a"}], "strict": True, "missing": "router"}
    response = client.http.post("/v1/trainer/megatron", json=doc)
    assert response.status_code == 422 and "contradicts missing=router" in response.json()["detail"]
    doc = {"sequences": [{"run": "mg-hole", "request": "h-a"}], "strict": False}  # what a client before 1.1 sends
    assert client.http.post("/v1/trainer/megatron", json=doc).status_code == 200


def test_the_model_axis_holds_every_model_layer_dense_ones_zero(shared_service):
    client = ReplayClient(shared_service.url)
    shape = RunShape(num_moe_layers=4, top_k=2, num_experts=8, moe_layers=(3, 5, 7, 9), num_hidden_layers=10)
    full = store_requests(client, "mg-axis", {"ax-a": 12, "ax-b": 7}, shape=shape)
    seqs = [("mg-axis", "ax-a"), ("mg-axis", "ax-b")]
    moe = client.megatron_batch(seqs)
    model = client.megatron_batch(seqs, layer_axis="model")
    assert model.layer_axis == "model" and model.layers == list(range(10)) and model.experts.shape == (19, 10, 2)
    assert model.moe_layers == [3, 5, 7, 9] and model.meta.num_hidden_layers == 10
    real = moe.valid.astype(bool)
    assert np.array_equal(model.experts[real], shape.to_model_axis(np.concatenate([full["ax-a"], full["ax-b"]])))
    assert not model.experts[:, [0, 1, 2, 4, 6, 8]].any()  # dense layers zero, padding and last tokens too
    assert np.array_equal(model.experts[:, [3, 5, 7, 9]], moe.experts)  # MoE layers: the same ids, filler included
    assert all(torch.equal(a, b) for a, b in zip(model.replay_data(), moe.replay_data(), strict=True))
    stage = client.megatron_batch(seqs, layer_axis="model", model_layer_range=(4, 8))
    assert stage.layers == [4, 5, 6, 7] and stage.moe_layers == [5, 7] and stage.moe_ordinals == [1, 2]
    assert np.array_equal(stage.experts, model.experts[:, 4:8])
    response = client.http.post("/v1/trainer/megatron", json={"sequences": [{"run": "mg-axis", "request": "ax-a"}],
                                                              "layer_axis": "model", "moe_ordinals": [1]})
    assert response.status_code == 422 and "model_layer_range" in response.json()["detail"]


def test_the_model_axis_ends_at_the_runs_num_hidden_layers(shared_service):
    """Dense layers after the last MoE layer exist on the model axis too: the run's count, not max + 1."""
    client = ReplayClient(shared_service.url)
    shape = RunShape(num_moe_layers=2, top_k=2, num_experts=8, moe_layers=(1, 3), num_hidden_layers=6)
    full = store_requests(client, "mg-tail", {"tl-a": 5}, shape=shape)
    batch = client.megatron_batch([("mg-tail", "tl-a")], layer_axis="model")
    assert batch.experts.shape == (5, 6, 2) and batch.meta.num_hidden_layers == 6
    assert np.array_equal(batch.experts[:4], shape.to_model_axis(full["tl-a"]))


# ---- weight versions: which weights computed each replayed row ----------------------------------------------


def test_each_router_token_replays_the_rows_of_the_version_the_slice_names(stored, routers):
    """Weights updated mid-generation (positions 0..20 by version 7, 21..39 by 8; version 7's rows pick experts
    0..63, version 8's 64..127): through megatron-core's own top-k with RouterReplay, on every CP x TP rank, each
    token the slice says is version 8 routes to experts >= 64 on every layer, each version 7 token below 64.
    `versions="single"` refuses the sequence on every rank, naming it and where the weights changed."""
    from replay_format.rows import RowsMeta, build_rows, encode_stream
    from replay_format.weight_versions import WeightVersions

    client, _ = stored
    half = RunShape(num_moe_layers=L, top_k=K, num_experts=E // 2)
    rows = routes(np.random.default_rng(31), 39, half).astype(np.uint8)
    rows[21:] += E // 2
    labels = ["7"] * 21 + ["8"] * 18
    batch = build_rows(RowsMeta("mg-versions", "w", 0, QWEN3_SHAPE), ["wv-a"] * 39, np.arange(39, dtype=np.int32),
                       rows, weight_versions=WeightVersions.of_labels(labels))
    client.ingest(encode_stream(batch))
    client.finish("mg-versions", "wv-a", 40)
    seen = {}
    for cp_rank in range(2):
        for tp_rank in range(2):
            RouterReplay.clear_global_indices()
            sliced = client.megatron_batch([("mg-versions", "wv-a"), ("mg", "m-c")], cp_size=2, cp_rank=cp_rank,
                                           tp_size=2, tp_rank=tp_rank)
            versions = sliced.versions()
            ids = np.stack([r[0].numpy() for r in _replay(routers, sliced.replay_data(), sliced.num_tokens)], axis=1)
            for i, (s, p, v) in enumerate(zip(sliced.sequence.tolist(), sliced.position.tolist(), versions)):
                if s == 0 and sliced.valid[i]:
                    assert v == labels[p] and ((ids[i] >= E // 2).all() if v == "8" else (ids[i] < E // 2).all())
                    seen[p] = v
                else:
                    assert v is None  # padding, last tokens, and rows stored before versions (run "mg")
            assert sliced.staleness().rows == {label: versions.count(label) for label in ("7", "8")
                                               if label in versions}
            with pytest.raises(ReplayError, match=r"sequence 0 \(mg-versions/wv-a: 7 at \[0, 21\), 8 at \[21, 39\)\)"):
                client.megatron_batch([("mg-versions", "wv-a"), ("mg", "m-c")], cp_size=2, cp_rank=cp_rank,
                                      tp_size=2, tp_rank=tp_rank, versions="single")
    assert seen == dict(enumerate(labels))
