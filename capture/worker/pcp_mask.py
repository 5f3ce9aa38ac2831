"""Give the router a padding mask with the same rows, in the same order, as the logits it routes.

Runs in the inference worker (torch.distributed), around the engine's router call. Under PCP the router sees the
dispatched, PCP-gathered rows while the forward context's `is_padding` holds this rank's own: `install(ctx,
forward_pass=..., dispatch=NaiveDispatch(...))` gathers the mask the same way, sets it on the context for the block
and puts the original back on any exit; no collective runs when `needed()` is false, the context holds no mask, or
there is neither PCP nor a dispatch. The gathered mask is cached per `forward_pass`, keyed on no mask values (writes
that bypass torch's version counter need `invalidate()`); `needed` must agree on every rank, or the gather deadlocks.

Design: docs/design/capture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from capture.worker.restore import all_gather_rows, gather_pcp_mask, gather_single


@dataclass(frozen=True)
class NaiveDispatch:
    """A naive DP/EP dispatch that ran before the PCP gather: rows of every `group` rank
    concatenated rank-major, `sizes[r]` rows from group rank r (the same on every rank);
    `padded`: each rank's rows padded to `max(sizes)` first (a padded all-gather)."""

    group: Any  # a torch ProcessGroup
    sizes: tuple[int, ...]
    padded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if not self.sizes or min(self.sizes) < 0:
            raise ValueError(f"dispatch sizes must list >= 1 non-negative counts, got {self.sizes}")


def gather_padding_mask(
    local: torch.Tensor, pcp_group, pcp_size: int, dispatch: NaiveDispatch | None = None
) -> torch.Tensor:
    """The mask over the router's rows: dispatch-gathered (as the dispatch does), then
    PCP-gathered rank-major. Rows a padded dispatch adds are padding (True)."""
    mask = local.reshape(-1).to(torch.bool)
    if dispatch is not None:
        rank = dist.get_rank(dispatch.group)
        if mask.shape[0] != dispatch.sizes[rank]:
            raise ValueError(f"local padding mask has {mask.shape[0]} rows, dispatch sizes say {dispatch.sizes[rank]}")
        if dispatch.padded:
            width = max(dispatch.sizes)
            padded = mask.new_ones(width)
            padded[: mask.shape[0]] = mask
            out = mask.new_empty(width * len(dispatch.sizes))
            gather_single(out, padded, dispatch.group)
            mask = out
        else:
            mask = all_gather_rows(mask, dispatch.sizes, dispatch.group, pad_value=True)
    return gather_pcp_mask(mask, pcp_size, pcp_group)


class PcpPaddingMask:
    """Installs the gathered padding mask on a context object (see module docstring)."""

    def __init__(
        self,
        pcp_group=None,
        pcp_size: int = 1,
        *,
        attr: str = "is_padding",
        needed: Callable[[], bool] | None = None,
    ) -> None:
        if pcp_size < 1:
            raise ValueError(f"pcp_size must be >= 1, got {pcp_size}")
        self.pcp_group = pcp_group
        self.pcp_size = pcp_size
        self.attr = attr
        self.needed = needed or (lambda: True)
        self.gathers = 0  # gathers run so far (each is one collective per group involved)
        self._cache: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._active = False

    def invalidate(self) -> None:
        """Drop the cached gather (call on every rank alike)."""
        self._cache = None

    @staticmethod
    def _key(local: torch.Tensor, forward_pass: Hashable, dispatch: NaiveDispatch | None) -> tuple:
        disp = None if dispatch is None else (id(dispatch.group), dispatch.sizes, dispatch.padded)
        return (forward_pass, id(local), local._version, local.data_ptr(), tuple(local.shape), str(local.device), disp)

    def gathered(
        self, local: torch.Tensor, forward_pass: Hashable | None = None, dispatch: NaiveDispatch | None = None
    ) -> torch.Tensor:
        """The gathered mask for `local`, from the cache when this pass already gathered it."""
        key = None if forward_pass is None else self._key(local, forward_pass, dispatch)
        if key is not None and self._cache is not None and self._cache[0] == key and self._cache[1] is local:
            return self._cache[2]
        mask = gather_padding_mask(local, self.pcp_group, self.pcp_size, dispatch)
        self.gathers += 1
        # Holding `local` keeps its id from being reused by another tensor while cached.
        self._cache = None if key is None else (key, local, mask)
        return mask

    @contextmanager
    def install(
        self, ctx, *, forward_pass: Hashable | None = None, dispatch: NaiveDispatch | None = None
    ) -> Iterator[torch.Tensor | None]:
        """Within the block `ctx.<attr>` is the gathered mask; yields what the router will read."""
        local = getattr(ctx, self.attr, None)
        if local is None or (self.pcp_size == 1 and dispatch is None) or not self.needed():
            yield local
            return
        if self._active:
            raise RuntimeError(f"{type(self).__name__}.install is not re-entrant (ctx.{self.attr} is already gathered)")
        mask = self.gathered(local, forward_pass, dispatch)
        self._active = True
        setattr(ctx, self.attr, mask)
        try:
            yield mask
        finally:
            setattr(ctx, self.attr, local)
            self._active = False


__all__ = ["NaiveDispatch", "PcpPaddingMask", "gather_padding_mask"]

