"""Choose a rank's token plan from its trainer query: Megatron's (THD/BSHD, CP and SP slices) or verl's dense one.

`planner` refuses what it can before the store is read (options that do not go together, a layout
too large even at the tokens the query names, one a sequence where it names none) and gives the
`MakePlan` that `reads.read_slice` calls once the sequences' lengths are known; that checks the
size again before any of the plan's arrays exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from replay_format.trainer_query import MegatronQuery, TrainerQuery, VerlQuery
from replay_service.settings import ServiceSettings
from replay_service.trainer import layouts
from replay_service.trainer.conventions import resolve_padding

MakePlan = Callable[[list[layouts.SequenceSpec]], layouts.TokenPlan]


@dataclass(frozen=True)
class SliceLimits:
    """The service's bounds on one slice (from its settings)."""

    max_sequences: int
    max_tokens: int  # rows of one rank's slice (one read)
    max_layout_tokens: int  # tokens of the whole layout, every rank of the micro-batch
    strict_report_rows: int  # bad rows named in a strict refusal

    @classmethod
    def of(cls, settings: ServiceSettings) -> SliceLimits:
        """The bounds `settings` set."""
        return cls(settings.max_batch_requests, settings.max_read_rows, settings.max_layout_tokens,
                   settings.strict_report_rows)

    def check(self, size: layouts.LayoutSize) -> None:
        """TooLarge when a layout of `size` is over the bounds (`layouts.check_size`)."""
        layouts.check_size(size, self.max_layout_tokens, self.max_tokens)


def planner(query: TrainerQuery, limits: SliceLimits) -> MakePlan:
    """What lays the query's sequences out; InvalidInput or TooLarge for a query refused before the store is read."""
    if isinstance(query, MegatronQuery):
        return _megatron(query, limits)
    return _verl(query, limits)


def _megatron(query: MegatronQuery, limits: SliceLimits) -> MakePlan:
    padding = resolve_padding(query)
    layouts.check_rank(query)
    # refused before the store is read when even the given (else 1-token) sequences make it too large
    limits.check(layouts.megatron_size([s.num_tokens or 1 for s in query.sequences], query, padding))

    def make_plan(specs: list[layouts.SequenceSpec]) -> layouts.TokenPlan:
        lengths = [s.num_tokens for s in specs]
        limits.check(layouts.megatron_size(lengths, query, padding))  # before the plan's arrays exist
        return layouts.megatron_plan(lengths, query, padding)

    return make_plan


def _verl(query: VerlQuery, limits: SliceLimits) -> MakePlan:
    limits.check(layouts.verl_size(len(query.sequences), query.prompt_width, query.response_width))

    def make_plan(specs: list[layouts.SequenceSpec]) -> layouts.TokenPlan:
        return layouts.verl_plan(query.prompt_lengths, [s.num_tokens for s in specs], query.prompt_width,
                                 query.response_width)

    return make_plan
