"""Each trainer's THD padding rule, as the numbers a Megatron token plan needs (pure functions).

A *convention* names a trainer whose packing the service copies (verl 0.9.1, slime, miles), so a user passes the
trainer's own knobs (TP/CP size, slime's `--data-pad-size-multiplier`, verl's FP8) instead of deriving the padding
themselves. `resolve_padding(query)` -> `ThdPadding` (each sequence's multiple, the whole batch's multiple and where
that padding goes): the convention's rule (`convention_padding`), or the query's explicit fields over verl's default
(`default_pad_multiple`); fields that do not go together raise InvalidInput. Each rule was read from the trainer's
source, cited in the design page.

Design: docs/design/trainer_layouts.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replay_format.trainer_query import MegatronQuery
from replay_format.trainer_slice import Convention, CpSplit, Packing, TotalPad
from replay_service.errors import InvalidInput

SLIME_DATA_PAD_SIZE_MULTIPLIER = 128  # slime/miles --data-pad-size-multiplier default


@dataclass(frozen=True)
class ThdPadding:
    """How a THD micro-batch is padded: each sequence, then the whole batch (all CP ranks together)."""

    pad_multiple: int  # each sequence padded to a multiple of this
    total_multiple: int = 1  # the whole micro-batch's token count padded to a multiple of this
    total_pad: TotalPad = TotalPad.LAST_SEQUENCE  # where those extra tokens go


def default_pad_multiple(cp_size: int, tp_size: int) -> int:
    """verl's `preprocess_packed_seqs` rule: tp * cp * 2 with context parallel, else tp."""
    return tp_size * cp_size * 2 if cp_size > 1 else tp_size


def convention_padding(convention: Convention, query: MegatronQuery) -> ThdPadding:
    """The THD padding `convention` applies at the query's sizes; InvalidInput for a knob the trainer does not have."""
    cp_size, tp_size, cp_split = query.cp_size, query.tp_size, query.cp_split
    if convention is Convention.VERL:
        if query.data_pad_size_multiplier is not None:
            raise InvalidInput("data_pad_size_multiplier is slime's and miles's knob; verl pads by tp*cp "
                               "(and fp8_padding)")
        factor = 2 if cp_split is CpSplit.ZIGZAG and cp_size > 1 else 1
        align = tp_size * cp_size * factor
        if query.fp8_padding:
            return ThdPadding(math.lcm(16, align), align * 128, TotalPad.LAST_SEQUENCE)
        return ThdPadding(align)
    if query.fp8_padding is not None:
        raise InvalidInput(f"fp8_padding is verl's knob; {convention.value} pads by data_pad_size_multiplier")
    multiplier = query.data_pad_size_multiplier
    if multiplier is None:
        multiplier = SLIME_DATA_PAD_SIZE_MULTIPLIER
    per_sequence = 2 * cp_size if cp_split is CpSplit.ZIGZAG and cp_size > 1 else 1
    return ThdPadding(per_sequence, cp_size * tp_size * multiplier, TotalPad.TAIL)


def resolve_padding(query: MegatronQuery) -> ThdPadding:
    """A query's padding: its convention's, or its explicit fields over verl's default rule.

    InvalidInput when they do not go together: a convention with explicit padding fields (which one
    would win is a guess), a convention's knob without it, a THD-only field on BSHD.
    """
    packing, convention = query.packing, query.convention
    explicit = [k for k, v in (("pad_multiple", query.pad_multiple), ("total_multiple", query.total_multiple),
                               ("total_pad", query.total_pad)) if v is not None]
    if convention is not None:
        if packing is not Packing.THD:
            raise InvalidInput(f"convention={convention.value} is a THD packing rule; packing is {packing.value}")
        if explicit:
            raise InvalidInput(f"convention={convention.value} fixes {', '.join(explicit)}; give either the "
                               "convention or the padding fields")
        return convention_padding(convention, query)
    knobs = [k for k, v in (("data_pad_size_multiplier", query.data_pad_size_multiplier),
                            ("fp8_padding", query.fp8_padding)) if v is not None]
    if knobs:
        raise InvalidInput(f"{', '.join(knobs)} belong to a convention (slime/miles, verl); give convention too")
    if packing is Packing.BSHD and {"total_multiple", "total_pad"} & set(explicit):
        raise InvalidInput("total_multiple and total_pad pad a THD stream; BSHD pads every sequence to seq_length")
    return ThdPadding(query.pad_multiple or default_pad_multiple(query.cp_size, query.tp_size),
                      query.total_multiple or 1, query.total_pad or TotalPad.LAST_SEQUENCE)
