"""Trainer layouts: which recorded row each router token of a rank gets (pure numpy, in the service).

The service plans one rank's tokens here and gathers only their rows (`reads.py`), so
the bytes on the wire are the rank's slice (replay_format/trainer_slice.md). Nothing
here touches HTTP, the store or torch.

A *sequence* of a micro-batch is one request's tokens `[start, start + n)`; the
store holds rows for positions `0 .. T-2` of a request of `T` tokens (the last
token never ran through the model), so the last token of a whole request has no
row. A *token plan* lists, for every token the router of one rank sees, in the order
it sees them, which sequence and offset it is (`-1` for padding), and describes the
layout (`SliceLayout`) the answer carries.

Sources relied on (megatron-core 0.16.1 unless said otherwise):
- Router token order: `TopKRouter.forward` flattens the hidden states with
  `logits.view(-1, num_moe_experts)` (transformer/moe/router.py); Megatron's
  hidden states are `[s, b, h]` (sequence first), so in BSHD the router's token
  `i` is `(s, b) = divmod(i, b_size)`, *not* `(b, s)`. Reading a batch-first
  array there silently replays another token's experts (miles #3146). THD packs
  sequences as `[t, 1, h]`: token order is packed order.
- Context parallel: `megatron.core.utils.get_batch_on_this_cp_rank` views the
  sequence dim as `2 * cp` chunks and keeps chunks `cp_rank` and
  `2 * cp - 1 - cp_rank` (load balancing under causal masking). For THD,
  `get_thd_batch_on_this_cp_rank` uses TE's `thd_get_partitioned_indices`,
  which does the same *per packed sequence* on the padded lengths
  (`cu_seqlens_padded`).
- Sequence parallel: `scatter_to_sequence_parallel_region` ->
  `_split_along_first_dim` (tensor_parallel/mappings.py): the first dim must be
  divisible by the TP size and rank `r` keeps the contiguous `r`-th part.
- Padding of THD sequences: verl's `preprocess_packed_seqs` pads every
  sequence to a multiple of `tp * cp * 2` when `cp > 1`, else of `tp`; that is
  our default `pad_multiple`.
- verl: `AgentLoopWorker._agent_loop_postprocess` places a route of a
  left-padded prompt + right-padded response at columns
  `prompt_width - len(prompt) ...` of `[batch, prompt_width + response_width,
  L, K]`; the route is as long as the input or one short (vLLM/SGLang give
  `T - 1` rows); `set_router_replay_data` then packs by the attention mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from replay_format.trainer_slice import LayoutKind, Packing, SliceLayout
from replay_service.errors import InvalidInput


class LayoutError(InvalidInput):
    """A layout request that cannot be laid out (the message names why)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def filler_rows(token_index: np.ndarray, num_moe_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """Router-valid ids for tokens without a recorded row: `(n, L, K)` int64.

    Distinct within every layer's top-k, never all zero, and spread over the
    experts by the token's global index (so a batch of padding does not pile on
    experts 0..K-1 and overflow their capacity). Deterministic: every rank
    computes the same row for the same token. Trainers mask these tokens out of
    the loss with the accompanying mask.
    """
    token_index = np.asarray(token_index, np.int64)
    k = np.arange(top_k, dtype=np.int64)
    layer = np.arange(num_moe_layers, dtype=np.int64)
    base = token_index[:, None, None] * top_k + layer[None, :, None] * 7 + k[None, None, :]
    if num_experts > top_k:
        # ids 1 .. E-1: K distinct values (K <= E-1), never 0, so never an all-zero row
        return 1 + base % (num_experts - 1)
    return np.broadcast_to(k, (len(token_index), num_moe_layers, top_k)).copy()


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a micro-batch: tokens `[start, start + num_tokens)`; `rows` of them have a recorded row."""

    start: int
    num_tokens: int
    rows: int  # recorded rows available from `start` on, clipped to num_tokens


def sequence_spec(expected_rows: int, start: int, num_tokens: int | None, what: str) -> SequenceSpec:
    """Check the length rule and say how many of the sequence's tokens have rows.

    The route (rows from `start` on) must be as long as the input or one short,
    as verl requires: a longer route means the trainer's tokens are not the
    rollout's; a route two or more short means rows are missing (not padding).
    """
    available = expected_rows - start
    if available < 0:
        raise LayoutError(f"{what}: start={start} is past its {expected_rows} rows")
    if num_tokens is None:
        num_tokens = available + 1
    if num_tokens < 1:
        raise LayoutError(f"{what}: num_tokens must be >= 1, got {num_tokens}")
    if available not in (num_tokens - 1, num_tokens):
        raise LayoutError(
            f"{what}: the route has {available} rows from position {start} but the input has {num_tokens} tokens; "
            f"a route must be as long as the input or one short ({num_tokens - 1} or {num_tokens} rows)"
        )
    return SequenceSpec(start, num_tokens, min(available, num_tokens))


@dataclass
class TokenPlan:
    """Router tokens of one rank, in the order its router sees them, and the layout they follow."""

    sequence: np.ndarray  # int32 (m,): index into the micro-batch's sequences, -1 for padding
    offset: np.ndarray  # int32 (m,): token offset inside the sequence (position - start), -1 for padding
    global_index: np.ndarray  # int64 (m,): index of the token in the whole (unsliced) layout
    layout: SliceLayout  # what the answer tells the trainer (tokens, cu_seqlens, ...)

    @property
    def num_tokens(self) -> int:
        """Router tokens of this rank."""
        return len(self.sequence)


def _cp_chunks(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Indices `[0, length)` kept by CP rank `cp_rank`: chunks r and 2cp-1-r of 2cp."""
    if cp_size == 1:
        return np.arange(length, dtype=np.int64)
    if length % (2 * cp_size):
        raise LayoutError(f"a length of {length} does not split into 2*cp = {2 * cp_size} chunks")
    chunk = length // (2 * cp_size)
    first = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64)
    second = np.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, dtype=np.int64)
    return np.concatenate([first, second])


def _sp_split(n: int, tp_size: int, tp_rank: int) -> slice:
    if n % tp_size:
        raise LayoutError(f"{n} tokens on this CP rank do not split evenly over sequence parallel size {tp_size}")
    part = n // tp_size
    return slice(tp_rank * part, (tp_rank + 1) * part)


def _check_ranks(cp_size: int, cp_rank: int, tp_size: int, tp_rank: int) -> None:
    if cp_size < 1 or tp_size < 1:
        raise LayoutError(f"cp_size and tp_size must be >= 1, got {cp_size} and {tp_size}")
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"cp_rank {cp_rank} is not in 0..{cp_size - 1}")
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} is not in 0..{tp_size - 1}")


def default_pad_multiple(cp_size: int, tp_size: int) -> int:
    """verl's `preprocess_packed_seqs` rule: tp * cp * 2 with context parallel, else tp."""
    return tp_size * cp_size * 2 if cp_size > 1 else tp_size


def megatron_plan(
    lengths: list[int],
    packing: Packing | str = Packing.THD,
    pad_multiple: int | None = None,
    seq_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> TokenPlan:
    """The router tokens of rank (cp_rank, tp_rank) for sequences of `lengths` tokens.

    `Packing.THD`: sequences packed back to back, each padded to a multiple of
    `pad_multiple`; CP splits every padded sequence into 2cp chunks; SP splits
    what the CP rank holds contiguously over TP.
    `Packing.BSHD`: `[b, s]` right-padded to `seq_length`, seen by the router
    sequence-first (`[s, b]` flattened); CP splits `s`; SP splits the local
    `s * b` tokens contiguously (i.e. along `s`).
    `tp_size` here is the sequence-parallel size (1 when SP is off).
    """
    _check_ranks(cp_size, cp_rank, tp_size, tp_rank)
    if not lengths:
        raise LayoutError("a micro-batch needs at least one sequence")
    try:
        packing = Packing(packing)
    except ValueError:
        raise LayoutError(f"packing {packing!r} is not one of {', '.join(p.value for p in Packing)}") from None
    lengths_arr = np.asarray(lengths, np.int64)
    multiple = pad_multiple or default_pad_multiple(cp_size, tp_size)
    describe = partial(SliceLayout, LayoutKind.MEGATRON, packing=packing, cp_size=cp_size, cp_rank=cp_rank,
                       tp_size=tp_size, tp_rank=tp_rank)
    if packing is Packing.THD:
        padded = -(-lengths_arr // multiple) * multiple
        cu = np.concatenate([[0], np.cumsum(lengths_arr)])
        cu_padded = np.concatenate([[0], np.cumsum(padded)])
        pieces = []
        for i, p in enumerate(padded.tolist()):
            pieces.append(cu_padded[i] + _cp_chunks(p, cp_size, cp_rank))
        local = np.concatenate(pieces)
        local = local[_sp_split(len(local), tp_size, tp_rank)]
        seq = np.searchsorted(cu_padded, local, side="right") - 1
        offset = local - cu_padded[seq]
        real = offset < lengths_arr[seq]
        total = int(cu_padded[-1])
        return TokenPlan(
            sequence=np.where(real, seq, -1).astype(np.int32),
            offset=np.where(real, offset, -1).astype(np.int32),
            global_index=local,
            layout=describe(tokens=len(local), total_tokens=total, seq_length=total, sequences=len(lengths),
                            cu_seqlens=cu.tolist(), cu_seqlens_padded=cu_padded.tolist()),
        )
    batch = len(lengths_arr)
    s_len = seq_length if seq_length is not None else _round_up(int(lengths_arr.max()), multiple)
    if int(lengths_arr.max()) > s_len:
        raise LayoutError(f"a sequence of {int(lengths_arr.max())} tokens does not fit seq_length={s_len}")
    local_s = _cp_chunks(s_len, cp_size, cp_rank)
    # sequence-first: router token i of this CP rank is (local_s[i // b], i % b)
    s_idx = np.repeat(local_s, batch)
    b_idx = np.tile(np.arange(batch, dtype=np.int64), len(local_s))
    if (len(local_s)) % tp_size:
        raise LayoutError(
            f"{len(local_s)} sequence positions on this CP rank do not split over sequence parallel size {tp_size}"
        )
    keep = _sp_split(len(s_idx), tp_size, tp_rank)
    s_idx, b_idx = s_idx[keep], b_idx[keep]
    real = s_idx < lengths_arr[b_idx]
    return TokenPlan(
        sequence=np.where(real, b_idx, -1).astype(np.int32),
        offset=np.where(real, s_idx, -1).astype(np.int32),
        global_index=s_idx * batch + b_idx,
        layout=describe(tokens=len(s_idx), total_tokens=s_len * batch, seq_length=s_len, sequences=batch),
    )


def verl_plan(prompt_lengths: list[int], total_lengths: list[int], prompt_width: int, response_width: int) -> TokenPlan:
    """Dense `[batch, prompt_width + response_width]`: left-padded prompt, right-padded response.

    Sequence `b` has `prompt_lengths[b]` prompt tokens and `total_lengths[b]`
    tokens in all; its token at offset `j` sits at column
    `prompt_width - prompt_lengths[b] + j`.
    """
    width = prompt_width + response_width
    batch = len(total_lengths)
    if batch == 0:
        raise LayoutError("a micro-batch needs at least one sequence")
    if len(prompt_lengths) != batch:
        raise LayoutError(f"prompt_lengths has {len(prompt_lengths)} entries for {batch} sequences")
    p = np.asarray(prompt_lengths, np.int64)
    t = np.asarray(total_lengths, np.int64)
    if (p > prompt_width).any():
        b = int(np.flatnonzero(p > prompt_width)[0])
        raise LayoutError(f"sequence {b}: a prompt of {int(p[b])} tokens does not fit prompt_width={prompt_width}")
    if ((t - p) > response_width).any() or (t < p).any():
        b = int(np.flatnonzero(((t - p) > response_width) | (t < p))[0])
        raise LayoutError(
            f"sequence {b}: {int(t[b])} tokens with a prompt of {int(p[b])} do not fit response_width={response_width}"
        )
    col = np.arange(width, dtype=np.int64)
    offset = col[None, :] - (prompt_width - p)[:, None]
    real = (offset >= 0) & (offset < t[:, None])
    seq = np.broadcast_to(np.arange(batch, dtype=np.int64)[:, None], (batch, width))
    return TokenPlan(
        sequence=np.where(real, seq, -1).astype(np.int32).reshape(-1),
        offset=np.where(real, offset, -1).astype(np.int32).reshape(-1),
        global_index=np.arange(batch * width, dtype=np.int64),
        layout=SliceLayout(LayoutKind.VERL, tokens=batch * width, total_tokens=batch * width, seq_length=width,
                           sequences=batch, prompt_width=prompt_width, response_width=response_width,
                           prompt_lengths=[int(x) for x in prompt_lengths]),
    )


def _contiguous_runs(dst: np.ndarray, src: np.ndarray, max_runs: int = 64) -> list[tuple[int, int]] | None:
    """[a, b) ranges where both dst and src step by one; None when there are too many to pay off."""
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    if len(breaks) >= max_runs:
        return None
    edges = [0, *breaks.tolist(), len(dst)]
    return list(zip(edges[:-1], edges[1:]))


# read_rows(i, lo, hi) -> (experts (hi-lo, L*K), ok (hi-lo,) bool): sequence i's offsets [lo, hi)
ReadRows = Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]


def gather_rows(
    plan: TokenPlan,
    specs: list[SequenceSpec],
    read_rows: ReadRows,
    num_moe_layers: int,
    top_k: int,
    num_experts: int,
    moe_ordinals: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Fill `(m, len(moe_ordinals) * K)` ids and an `(m,)` uint8 validity mask for a plan.

    `read_rows(i, lo, hi)` returns `(experts (hi-lo, L*K), ok (hi-lo,) bool)` for
    sequence `i`'s offsets `[lo, hi)` (ok: a clean recorded row), all the run's
    `num_moe_layers`; only `moe_ordinals` are kept. Tokens without a clean row get
    `filler_rows` and mask 0.
    """
    m = plan.num_tokens
    held = len(moe_ordinals)
    out = np.empty((m, held, top_k), dtype)
    valid = np.zeros(m, np.uint8)
    order = np.argsort(plan.sequence, kind="stable")
    seq_sorted = plan.sequence[order]
    bounds = np.searchsorted(seq_sorted, np.arange(-1, len(specs) + 1))
    for i, spec in enumerate(specs):
        idx = order[bounds[i + 1] : bounds[i + 2]]
        if not idx.size:
            continue
        offs = plan.offset[idx]
        has_row = offs < spec.rows
        idx_rows, offs_rows = idx[has_row], offs[has_row]
        if idx_rows.size:
            lo, hi = int(offs_rows.min()), int(offs_rows.max()) + 1
            experts, ok = read_rows(i, lo, hi)
            experts = experts.reshape(hi - lo, num_moe_layers, top_k)
            local = offs_rows - lo
            good = ok[local]
            if held != num_moe_layers:
                experts = experts[:, moe_ordinals]
            runs = _contiguous_runs(idx_rows, local) if good.all() else None
            if runs is not None:  # THD: one run per sequence (two under CP): plain memcpy
                for a, b in runs:
                    out[idx_rows[a] : idx_rows[a] + b - a] = experts[local[a] : local[a] + b - a]
            else:
                out[idx_rows[good]] = experts[local[good]]
            valid[idx_rows[good]] = 1
    missing = np.flatnonzero(valid == 0)
    if missing.size:
        fill = filler_rows(plan.global_index[missing], num_moe_layers, top_k, num_experts)[:, moe_ordinals]
        out[missing] = fill.astype(dtype)
    return out.reshape(m, held * top_k), valid
