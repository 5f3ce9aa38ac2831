"""Each consumer's own rule for the tensor its router replays, to compare the client's answers with.

Where the consumer's code imports on CPU it runs for real (verl 0.9.1 in `verl_rank_targets`, on
gloo ranks with megatron-core's parallel state; megatron-core's layer helpers for a pipeline
stage's layers). slime, miles and NeMo-RL do not install here (no usable PyPI release), so their
rules are restated below, each line citing the upstream file it restates; the restatements are
written as the upstream code is (pad, slice, concatenate, pad, split), not as our service plans
tokens, so a shared mistake is unlikely.

Upstream read for this (the search tool's snapshots):
- slime 624b824a (2026-08-21): slime/backends/megatron_utils/cp_utils.py, slime/backends/megatron_utils/data.py,
  slime/backends/megatron_utils/actor.py
- miles 31f1ca96 (2026-08-21): miles/backends/training_utils/replay_data.py, cp_utils.py,
  miles/backends/megatron_utils/replay_utils.py, miles/utils/replay_base.py
- NeMo-RL (NVIDIA-NeMo/RL) 7ea279ab (2026-08-22): nemo_rl/models/generation/vllm/utils.py,
  nemo_rl/models/megatron/router_replay.py, nemo_rl/experience/rollouts.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np

IDENTITY_STRIDE = 1 << 20  # token identity: sequence * stride + position


# ---- a token's identity through a layout --------------------------------------------------------


def identity_routes(lengths: Sequence[int]) -> list[np.ndarray]:
    """For each sequence of `lengths` tokens, `(T-1, 1, 1)` int64 rows holding `seq * stride + position`.

    Run through a consumer's layout rule in place of expert ids, they say which token each
    router position holds (padding: the rule's pad value).
    """
    return [(i * IDENTITY_STRIDE + np.arange(n - 1, dtype=np.int64)).reshape(-1, 1, 1) for i, n in enumerate(lengths)]


def batch_identity(batch) -> np.ndarray:
    """The same identity for a trainer slice's rows (-1 for padding, the last token's too)."""
    has_row = (batch.sequence >= 0) & (batch.valid.astype(bool) | batch.fallback.astype(bool))
    return np.where(has_row, batch.sequence.astype(np.int64) * IDENTITY_STRIDE + batch.position, -1)


# ---- slime ----------------------------------------------------------------------------------------


def _slime_pad(num_experts: int) -> Callable[[np.ndarray, int], np.ndarray]:
    """slime cp_utils.py `_pad_routed_experts` (lines 239-251): pad rows `arange(pad*L*K) % num_experts`."""

    def pad(rows: np.ndarray, n: int) -> np.ndarray:
        if n == 0:
            return rows
        _, layers, topk = rows.shape
        fill = (np.arange(n * layers * topk, dtype=rows.dtype) % num_experts).reshape(n, layers, topk)
        return np.concatenate([rows, fill])

    return pad


def _value_pad(value: int) -> Callable[[np.ndarray, int], np.ndarray]:
    def pad(rows: np.ndarray, n: int) -> np.ndarray:
        return np.concatenate([rows, np.full((n, *rows.shape[1:]), value, rows.dtype)])

    return pad


def _slice_with_cp(rows: np.ndarray, pad, cp_size: int, cp_rank: int) -> np.ndarray:
    """slime cp_utils.py `slice_with_cp` (lines 179-209), miles training_utils/cp_utils.py (256-...) for THD."""
    if cp_size == 1:
        return rows
    token_len = len(rows)
    chunk_size = (token_len + 2 * cp_size - 1) // (2 * cp_size)
    rows = pad(rows, 2 * cp_size * chunk_size - token_len)
    start_1, end_1 = chunk_size * cp_rank, chunk_size * (cp_rank + 1)
    start_2, end_2 = chunk_size * (2 * cp_size - cp_rank - 1), chunk_size * (2 * cp_size - cp_rank)
    return np.concatenate([rows[start_1:end_1], rows[start_2:end_2]])


def slime_rank_rows(routes: Sequence[np.ndarray], *, tp_size: int, tp_rank: int, cp_size: int, cp_rank: int,
                    data_pad_size_multiplier: int = 128, allgather_cp: bool = False, sequence_parallel: bool = True,
                    num_experts: int | None = None, pad_value: int | None = None) -> np.ndarray:
    """slime's `prepare_routed_experts_for_routing_replay` (cp_utils.py lines 254-297), restated.

    `routes`: one `(T-1, layers, K)` array per sequence (asserted T-1 at line 266). Pads with
    slime's pattern (`num_experts`) or, for identities, with `pad_value`.
    """
    pad = _slime_pad(num_experts) if pad_value is None else _value_pad(pad_value)
    padded = [pad(r, 1) for r in routes]  # line 268: one row for the last token
    pad_size = tp_size * data_pad_size_multiplier  # line 269
    if allgather_cp:  # lines 271-278
        stream = np.concatenate(padded)
        global_pad_size = cp_size * pad_size
        stream = pad(stream, (global_pad_size - len(stream) % global_pad_size) % global_pad_size)
        stream = np.split(stream, cp_size)[cp_rank]  # torch.chunk on a length divisible by cp
    else:  # lines 280-286
        stream = np.concatenate([_slice_with_cp(r, pad, cp_size, cp_rank) for r in padded])
        stream = pad(stream, (pad_size - len(stream) % pad_size) % pad_size)
    if sequence_parallel:  # lines 288-295
        seqlen = len(stream)
        assert seqlen % tp_size == 0
        stream = stream[seqlen // tp_size * tp_rank : seqlen // tp_size * (tp_rank + 1)]
    return stream


def miles_rank_rows(routes: Sequence[np.ndarray], *, tp_size: int, tp_rank: int, cp_size: int, cp_rank: int,
                    data_pad_size_multiplier: int = 128, allgather_cp: bool = False,
                    sequence_parallel: bool = True) -> np.ndarray:
    """miles's `fill_replay_data` for THD (replay_data.py lines 63-127), restated: pads with -1 (line 65-71),
    which `replay_base.py` (lines 102-109) replays as experts `arange(K) % E`."""
    pad = _value_pad(-1)
    padded = [pad(r, 1) for r in routes]  # line 83
    pad_size = tp_size * data_pad_size_multiplier  # line 101
    if allgather_cp and cp_size > 1:  # lines 102-108
        stream = np.concatenate(padded)
        global_pad_size = cp_size * pad_size
        stream = pad(stream, (global_pad_size - len(stream) % global_pad_size) % global_pad_size)
        stream = np.split(stream, cp_size)[cp_rank]
    else:  # lines 109-120
        stream = np.concatenate([_slice_with_cp(r, pad, cp_size, cp_rank) for r in padded])
        stream = pad(stream, (pad_size - len(stream) % pad_size) % pad_size)
    if sequence_parallel:  # lines 123-127
        seqlen = len(stream)
        assert seqlen % tp_size == 0
        stream = stream[seqlen // tp_size * tp_rank : seqlen // tp_size * (tp_rank + 1)]
    return stream


def stage_model_layers(num_layers: int, moe_layer_freq: list[int], pp_size: int, pp_rank: int) -> list[int]:
    """The model layers whose routers a pipeline stage replays, as slime (actor.py lines 333-350) and miles
    (megatron_utils/replay_utils.py lines 5-24) find them: megatron-core's own layer offset and count for
    the stage (real code), dense layers skipped by `moe_layer_freq`; both then read `routes[:, layer_id]`."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp_size, pipeline_dtype=torch.float32,
                               num_moe_experts=8, moe_router_topk=2, moe_layer_freq=list(moe_layer_freq))
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return [layer for layer in range(offset, offset + count) if config.moe_layer_freq[layer]]


# ---- NeMo-RL --------------------------------------------------------------------------------------

NEMO_RL_MISSING_ROUTE = -1  # nemo_rl/models/generation/interfaces.py: ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL


def nemo_rl_route(routed: np.ndarray, valid_length: int, padded_length: int) -> np.ndarray:
    """NeMo-RL's per-sample route (nemo_rl/models/generation/vllm/utils.py, lines ~187-235), restated.

    `routed` is what vLLM returned, `(rows, layers, K)`; the sample needs `valid_length - 1` rows
    (`expected_routes`). Every row starts as the default route `arange(K)` (padding and the last
    token), the returned rows are copied in, and rows vLLM did not return are all -1: the missing-route
    sentinel, which `router_replay.py` (lines 325-358) routes with Megatron's own top-k.
    """
    expected_routes = valid_length - 1
    topk = routed.shape[2]
    full = np.broadcast_to(np.arange(topk, dtype=np.int64), (padded_length, routed.shape[1], topk)).copy()
    copy = min(expected_routes, routed.shape[0])
    full[:copy] = routed[:copy]
    full[copy:expected_routes] = NEMO_RL_MISSING_ROUTE
    return full


def nemo_rl_fallback_rows(replay: np.ndarray) -> np.ndarray:
    """Which rows NeMo-RL's patched `get_replay_topk` routes itself: all -1 on every k (router_replay.py
    line 325); a row with only some -1 is refused (`_validate_replay_tensor`, lines 210-219)."""
    missing = (replay == NEMO_RL_MISSING_ROUTE).all(axis=-1)
    partial = (replay < 0).any(axis=-1) & ~missing
    assert not partial.any(), "NeMo-RL refuses rows with only some ids -1"
    return missing


# ---- verl 0.9.1, real code on gloo ranks ---------------------------------------------------------------


def _verl_config(num_layers: int, moe_layer_freq: list[int], num_experts: int, top_k: int, tp: int, cp: int,
                 pp: int, router: dict | None = None):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {"add_bias_linear": False, **(router or {})}
    return TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                             tensor_model_parallel_size=tp, context_parallel_size=cp,
                             pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                             sequence_parallel=tp > 1, num_moe_experts=num_experts, moe_router_topk=top_k,
                             moe_layer_freq=list(moe_layer_freq), **kw)


def verl_rank_targets(case: dict) -> dict:
    """On every gloo rank: verl 0.9.1's `set_router_replay_data` on megatron-core's parallel state (real code).

    `case`: tp/cp/pp sizes, the model's `num_layers` and `moe_layer_freq`, `num_experts`, `top_k`, `fp8`, optionally
    `router` (more TransformerConfig router settings), and
    verl's inputs: `routes` (the dense `[batch, seq, layers, K]` our verl answer gives) with its
    `attention_mask` and `response_mask`, `path` ("legacy": the padded batch through
    `preprocess_packed_seqs`; "engine": verl's nested engine path, `left_right_2_no_padding` then
    `align_r3_router_replay_data` and `build_r3_replay_mask`), and optionally `replay_mask`
    (`[batch, seq]` bool, ANDed into R3's, e.g. `TrainerBatch.dense_replay_mask()`).
    Returns this rank's place and, per local MoE router in order, its model layer, the int64
    target ids it would replay and its replay mask (None without one).
    """
    import torch
    import verl.utils.megatron.router_replay_utils as rru
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron.router_replay_patch import RouterReplay

    rru.device_name = "cpu"  # verl resolves its platform at import; this machine has no accelerator
    tp, cp, pp = case["tp"], case["cp"], case["pp"]
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  context_parallel_size=cp)
    try:
        config = _verl_config(case["num_layers"], case["moe_layer_freq"], case["num_experts"], case["top_k"], tp, cp,
                              pp, case.get("router"))
        if case.get("fp8"):  # verl reads only this field (use_fp8_padding); TE's FP8 itself is not needed here
            config.fp8 = "e4m3"
        stage = rru.get_current_rank_layer_info(config)
        local_moe = [layer for layer in range(stage["start"], stage["end"]) if rru.is_moe_layer(config, layer)]
        RouterReplay.router_instances.clear()
        routers = [RouterReplay() for _ in local_moe]  # what the patched TopKRouter.__init__ makes, in layer order
        routes = torch.from_numpy(np.ascontiguousarray(case["routes"])).to(torch.int16)
        attention_mask = torch.from_numpy(case["attention_mask"])
        if case["path"] == "legacy":
            rru.set_router_replay_data(routes, attention_mask, config)
        else:
            from tensordict import TensorDict
            from verl.workers.utils.padding import left_right_2_no_padding

            b, s = attention_mask.shape
            data = TensorDict({"input_ids": torch.ones(b, s, dtype=torch.int64), "attention_mask": attention_mask,
                               "response_mask": torch.from_numpy(case["response_mask"]),
                               "position_ids": torch.arange(s).expand(b, s).contiguous(), "routed_experts": routes},
                              batch_size=[b])
            data = left_right_2_no_padding(data)
            nested = rru.align_r3_router_replay_data(data["routed_experts"], data["input_ids"])
            replay_mask = rru.build_r3_replay_mask(data["input_ids"], data["response_mask"])
            if case.get("replay_mask") is not None:  # ours, in the nested order (unpad_input: row-major)
                ours = torch.from_numpy(case["replay_mask"])[attention_mask.bool()]
                replay_mask = torch.nested.nested_tensor_from_jagged(replay_mask.values() & ours,
                                                                     offsets=replay_mask.offsets())
            rru.set_router_replay_data(nested, None, config, replay_mask=replay_mask)
        return {
            "tp_rank": mpu.get_tensor_model_parallel_rank(), "cp_rank": mpu.get_context_parallel_rank(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "routers": [(layer, r.target_topk_idx.numpy().copy(),
                         None if r.target_replay_mask is None else r.target_replay_mask.numpy().copy())
                        for layer, r in zip(local_moe, routers)],
        }
    finally:
        RouterReplay.router_instances.clear()
        mpu.destroy_model_parallel()


def verl_replay_topk(target: np.ndarray, replay_mask: np.ndarray | None, scores: np.ndarray, top_k: int) -> np.ndarray:
    """verl 0.9.1's `RouterReplay.get_replay_topk` in REPLAY_FORWARD on `scores` (real code): the ids it routes."""
    import torch
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    replay = RouterReplay()
    try:
        replay.set_target_indices(torch.from_numpy(target),
                                  None if replay_mask is None else torch.from_numpy(replay_mask))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _, ids = replay.get_replay_topk(torch.from_numpy(scores), top_k,
                                        default_compute_topk=lambda s, k, **_: torch.topk(s, k=k, dim=1))
        return ids.numpy()
    finally:
        RouterReplay.router_instances.remove(replay)


# ---- megatron-core models built on CPU ------------------------------------------------------------------


@contextmanager
def built_rank(pp: int, rank: int, vpp: int | None = None, **overrides):
    """This process as pipeline rank `rank`: `(config, the GPTModel chunks megatron-core builds there)` (local
    spec, CPU, a fake process group for the other ranks: megatron-core only asks it for ranks and sizes while
    building). `overrides` go to `TransformerConfig` (routing replay on, 16 experts top-4 unless given)."""
    import warnings

    import pytest
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=8,
              num_moe_experts=16, moe_router_topk=4, moe_enable_routing_replay=True,
              moe_router_load_balancing_type="none", use_cpu_initialization=True, add_bias_linear=False,
              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=vpp,
                                                 create_gloo_process_groups=False)
        chunks = []
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            warnings.simplefilter("ignore")
            # ties the embedding across stages with an all-reduce on CUDA; nothing of the routers
            mp.setattr(LanguageModule, "setup_embeddings_and_output_layer", lambda self: None)
            # TopKRouter puts its expert-bias buffers on `torch.cuda.current_device()`
            # (megatron/core/transformer/moe/router.py): the CPU here
            mp.setattr(torch.cuda, "current_device", lambda: "cpu")
            for vp in range(vpp or 1):
                stage = vp if vpp else None
                spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=stage)
                mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=stage)
                chunks.append(GPTModel(config, spec, vocab_size=32, max_sequence_length=16,
                                       pre_process=rank == 0 and vp == 0,
                                       post_process=rank == pp - 1 and vp == (vpp or 1) - 1,
                                       share_embeddings_and_output_weights=False,
                                       mtp_block_spec=mtp, vp_stage=stage))
        yield config, chunks
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def verl_case(client, sequences, prompt_lengths: Sequence[int], response_lengths: Sequence[int], *, num_layers: int,
              moe_layer_freq: list[int], num_experts: int, top_k: int, axis: str, path: str = "engine", tp: int = 1,
              cp: int = 1, pp: int = 1, fp8: bool = False, widths: tuple[int, int] | None = None,
              router: dict | None = None) -> tuple[dict, object]:
    """`verl_rank_targets`' case for `sequences` ((run, request) pairs of `prompt_lengths` + `response_lengths`
    tokens): the client's `verl_batch` on `axis` ("model" / "moe"), with verl's masks; and that batch. `widths`:
    the batch's (prompt, response) widths, default the longest of each; `router`: the model's other router settings."""
    pw, rw = widths or (max(prompt_lengths), max(response_lengths))
    dense = client.verl_batch(list(sequences), prompt_lengths=list(prompt_lengths), prompt_width=pw, response_width=rw,
                              layer_axis=axis, missing="router")
    response_mask = np.zeros((len(sequences), rw), np.int64)
    for b, n in enumerate(response_lengths):
        response_mask[b, :n] = 1
    case = {"tp": tp, "cp": cp, "pp": pp, "num_layers": num_layers, "moe_layer_freq": list(moe_layer_freq),
            "fp8": fp8, "num_experts": num_experts, "top_k": top_k, "path": path, "router": router,
            "routes": dense.dense().numpy(), "attention_mask": dense.attention_mask().numpy(),
            "response_mask": response_mask,
            "replay_mask": dense.dense_replay_mask().numpy() if path == "engine" else None}
    return case, dense
