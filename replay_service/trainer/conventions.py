"""Each trainer's THD padding rule, as the four numbers a Megatron token plan needs (pure functions).

A *convention* names a trainer whose packing the service copies, so a user passes the
trainer's own knobs (TP/CP size, slime's `--data-pad-size-multiplier`, verl's FP8) instead of
deriving the padding themselves. Each rule below was read from the trainer's source:

- verl 0.9.1, `verl/models/mcore/util.py`: `preprocess_packed_seqs` (legacy padded batches)
  and `preprocess_thd_engine` (the nested-tensor engine) pad every sequence to
  `align = tp * cp * 2` with zigzag CP (`tp * cp` with the contiguous layout, `tp` without
  CP); with FP8 (`use_fp8_padding`, set by `set_router_replay_data` when `tf_config.fp8` is
  e4m3 or hybrid) each sequence is padded to `lcm(16, align)` and the *last sequence* grows
  until the whole batch is a multiple of `align * 128` (`_compute_fp8_thd_align_size`).
- slime `slime/backends/megatron_utils/cp_utils.py` `prepare_routed_experts_for_routing_replay`
  (and `data.py` `get_batch`, which packs the tokens the same way): one filler row for the last
  token, then with zigzag CP each sequence padded to a multiple of `2 * cp`
  (`slice_with_cp`), no per-sequence padding without CP; the concatenated stream of each CP
  rank padded at its *tail* to a multiple of `tp * data_pad_size_multiplier` (default 128,
  `slime/utils/arguments.py`); with `--allgather-cp` the whole stream is padded to
  `cp * tp * multiplier` and cut into `cp` contiguous parts (`chunk(cp)`).
- miles `miles/backends/training_utils/replay_data.py` `fill_replay_data`: slime's rule
  (its padding rows are -1, which `replay_base.py` turns into experts 0..K-1; ours are filler).
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
