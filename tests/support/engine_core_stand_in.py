"""vLLM's real engine core around a stand-in worker, for `engine_core_driver.py` (runs in a vLLM 0.33/0.34 environment).

What is vLLM's own: the `EngineCoreProc` methods (`step_with_batch_queue` / `step`, `add_request`, `abort_requests`,
`pause_generation`, `set_weight_version`, `resume_scheduler`), the `Scheduler` (or `AsyncScheduler`, as the config
picks) with its `KVCacheManager`, `BlockPool`, `AuxOutputSchedulerConnector` and KV connector, all built from a real
`VllmConfig` of a Qwen3-MoE config directory. What stands in: the executor (`StandInWorker`), which plays the model:
its routes are a pure function of the token prefix, the position, the layer and the weights' label (`toy_rows`), like
a real router; it hands the plugin's worker hooks (`capture.vllm.worker.step_hooks.StepHooks`) the rows it routed, or
answers with the aux-output rows vLLM's worker connector would (`AuxWorkerPlay`), and samples tokens by the same rule.

The engine core is made with `object.__new__` and given the attributes `EngineCore.__init__` would set
(vllm/v1/engine/core.py, 0.34: lines 138-262; vLLM's own tests build it so: "Class-level defaults so tests can build
an EngineCore with object.__new__", core.py:132), without a model executor to start or KV cache to profile.
"""

from __future__ import annotations

import hashlib
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

LAYERS, DENSE, TOP_K, EXPERTS = 3, (0,), 2, 8  # model layers; layer 0 is dense (vLLM's rows hold it as zeros)
MOE_LAYERS = tuple(i for i in range(LAYERS) if i not in DENSE)
BLOCK = 4  # KV block size (tokens)
STOP = 7  # the stop token of requests that stop on a token (SamplingParams.stop_token_ids)


def _digest(tokens: list[int]) -> list[bytes]:
    """A hash of each prefix `tokens[:p + 1]`: what the model state at position p depends on."""
    out, h = [], b""
    for t in tokens:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=16).digest()
        out.append(h)
    return out


def toy_rows(tokens: list[int], start: int, end: int, weights: str) -> np.ndarray:
    """The stand-in model's routes of positions `[start, end)`: `[n, LAYERS, TOP_K]` uint8, vLLM's `routed_experts`
    layout (every model layer, dense ones zero), distinct ids per row, a function of the prefix and the weights."""
    prefix = _digest(tokens[:end])
    rows = np.zeros((end - start, LAYERS, TOP_K), np.uint8)
    for i, p in enumerate(range(start, end)):
        for layer in MOE_LAYERS:
            seed = hashlib.blake2b(prefix[p] + weights.encode() + bytes([layer]), digest_size=8).digest()
            rows[i, layer] = np.random.default_rng(int.from_bytes(seed, "little")).permutation(EXPERTS)[:TOP_K]
    return rows


def toy_token(tokens: list[int], weights: str) -> int:
    """The token the stand-in model samples after `tokens` (never STOP: a stop is scripted, `StandInWorker.stops`)."""
    seed = hashlib.blake2b(_digest(tokens)[-1] + weights.encode(), digest_size=8).digest()
    return 16 + int.from_bytes(seed, "little") % 480


def save_model_dir(path: str) -> str:
    """A Qwen3-MoE config directory vLLM's `ModelConfig` reads (no weights: no model is loaded)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=list(DENSE),
                   max_position_embeddings=512, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    return path


def engine_config(model_dir: str, *, aux: bool, num_blocks: int, kv_transfer: dict | None = None):
    """A real `VllmConfig`: prefix caching on, chunked prefill, vLLM's own scheduling defaults (0.34: async scheduling),
    `enable_return_routed_experts` when `aux`, a KV connector when `kv_transfer` (`KVTransferConfig` fields, as
    vLLM's P/D scheduler tests: vllm-project/vllm/tests/v1/kv_connector/unit/utils.py, `create_vllm_config`)."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.aux_output import AuxOutputConfig

    model = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256, seed=0)
    config = VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
        aux_output_config=AuxOutputConfig(enable_return_routed_experts=aux))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def build_scheduler(vllm_config, num_blocks: int):
    """The scheduler class the config picks, on a KV cache of `num_blocks` blocks of one full-attention group
    (vllm-project/vllm/tests/v1/core/utils.py `create_scheduler`,
    vllm-project/vllm/tests/v1/kv_connector/unit/utils.py `create_scheduler`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=vllm_config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(
        vllm_config), block_size=BLOCK, log_stats=False)


def build_engine_core(vllm_config, scheduler, executor):
    """vLLM's `EngineCoreProc` with the attributes its `__init__` sets for these methods (module docstring)."""
    from collections import deque

    from vllm.v1.engine.core import EngineCoreProc

    core: Any = object.__new__(EngineCoreProc)
    core.vllm_config, core.log_stats, core.scheduler, core.model_executor = vllm_config, False, scheduler, executor
    core._weight_version = "default"  # core.py:161
    core.mm_receiver_cache = None
    core.structured_output_manager = scheduler.structured_output_manager
    core.batch_queue_size = vllm_config.max_concurrent_batches  # core.py:222-228
    core.batch_queue = deque(maxlen=core.batch_queue_size) if core.batch_queue_size > 1 else None
    core.step_fn = core.step if core.batch_queue is None else core.step_with_batch_queue  # core.py:254
    core.async_scheduling = vllm_config.scheduler_config.async_scheduling
    core.is_mm_encoder_only = bool(getattr(vllm_config, "is_mm_encoder_only", False))
    core.is_pooling_model = False
    core.check_for_draft_tokens = False  # no speculative decoding
    core.aborts_queue = queue.Queue()
    core.engines_running, core._idle_state_callbacks, core.reject_new_requests = False, [], False  # EngineCoreProc
    return core


@dataclass
class AuxWorkerPlay:
    """What vLLM's worker connector (`aux_output_connector/worker.py`, `AuxOutputWorkerConnector`) answers per step,
    on the scheduler's real metadata: each request's rows from its emit cursor (`metadata.requests`, set when the
    worker first sees it) to the end of the step, once it samples; state dropped on `finished_requests`, and the
    store too on a new generation (a prefix-cache reset). Rows before the step (a prefix-cache hit) come from the
    store, as vLLM's worker reads them: the row last computed for that prefix (vLLM keys its store by block hash,
    which chains the prefix), whatever weights computed it."""

    generation: int = 0
    emit: dict[str, int] = field(default_factory=dict)  # request -> first position not yet emitted
    store: dict[bytes, tuple[np.ndarray, str]] = field(default_factory=dict)  # prefix hash -> (row, weights)
    emitted: dict[str, list[tuple[np.ndarray, str]]] = field(default_factory=dict)  # request -> rows it was sent

    def begin(self, metadata) -> None:
        if metadata is None:
            return
        if metadata.generation > self.generation:
            self.emit.clear()
            self.store.clear()
            self.generation = metadata.generation
        for rid, emit_start in metadata.requests.items():
            self.emit.setdefault(rid, int(emit_start))
        for rid in metadata.finished_requests:
            self.emit.pop(rid, None)

    def computed(self, tokens: list[int], start: int, rows: np.ndarray, weights: str) -> None:
        prefix = _digest(tokens[: start + len(rows)])
        for i, row in enumerate(rows):
            self.store[prefix[start + i]] = (row, weights)

    def output(self, rid: str, tokens: list[int], end: int):
        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

        start = self.emit[rid]
        self.emit[rid] = end
        prefix = _digest(tokens[:end])
        rows = [self.store[prefix[p]] for p in range(start, end)]
        self.emitted.setdefault(rid, []).extend(rows)
        return AuxRequestOutput(start, np.stack([row for row, _ in rows]))


class StandInWorker:
    """The executor: plays the model for vLLM's engine core (module docstring).

    `hooks`: the plugin's worker hooks (its own capture route); `aux`: answer aux-output rows (vLLM's R3 route).
    `weights` is the label of the weights it runs (a weight update changes it while the engine is paused).
    """

    def __init__(self, scheduler, hooks=None, aux: bool = False) -> None:
        self.scheduler, self.hooks = scheduler, hooks
        self.vllm_config = scheduler.vllm_config  # the engine core reads its executor's (0.34: extensible KV cache)
        self.aux = AuxWorkerPlay() if aux else None
        self.weights = "default"
        self.stops: dict[str, int] = {}  # request -> the output index at which it samples STOP
        self.sampled: dict[tuple[str, int], int] = {}  # (request, position) -> token sampled there, not yet settled
        # request -> (first position, rows, weights) of each step the model computed for it, in order
        self.computed: dict[str, list[tuple[int, np.ndarray, str]]] = {}
        self.notes: list = []  # the SchedulerNotes of each executed step (None: none attached)
        self.started: list[tuple[str, int]] = []  # (request, first position) of each start and resume
        self.sending: set[str] = set()  # prefill-only requests whose KV the decode engine has yet to read
        self.loaded: list[int] = []  # prompt lengths of the requests a KV connector loaded KV for
        self._pending: tuple | None = None
        self.routers = [_Runner(layer) for layer in MOE_LAYERS]  # each MoE layer's runner, as its router passes it

    def tokens(self, rid: str, end: int) -> list[int]:
        """The request's token ids up to `end`: the scheduler's (prompt and settled outputs), then those this worker
        sampled in steps the engine has not processed yet (async scheduling)."""
        known = list(self.scheduler.requests[rid].all_token_ids)
        for p in range(len(known), end):
            known.append(self.sampled[(rid, p)])
        return known[:end]

    def execute_model(self, scheduler_output, non_block: bool = False):
        """The forward of one step: route every scheduled token, hand the rows to the capture. Returns the step's
        `ModelRunnerOutput` when nothing is scheduled, else None (vLLM then calls `sample_tokens`)."""
        from capture.vllm.scheduler_notes import notes_of

        self.notes.append(notes_of(scheduler_output))
        self._kv_connector(scheduler_output.kv_connector_metadata)
        starts = self._starts(scheduler_output)
        if self.aux is not None:
            self.aux.begin(scheduler_output.aux_output_connector_metadata)
        batch = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            start = starts[rid]
            tokens = self.tokens(rid, start + n)
            rows = toy_rows(tokens, start, start + n, self.weights)
            self.computed.setdefault(rid, []).append((start, rows, self.weights))
            if self.aux is not None:
                self.aux.computed(tokens, start, rows, self.weights)
            batch.append((rid, start, tokens, rows))
        if self.hooks is not None:
            self._capture(scheduler_output, batch)
        self._pending = (scheduler_output, batch)
        output = None if batch else self.sample_tokens(None)
        return _done(output) if non_block else output

    def _kv_connector(self, metadata) -> None:
        """ExampleConnector's worker side: store each request the metadata says to (the folder its scheduler side
        looks for, `_generate_foldername_debug`; the KV itself is not needed here), note the loads."""
        for req in getattr(metadata, "requests", None) or []:
            if not hasattr(req, "is_store"):
                continue
            if req.is_store:
                self.scheduler.connector._generate_foldername_debug(req.token_ids, req.mm_hashes, create_folder=True)
            else:
                self.loaded.append(len(req.token_ids))

    def _starts(self, scheduler_output) -> dict[str, int]:
        """Each scheduled request's first position this step, as the runner reads it from the scheduler output."""
        starts = {new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            starts[rid] = int(computed)
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())  # 0.34 sends a resumed request as a new one
        self.started += [(rid, starts[rid]) for rid in [new.req_id for new in scheduler_output.scheduled_new_reqs]
                         + sorted(resumed)]
        return starts

    def _capture(self, scheduler_output, batch) -> None:
        """What the plugin's V2 runner hooks do with one step (`capture/vllm/worker/runner_v2.py`)."""
        hooks = self.hooks
        hooks.on_execute(scheduler_output)
        if not batch:
            return
        ids = [rid for rid, _, _, _ in batch]
        counts = [len(rows) for _, _, _, rows in batch]
        positions = np.concatenate([np.arange(s, s + len(r)) for _, s, _, r in batch])
        input_ids = np.concatenate([np.asarray(t[s:s + len(r)]) for _, s, t, r in batch])
        runner = _Runner(-1, ids, np.concatenate(([0], np.cumsum(counts))).astype(np.int32))
        hooks.open_step(runner, torch.from_numpy(input_ids.astype(np.int32)), torch.from_numpy(positions))
        rows = np.concatenate([r for _, _, _, r in batch])
        for layer, router in zip(MOE_LAYERS, self.routers):  # each router's top-k, as its capture_fn sees it
            hooks.on_topk(router, torch.from_numpy(rows[:, layer].astype(np.int32)))
        hooks.close_forward()

    def sample_tokens(self, grammar_output, non_block: bool = False):
        """Sample after the forward: a request whose step reaches its last token samples one (STOP where scripted),
        a prefill chunk short of it none; the `ModelRunnerOutput`, with the aux-output rows when `aux`."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        assert self._pending is not None
        scheduler_output, batch = self._pending
        self._pending = None
        req_ids, sampled, aux_rows = [], [], {}
        for rid, start, tokens, rows in batch:
            end = start + len(rows)
            request = self.scheduler.requests[rid]
            token: list[int] = []
            if end >= len(request.all_token_ids):
                index = end - request.num_prompt_tokens  # the output token this sample is
                token = [STOP if self.stops.get(rid) == index else toy_token(tokens, self.weights)]
                self.sampled[(rid, end)] = token[0]
                if self.aux is not None:
                    aux_rows[rid] = self.aux.output(rid, tokens, end)
            req_ids.append(rid)
            sampled.append(token)
        if self.hooks is not None and batch:
            self.hooks.on_sampled(None, lambda output, ids: None)
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # 0.33 (gone in 0.34)
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        if self.aux is not None:
            kwargs["aux_output_connector_output"] = aux_rows
        done = self.sending & set(scheduler_output.finished_req_ids)  # the decode engine has read their KV
        if done:
            self.sending -= done
            kwargs["kv_connector_output"] = KVConnectorOutput(finished_sending=done)
        output = ModelRunnerOutput(**kwargs)
        return _done(output) if non_block else output

    # What else the engine core calls on its executor.
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
        return [None]

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def take_draft_token_ids(self):
        return None

    def shutdown(self) -> None:
        pass


class _Runner:
    """A model runner as the plugin's V2 hooks read it (`input_batch`, `query_start_loc`), or one MoE layer's runner
    (its `layer_id`) as the router callback passes it."""

    def __init__(self, layer_id: int, req_ids: list[str] | None = None, qsl: np.ndarray | None = None) -> None:
        self.layer_id = layer_id
        ids = req_ids or []
        self.input_batch = _Ns(num_reqs=len(ids), req_ids=ids)
        self.query_start_loc = _Ns(np=qsl)


class _Ns:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
