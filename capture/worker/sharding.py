"""RowSharding: how one MoE layer's `topk_ids` rows lie on one rank, from rank-invariant values.

Runs in the inference worker (pure Python; the restore that uses it needs torch). `Strategy` says where a rank's
rows are (local, naive_dp, padded_dp, sequence_parallel, alltoall, mc2, fused_mc2). `RowSharding.plan(chunk)` is
the `ShardPlan`: every row count of the forward path (PCP chunk, DP dispatch, PCP gather, TP split), which
`capture.worker.restore` inverts. Under PCP, `tokens_across_dp` lists each DP rank's per-PCP-rank chunk rows (what
entered the dispatch) and `num_tokens` is this DP rank's real tokens (the restored row count).

Design: docs/design/capture.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Strategy(enum.StrEnum):
    """Where an engine puts a DP rank's rows before the router (the `capture` docstring lists each)."""

    LOCAL = "local"
    NAIVE_DP = "naive_dp"
    PADDED_DP = "padded_dp"
    SEQUENCE_PARALLEL = "sequence_parallel"
    ALLTOALL = "alltoall"
    MC2 = "mc2"
    FUSED_MC2 = "fused_mc2"

    def __repr__(self) -> str:  # error messages print the sharding: keep them short
        return f"Strategy.{self.name}"


class TpSplit(enum.StrEnum):
    """How the TP group splits the token dimension (topk_ids is then a shard)."""

    NONE = "none"  # every TP rank routes the whole batch
    BATCH = "batch"  # after the PCP gather: the quant method's prepare step pads and splits the batch
    CHUNK = "chunk"  # before it: model-level sequence parallelism splits each PCP chunk


TP_SPLIT_BATCH = (Strategy.ALLTOALL, Strategy.MC2, Strategy.FUSED_MC2)
TP_SPLIT_CHUNK = (Strategy.SEQUENCE_PARALLEL,)
DP_DISPATCH = (Strategy.NAIVE_DP, Strategy.PADDED_DP)
MC2_FAMILY = (Strategy.MC2, Strategy.FUSED_MC2)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_sizes(rows: int, parts: int) -> tuple[int, ...]:
    """Row counts of `torch.tensor_split(x, parts)` for `rows` rows (larger pieces first)."""
    q, r = divmod(rows, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


@dataclass(frozen=True)
class ShardPlan:
    """Every row count of one rank's forward path (see the module docstring)."""

    chunk: int  # rows per PCP rank of this DP rank, PCP padding included
    local_rows: int  # rows topk_ids must have on this rank
    tp_split: TpSplit
    tp_sizes: tuple[int, ...]  # each TP rank's rows, split order (BATCH: of the padded batch; CHUNK: per chunk)
    block_rows: int  # rows of one PCP rank's block once TP is undone
    block_offset: int  # this DP rank's first row inside a block
    pcp_rows: int  # pcp_size * chunk: the PCP-gathered rows of this DP rank


@dataclass(frozen=True)
class RowSharding:
    """Where this DP rank's rows are in `topk_ids` for one step (see `capture` docstring).

    `strategy` takes a `Strategy` or its string value."""

    num_tokens: int
    strategy: Strategy = Strategy.LOCAL
    tokens_across_dp: tuple[int, ...] | None = None
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    padded_num_tokens: int | None = None
    pcp_size: int = 1
    pcp_rank: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "strategy", Strategy(self.strategy))
        except ValueError:
            raise ValueError(f"unknown strategy {self.strategy!r}; one of {', '.join(Strategy)}") from None
        if self.num_tokens < 0:
            raise ValueError(f"{self}: num_tokens must be >= 0")
        for name, size, rank in (("tp", self.tp_size, self.tp_rank), ("pcp", self.pcp_size, self.pcp_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{self}: need {name}_size >= 1 and 0 <= {name}_rank < {name}_size")
        if self.tokens_across_dp is not None:
            tad = tuple(int(x) for x in self.tokens_across_dp)
            object.__setattr__(self, "tokens_across_dp", tad)
            if not tad or min(tad) < 0:
                raise ValueError(f"{self}: tokens_across_dp must list >= 1 non-negative counts")
            if not 0 <= self.dp_rank < len(tad):
                raise ValueError(f"{self}: dp_rank outside tokens_across_dp")
        elif self.dp_rank < 0:
            raise ValueError(f"{self}: dp_rank must be >= 0")
        if self.strategy in DP_DISPATCH and self.tokens_across_dp is None:
            raise ValueError(f"{self}: strategy {self.strategy} needs tokens_across_dp")
        if self.padded_num_tokens is not None:
            if self.strategy not in MC2_FAMILY:
                raise ValueError(f"{self}: padded_num_tokens applies only to mc2/fused_mc2")
            if self.padded_num_tokens < 0:
                raise ValueError(f"{self}: padded_num_tokens must be >= 0")

    @property
    def dp_size(self) -> int:
        """DP ranks the dispatch spans (1 without `tokens_across_dp`)."""
        return len(self.tokens_across_dp) if self.tokens_across_dp is not None else 1

    def mc2_padded_rows(self, chunk: int) -> int:
        """MC2 padding target of the batch entering the TP split (P * chunk rows)."""
        if self.padded_num_tokens is not None:
            return self.padded_num_tokens
        largest = max(self.tokens_across_dp) if self.tokens_across_dp is not None else chunk
        return _ceil_div(self.pcp_size * largest, self.tp_size) * self.tp_size

    def plan(self, chunk: int | None = None) -> ShardPlan:
        """Row counts for this rank. `chunk`: PCP chunk rows (len of the PCP padding mask);
        None means no PCP padding, so `num_tokens / pcp_size`."""
        p, tp = self.pcp_size, self.tp_size
        if chunk is None:
            if self.num_tokens % p:
                raise ValueError(
                    f"{self}: {self.num_tokens} tokens do not split evenly over pcp_size {p}; pass the PCP padding mask"
                )
            chunk = self.num_tokens // p
        if chunk < 0 or p * chunk < self.num_tokens:
            raise ValueError(f"{self}: PCP chunk of {chunk} rows x {p} cannot hold {self.num_tokens} tokens")
        if self.tokens_across_dp is not None and self.tokens_across_dp[self.dp_rank] != chunk:
            raise ValueError(
                f"{self}: tokens_across_dp[{self.dp_rank}]={self.tokens_across_dp[self.dp_rank]} "
                f"but this DP rank has {chunk} rows per PCP rank"
            )
        s = self.strategy
        block_rows, offset, tp_split = chunk, 0, TpSplit.NONE
        tp_sizes: tuple[int, ...] = (chunk,)
        if s in DP_DISPATCH:
            across = self.tokens_across_dp
            assert across is not None  # __post_init__ refuses a DP dispatch without it
            if s == Strategy.NAIVE_DP:
                block_rows, offset = sum(across), sum(across[: self.dp_rank])
            else:
                block_rows, offset = max(across) * self.dp_size, max(across) * self.dp_rank
            local = p * block_rows
        elif s == Strategy.LOCAL:
            local = p * chunk
        elif s in TP_SPLIT_CHUNK:
            tp_split = TpSplit.CHUNK
            tp_sizes = (_ceil_div(chunk, tp),) * tp
            local = p * tp_sizes[self.tp_rank]
        else:  # TP_SPLIT_BATCH
            tp_split = TpSplit.BATCH
            batch = p * chunk
            target = max(batch, tp) if s == Strategy.ALLTOALL else max(batch, self.mc2_padded_rows(chunk))
            tp_sizes = split_sizes(target, tp)
            local = tp_sizes[self.tp_rank]
        return ShardPlan(chunk, local, tp_split, tp_sizes, block_rows, offset, p * chunk)
