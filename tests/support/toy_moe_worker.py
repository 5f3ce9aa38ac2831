"""A vLLM worker (`--worker-cls`) whose model is a small torch MoE: vLLM 0.34's engine end to end on a CPU.

vLLM 0.34 ships a GPU wheel only; its CPU platform starts, but its CPU worker needs the CPU build's kernels. This
worker takes that worker's place and nothing else: vLLM's engine core, scheduler (prefix caching, chunked prefill),
executors and both sides of its aux-output connector run as shipped. Per step it reads vLLM's `SchedulerOutput`,
runs `ToyMoE` on the scheduled tokens, samples greedily, and hands vLLM's own `AuxOutputWorkerConnector` the step
as vLLM 0.34's V2 model runner does (`vllm/v1/worker/gpu/model_runner.py`: `begin_step` at 1852 before the forward,
`prepare_output` at 2308 after it; `vllm/v1/worker/gpu/async_utils.py` 170 and 211: `enqueue_cpu_copy`, then
`process_output` into `ModelRunnerOutput.aux_output_connector_output`). The routers are bound by vLLM's own
`bind_routed_experts_capturer` (a module with `layer_id` and `capture_fn` is a `RoutedExpertsCaptureSource`), so
vLLM's `RoutedExpertsCapturer` records the routes the engine returns in `CompletionOutput.routed_experts`.

The model reads its shape from the checkpoint's config (`num_hidden_layers`, `num_experts`,
`num_experts_per_tok`, `mlp_only_layers` (dense), `hidden_size`, `vocab_size`) and draws its weights from a
fixed seed; it has no attention (a token's hidden state is a function of its id and position), which is all the
routes and the greedy samples need. KV blocks are bookkeeping only: one full-attention layer's spec, so the
scheduler allocates, caches and hits blocks as for a real model. No speculative decoding, no pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

SEED = 1234
KV_LAYER = "model.layers.0.self_attn.attn"  # the one layer whose KV blocks the scheduler allocates


class DenseLayer(torch.nn.Module):
    """A dense MLP layer (a Qwen3-MoE `mlp_only_layers` layer): no router, nothing captured."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's residual update."""
        return h + torch.tanh(self.mlp(h))


class MoELayer(torch.nn.Module):
    """A router (top-k of a linear gate) over small experts; vLLM's capture source (`layer_id`, `capture_fn`)."""

    def __init__(self, layer_id: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None  # set by vLLM's bind_routed_experts_capturer
        self.top_k = top_k
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(num_experts, hidden, hidden) / hidden**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Route each token to its top-k experts (ids handed to `capture_fn` as vLLM's routers do), mix them."""
        weights, topk_ids = torch.topk(torch.softmax(self.gate(h), dim=-1), self.top_k, dim=-1)
        if self.capture_fn is not None:  # as vLLM's BaseRouter: the logical ids, before any EPLB mapping
            self.capture_fn(topk_ids)
        out = torch.einsum("th,tkhd->tkd", h, self.experts[topk_ids])
        return h + torch.tanh((weights.unsqueeze(-1) * out).sum(dim=1))


class ToyMoE(torch.nn.Module):
    """Token and position embeddings, the config's layers (dense or MoE), logits tied to the token embedding."""

    def __init__(self, hf_config, max_positions: int) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        hidden, dense = int(hf_config.hidden_size), set(getattr(hf_config, "mlp_only_layers", None) or ())
        self.embed = torch.nn.Embedding(int(hf_config.vocab_size), hidden)
        self.position = torch.nn.Embedding(max_positions, hidden)
        self.layers = torch.nn.ModuleList([
            DenseLayer(hidden) if i in dense else
            MoELayer(i, hidden, int(hf_config.num_experts), int(hf_config.num_experts_per_tok))
            for i in range(int(hf_config.num_hidden_layers))])

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits `[tokens, vocab]`, one row per input token."""
        h = self.embed(token_ids) + self.position(positions)
        for layer in self.layers:
            h = layer(h)
        return h @ self.embed.weight.T


@dataclass
class StepBatch:
    """What vLLM's `AuxOutputWorkerConnector.prepare_output` reads of a runner's input batch (vLLM 0.34
    `distributed/aux_output_connector/worker.py`, `prepare_output`: V2's `InputBatch` fields of the same names)."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray  # [num_reqs + 1] row offsets of each request in the step
    num_computed_tokens_np: np.ndarray  # [num_reqs] each request's first position in the step


class ToyRunner:
    """The worker's model runner: each request's tokens, the model, vLLM's worker-side aux-output connector."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model = ToyMoE(vllm_config.model_config.hf_config, vllm_config.model_config.max_model_len + 1).eval()
        self.tokens: dict[str, list[int]] = {}  # request id -> its token ids so far (prompt, then samples)
        self.aux_output_connector: Any = None  # vLLM's AuxOutputWorkerConnector, when its output is on

    def initialize_output_storage(self, kv_cache_config) -> None:
        """With vLLM's routed-experts output on: vLLM's connector binds the routers and sizes its block store."""
        if not self.vllm_config.aux_output_config.enabled:
            return
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

        self.aux_output_connector = get_aux_output_connector(self.model, self.vllm_config)
        self.aux_output_connector.initialize_output_storage(kv_cache_config)

    def _update_requests(self, scheduler_output) -> dict[str, int]:
        """Apply the step's request changes; each scheduled request's first position this step."""
        for rid in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            self.tokens.pop(rid, None)
        computed = {}
        for new in scheduler_output.scheduled_new_reqs:  # a resumed request comes back whole, as a new one
            self.tokens[new.req_id] = list(new.prefill_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        return computed

    @torch.inference_mode()
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """One scheduled step: forward the scheduled tokens, sample where a prefill is done, commit the routes."""
        computed = self._update_requests(scheduler_output)
        if self.aux_output_connector is not None:
            self.aux_output_connector.begin_step(scheduler_output.aux_output_connector_metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(scheduler_output.num_scheduled_tokens)
        starts = [computed[rid] for rid in req_ids]
        counts = [scheduler_output.num_scheduled_tokens[rid] for rid in req_ids]
        token_ids = [t for rid, s, n in zip(req_ids, starts, counts) for t in self.tokens[rid][s : s + n]]
        positions = [p for s, n in zip(starts, counts) for p in range(s, s + n)]
        with set_forward_context(None, self.vllm_config, num_tokens=len(token_ids)):
            logits = self.model(torch.tensor(token_ids), torch.tensor(positions))
        last_rows = np.cumsum(counts) - 1
        sampled: list[list[int]] = []
        for rid, s, n, row in zip(req_ids, starts, counts, last_rows.tolist()):
            done = s + n >= len(self.tokens[rid])  # a prefill chunk short of the prompt's end samples nothing
            sampled.append([int(logits[row].argmax())] if done else [])
            self.tokens[rid] += sampled[-1]
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        if self.aux_output_connector is not None:
            batch = StepBatch(req_ids, np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
                              np.asarray(starts, np.int32))
            pending = self.aux_output_connector.prepare_output(batch)
            if pending is not None:
                pending.enqueue_cpu_copy(np.array([len(s) for s in sampled], np.int32),
                                         np.zeros(len(req_ids), np.int32))  # no drafts: nothing rejected
                output.aux_output_connector_output = pending.process_output()
        return output

    def close(self) -> None:
        """Close vLLM's connector (its block store's thread)."""
        if self.aux_output_connector is not None:
            self.aux_output_connector.close()


class ToyMoEWorker(WorkerBase):
    """vLLM's worker interface over `ToyRunner` (`worker_cls="tests.support.toy_moe_worker.ToyMoEWorker"`)."""

    def init_device(self) -> None:
        """vLLM's process groups on gloo (the aux-output connector asks its TP group which rank publishes)."""
        self.device = torch.device("cpu")
        init_distributed_environment(self.parallel_config.world_size, self.rank, self.distributed_init_method,
                                     self.local_rank, backend="gloo")
        ensure_model_parallel_initialized(self.parallel_config.tensor_parallel_size,
                                          self.parallel_config.pipeline_parallel_size)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Build the model (seeded weights; the checkpoint holds a config only)."""
        self.model_runner = ToyRunner(self.vllm_config)

    def get_model(self) -> torch.nn.Module:
        """The model (what `collective_rpc` callers read as `worker.model_runner.model`)."""
        return self.model_runner.model

    def get_kv_cache_spec(self) -> dict:
        """One full-attention layer of tiny pages: the scheduler's blocks, prefix cache included, are real."""
        return {KV_LAYER: FullAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=1, head_size=8,
                                            dtype=torch.float32)}

    def determine_available_memory(self) -> int:
        """What the user set (VLLM_CPU_KVCACHE_SPACE), else 64 MiB; `num_gpu_blocks_override` caps the blocks."""
        return int(self.cache_config.kv_cache_memory_bytes or 64 * 2**20)

    def initialize_from_config(self, kv_cache_config) -> None:
        """The KV layout is resolved: start vLLM's aux-output data plane (as V2's `initialize_kv_cache`)."""
        self.model_runner.initialize_output_storage(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Nothing to compile."""
        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Generation only."""
        return ("generate",)

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """One step (`ToyRunner.execute_model`); the output is whole, so vLLM never calls `sample_tokens`."""
        return self.model_runner.execute_model(scheduler_output)

    def take_draft_token_ids(self) -> None:
        """No speculative decoding."""
        return None

    def shutdown(self) -> None:
        """Close the runner's connector."""
        if isinstance(self.model_runner, ToyRunner):
            self.model_runner.close()
