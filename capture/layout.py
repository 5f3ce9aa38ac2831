"""StepLayout: how one MoE layer's `topk_ids` rows lie on one rank, from rank-invariant values.

The forward path of one DP rank's rows, in the order vLLM applies it
(`MoERunner._forward_impl`: `_maybe_dispatch` = naive DP/EP dispatch, then the PCP
all-gather; then `_apply_quant_method`, whose prepare step pads and TP-splits for the
All2All/MC2 strategies; the router runs on what is left):

1. PCP chunk: this rank's `chunk` rows (real tokens plus PCP padding; equal on every
   PCP rank, since the engine all-gathers them). Without PCP, `chunk = num_tokens`.
   `sequence_parallel` pads the chunk to a multiple of `tp_size` and keeps this TP
   rank's even piece here, in model code, before the MoE layer.
2. DP dispatch (`naive_dp`: every DP rank's rows concatenated; `padded_dp`: each
   padded to `max(tokens_across_dp)`).
3. PCP gather: the blocks of all PCP ranks, rank-major.
4. TP split of the whole gathered batch (`alltoall`: pad to `max(B, tp_size)` only when
   smaller, `tensor_split`; `mc2`/`fused_mc2`: pad to `padded_num_tokens`, split).

`RowPlan` (from `StepLayout.plan(chunk)`) holds every row count of that path; the
restore inverts it. Under PCP, `tokens_across_dp` lists each DP rank's per-PCP-rank
chunk rows (what entered the dispatch), and `num_tokens` is the real tokens of this DP
rank (the restored row count).
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("local", "naive_dp", "padded_dp", "sequence_parallel", "alltoall", "mc2", "fused_mc2")
# Strategies that split the token dimension inside the TP group: topk_ids is a shard.
TP_SPLIT_BATCH = ("alltoall", "mc2", "fused_mc2")  # split after the PCP gather (prepare step)
TP_SPLIT_CHUNK = ("sequence_parallel",)  # split before it (model-level sequence parallelism)
DP_DISPATCH = ("naive_dp", "padded_dp")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_sizes(rows: int, parts: int) -> tuple[int, ...]:
    """Row counts of `torch.tensor_split(x, parts)` for `rows` rows (larger pieces first)."""
    q, r = divmod(rows, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


@dataclass(frozen=True)
class RowPlan:
    """Every row count of one rank's forward path (see the module docstring)."""

    chunk: int  # rows per PCP rank of this DP rank, PCP padding included
    local_rows: int  # rows topk_ids must have on this rank
    tp_mode: str  # "none" | "batch" (split after the PCP gather) | "chunk" (split each chunk before it)
    tp_sizes: tuple[int, ...]  # rows of each TP rank's piece, split order ("batch": of the padded batch; "chunk": per chunk)
    block_rows: int  # rows of one PCP rank's block once TP is undone
    block_offset: int  # this DP rank's first row inside a block
    pcp_rows: int  # pcp_size * chunk: the PCP-gathered rows of this DP rank


@dataclass(frozen=True)
class StepLayout:
    """Where this DP rank's rows are in `topk_ids` for one step (see `capture` docstring)."""

    num_tokens: int
    strategy: str = "local"
    tokens_across_dp: tuple[int, ...] | None = None
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    padded_num_tokens: int | None = None
    pcp_size: int = 1
    pcp_rank: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; one of {', '.join(STRATEGIES)}")
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
            if self.strategy not in ("mc2", "fused_mc2"):
                raise ValueError(f"{self}: padded_num_tokens applies only to mc2/fused_mc2")
            if self.padded_num_tokens < 0:
                raise ValueError(f"{self}: padded_num_tokens must be >= 0")

    @property
    def dp_size(self) -> int:
        return len(self.tokens_across_dp) if self.tokens_across_dp is not None else 1

    def mc2_padded_rows(self, chunk: int) -> int:
        """MC2 padding target of the batch entering the TP split (P * chunk rows)."""
        if self.padded_num_tokens is not None:
            return self.padded_num_tokens
        largest = max(self.tokens_across_dp) if self.tokens_across_dp is not None else chunk
        return _ceil_div(self.pcp_size * largest, self.tp_size) * self.tp_size

    def plan(self, chunk: int | None = None) -> RowPlan:
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
        block_rows, offset, tp_mode, tp_sizes = chunk, 0, "none", (chunk,)
        if s == "naive_dp":
            block_rows, offset = sum(self.tokens_across_dp), sum(self.tokens_across_dp[: self.dp_rank])
            local = p * block_rows
        elif s == "padded_dp":
            largest = max(self.tokens_across_dp)
            block_rows, offset = largest * self.dp_size, largest * self.dp_rank
            local = p * block_rows
        elif s == "local":
            local = p * chunk
        elif s in TP_SPLIT_CHUNK:
            tp_mode = "chunk"
            tp_sizes = (_ceil_div(chunk, tp),) * tp
            local = p * tp_sizes[self.tp_rank]
        else:  # alltoall, mc2, fused_mc2
            tp_mode = "batch"
            batch = p * chunk
            target = max(batch, tp) if s == "alltoall" else max(batch, self.mc2_padded_rows(chunk))
            tp_sizes = split_sizes(target, tp)
            local = tp_sizes[self.tp_rank]
        return RowPlan(chunk, local, tp_mode, tp_sizes, block_rows, offset, p * chunk)
