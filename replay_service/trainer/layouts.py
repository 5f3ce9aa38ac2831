"""Trainer layouts: which recorded row each router token of a rank gets (pure numpy, in the service).

The service plans one rank's tokens here and gathers only their rows (`gather.py`), so the bytes on the wire are the
rank's slice (replay_format/trainer_slice.md); nothing here touches HTTP, the store or torch. A *sequence* is one
request's tokens `[start, start + n)` (`sequence_spec`; the last token of a request has no row). A `TokenPlan` lists,
for every token one rank's router sees, in its order, the sequence and offset (`-1`: padding) and the `SliceLayout`
the answer carries: `megatron_plan` (megatron-core's BSHD/THD order, CP and SP splits, the padding of
`conventions.py`) or `verl_plan` (verl's left/right-padded batches). `LayoutError`: what cannot be laid out.

Design: docs/design/trainer_layouts.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replay_format.trainer_query import MegatronQuery
from replay_format.trainer_slice import CpSplit, LayoutKind, Packing, SliceLayout, TotalPad
from replay_service.errors import InvalidInput, TooLarge
from replay_service.trainer.conventions import ThdPadding


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

    The route (rows from `start` on) must be as long as the input or one short:
    a longer route means the trainer's tokens are not the rollout's; a route two
    or more short means rows are missing (not padding). Our rule; the trainers
    differ: slime and miles assert exactly one short (`experts.shape[0] ==
    tokens.shape[0] - 1`), verl 0.9.1's `align_r3_router_replay_data` takes
    either, and verl's agent loop truncates or zero-fills to the input's length.
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


def _zigzag(starts: np.ndarray, lengths: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """The indices CP rank `cp_rank` keeps of every sequence (`lengths`, each at `starts[i]` of the stream), one after
    another: chunks r and 2cp-1-r of each one's 2cp."""
    if cp_size == 1:
        return index_runs(starts, lengths)
    uneven = np.flatnonzero(lengths % (2 * cp_size))
    if len(uneven):
        raise LayoutError(f"a length of {int(lengths[uneven[0]])} does not split into 2*cp = {2 * cp_size} chunks")
    chunk = lengths // (2 * cp_size)
    firsts = np.stack([starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk], axis=1)
    return index_runs(firsts.ravel(), np.repeat(chunk, 2))


def index_runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Every index of the runs `[starts[j], starts[j] + counts[j])`, one run after another (int64)."""
    starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _cp_part(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Indices `[0, length)` kept by CP rank `cp_rank` under a contiguous split: the rank's `1/cp` part."""
    if length % cp_size:
        raise LayoutError(f"{length} tokens do not split into cp = {cp_size} contiguous parts")
    part = length // cp_size
    return np.arange(cp_rank * part, (cp_rank + 1) * part, dtype=np.int64)


def _sp_split(n: int, tp_size: int, tp_rank: int) -> slice:
    if n % tp_size:
        raise LayoutError(f"{n} tokens on this CP rank do not split evenly over sequence parallel size {tp_size}")
    part = n // tp_size
    return slice(tp_rank * part, (tp_rank + 1) * part)


def check_rank(query: MegatronQuery) -> None:
    """LayoutError when the query's rank is not one of its CP and TP groups'."""
    if query.cp_size < 1 or query.tp_size < 1:
        raise LayoutError(f"cp_size and tp_size must be >= 1, got {query.cp_size} and {query.tp_size}")
    if not 0 <= query.cp_rank < query.cp_size:
        raise LayoutError(f"cp_rank {query.cp_rank} is not in 0..{query.cp_size - 1}")
    if not 0 <= query.tp_rank < query.tp_size:
        raise LayoutError(f"tp_rank {query.tp_rank} is not in 0..{query.tp_size - 1}")


def _sp(n: int, query: MegatronQuery) -> slice:
    return _sp_split(n, query.sp_size, query.sp_rank)


def _describe(query: MegatronQuery, pad: ThdPadding, **fields) -> SliceLayout:
    """The slice layout of this rank with the plan's `fields` (tokens, lengths)."""
    return SliceLayout(LayoutKind.MEGATRON, packing=query.packing, cp_size=query.cp_size, cp_rank=query.cp_rank,
                       tp_size=query.tp_size, tp_rank=query.tp_rank, sequence_parallel=query.sequence_parallel,
                       cp_split=query.cp_split, pad_multiple=pad.pad_multiple, total_multiple=pad.total_multiple,
                       total_pad=pad.total_pad, convention=query.convention, **fields)


@dataclass(frozen=True)
class LayoutSize:
    """How many tokens a layout would hold, worked out in Python integers before any array is made."""

    total: int  # the whole layout: every rank of the micro-batch, padding included
    rank: int  # this rank's slice (the answer's rows)
    sized_by: str  # the parameters that make it this large, for a refusal


def megatron_size(lengths: list[int], query: MegatronQuery, pad: ThdPadding) -> LayoutSize:
    """The size `megatron_plan` would lay out for sequences of `lengths` tokens (never smaller).

    Grows with every length, so lengths of 1 give a lower bound before the store is read.
    """
    if query.packing is Packing.THD:
        whole = sum(_round_up(n, pad.pad_multiple) for n in lengths)
        total = _round_up(whole, pad.total_multiple)
        sized_by = (f"{len(lengths)} sequences padded to pad_multiple={pad.pad_multiple}, the micro-batch to "
                    f"total_multiple={pad.total_multiple}")
    else:
        multiple = pad.pad_multiple
        s_len = query.seq_length if query.seq_length is not None else _round_up(max(lengths, default=1), multiple)
        total = s_len * len(lengths)
        sized_by = (f"seq_length={s_len}" + ("" if query.seq_length is not None else f" (pad_multiple={multiple})")
                    + f" x {len(lengths)} sequences")
    return LayoutSize(total, -(-total // (query.cp_size * query.sp_size)), sized_by)


def verl_size(batch: int, prompt_width: int, response_width: int) -> LayoutSize:
    """The size `verl_plan` lays out: the dense batch, all of it on this rank."""
    total = batch * (prompt_width + response_width)
    return LayoutSize(total, total, f"{batch} sequences x (prompt_width={prompt_width} + "
                                    f"response_width={response_width})")


def check_size(size: LayoutSize, max_layout_tokens: int, max_rank_tokens: int) -> None:
    """TooLarge (413) when a layout is over the settings' bounds; called before any of it is allocated."""
    if size.total > max_layout_tokens:
        raise TooLarge(f"the layout is {size.total} tokens ({size.sized_by}), more than "
                       f"REPLAY_MAX_LAYOUT_TOKENS={max_layout_tokens}; use smaller micro-batches or padding")
    if size.rank > max_rank_tokens:
        raise TooLarge(f"this rank's slice is {size.rank} tokens ({size.sized_by}), more than one read returns "
                       f"(REPLAY_MAX_READ_ROWS={max_rank_tokens}); use smaller micro-batches")


def megatron_plan(lengths: list[int], query: MegatronQuery, pad: ThdPadding) -> TokenPlan:
    """The router tokens of rank (cp_rank, tp_rank) for sequences of `lengths` tokens.

    THD: sequences packed back to back, each padded to `pad_multiple`, the whole batch padded
    to `total_multiple` (the last sequence grows, or every CP rank's stream gets a tail); CP
    then splits every padded sequence into 2cp zigzag chunks, or the whole stream into cp
    contiguous parts; SP splits what the CP rank holds contiguously over TP.
    BSHD: `[b, s]` right-padded to `seq_length`, seen by the router sequence-first (`[s, b]`
    flattened); CP splits `s` (zigzag or contiguous); SP splits the local `s * b` tokens
    contiguously (i.e. along `s`).
    """
    if not lengths:
        raise LayoutError("a micro-batch needs at least one sequence")
    lengths_arr = np.asarray(lengths, np.int64)
    if query.packing is Packing.THD:
        return _thd_plan(lengths_arr, query, pad)
    return _bshd_plan(lengths_arr, query, pad)


def _thd_plan(lengths: np.ndarray, query: MegatronQuery, pad: ThdPadding) -> TokenPlan:
    cp, r = query.cp_size, query.cp_rank
    padded = -(-lengths // pad.pad_multiple) * pad.pad_multiple
    whole = int(padded.sum())
    total = _round_up(whole, pad.total_multiple)
    extra = total - whole
    if pad.total_pad is TotalPad.LAST_SEQUENCE:
        padded[-1] += extra  # the last sequence absorbs them, before the CP split (verl fp8, NeMo-RL)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu_padded = np.concatenate([[0], np.cumsum(padded)])  # tail padding (TotalPad.TAIL) is after its end
    if query.cp_split is CpSplit.CONTIGUOUS:
        local = _cp_part(total, cp, r)
    else:
        pieces = [_zigzag(cu_padded[:-1], padded, cp, r)]
        if pad.total_pad is TotalPad.TAIL and extra:
            if extra % cp:
                raise LayoutError(f"a tail of {extra} padding tokens does not split over cp = {cp} ranks; "
                                  "total_multiple must be a multiple of cp")
            share = extra // cp  # every CP rank's stream ends with its own share (slime's per-rank tail)
            pieces.append(np.arange(whole + r * share, whole + (r + 1) * share, dtype=np.int64))
        local = np.concatenate(pieces)
    local = local[_sp(len(local), query)]
    seq = np.searchsorted(cu_padded, local, side="right") - 1
    seq_ok = np.minimum(seq, len(lengths) - 1)
    offset = local - cu_padded[seq_ok]
    real = (seq < len(lengths)) & (offset < lengths[seq_ok])
    return TokenPlan(
        sequence=np.where(real, seq, -1).astype(np.int32),
        offset=np.where(real, offset, -1).astype(np.int32),
        global_index=local,
        layout=_describe(query, pad, tokens=len(local), total_tokens=total, seq_length=total, sequences=len(lengths),
                         cu_seqlens=cu.tolist(), cu_seqlens_padded=cu_padded.tolist()),
    )


def _bshd_plan(lengths: np.ndarray, query: MegatronQuery, pad: ThdPadding) -> TokenPlan:
    batch = len(lengths)
    s_len = query.seq_length if query.seq_length is not None else _round_up(int(lengths.max()), pad.pad_multiple)
    if int(lengths.max()) > s_len:
        raise LayoutError(f"a sequence of {int(lengths.max())} tokens does not fit seq_length={s_len}")
    if query.cp_split is CpSplit.CONTIGUOUS:
        local_s = _cp_part(s_len, query.cp_size, query.cp_rank)
    else:
        local_s = _zigzag(np.zeros(1, np.int64), np.array([s_len], np.int64), query.cp_size, query.cp_rank)
    if len(local_s) % query.sp_size:
        raise LayoutError(
            f"{len(local_s)} sequence positions on this CP rank do not split over sequence parallel size "
            f"{query.sp_size}"
        )
    # sequence-first: router token i of this CP rank is (local_s[i // b], i % b)
    s_idx = np.repeat(local_s, batch)
    b_idx = np.tile(np.arange(batch, dtype=np.int64), len(local_s))
    keep = _sp(len(s_idx), query)
    s_idx, b_idx = s_idx[keep], b_idx[keep]
    real = s_idx < lengths[b_idx]
    return TokenPlan(
        sequence=np.where(real, b_idx, -1).astype(np.int32),
        offset=np.where(real, s_idx, -1).astype(np.int32),
        global_index=s_idx * batch + b_idx,
        layout=_describe(query, pad, tokens=len(s_idx), total_tokens=s_len * batch, seq_length=s_len,
                         sequences=batch),
    )


def verl_plan(prompt_lengths: Sequence[int], total_lengths: list[int], prompt_width: int,
              response_width: int) -> TokenPlan:
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
