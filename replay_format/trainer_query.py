"""Trainer queries: what one rank asks `POST /v1/trainer/megatron` or `/v1/trainer/verl` for (trainer_query.md).

The trainer builds one (`replay_client.trainer.megatron_query`, `verl_query`) and sends its
`to_json()`; the service's API model validates a body and converts it into the same record
(`replay_service.api.trainer`), which the service's planner takes (`replay_service.trainer`).
The answer is a trainer slice (trainer_slice.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from replay_format.core import FormatVersion, LayerAxis
from replay_format.trainer_slice import Convention, CpSplit, MissingPolicy, Packing, TotalPad

VERSION = FormatVersion(1, 1)  # the bodies carry no version key: their API path (/v1) versions them; 1.1: versions


class VersionPolicy(enum.StrEnum):
    """Whether a sequence of the micro-batch may hold rows of more than one weight version."""

    ANY = "any"  # every row as recorded, whatever its version (the default; the slice says each token's)
    SINGLE = "single"  # refuse (409, naming them) sequences whose rows were computed by more than one version


def strict_alias(strict: bool) -> MissingPolicy:
    """The policy the older `strict` flag names: true = strict, false = filler."""
    return MissingPolicy.STRICT if strict else MissingPolicy.FILLER


@dataclass(frozen=True)
class SequenceRef:
    """One sequence of a micro-batch: a request's tokens from `start` (`num_tokens` of them; None: all)."""

    run: str
    request: str
    start: int = 0  # the first position fed (multi-turn: only rows from here on)
    num_tokens: int | None = None  # tokens fed from start; None: the whole request (rows + 1)

    def to_json(self) -> dict[str, Any]:
        """The JSON object: `run`, `request`, and `start` / `num_tokens` where they are not the defaults."""
        doc: dict[str, Any] = {"run": self.run, "request": self.request}
        if self.start != 0:
            doc["start"] = self.start
        if self.num_tokens is not None:
            doc["num_tokens"] = self.num_tokens
        return doc


@dataclass(frozen=True)
class StageLayers:
    """The layers of this rank's pipeline stage (default: all) and the axis the slice holds them on."""

    moe_ordinals: tuple[int, ...] | None = None  # the stage's MoE ordinals (moe axis only)
    model_layer_range: tuple[int, int] | None = None  # or: the stage's model layers [lo, hi)
    layer_axis: LayerAxis = LayerAxis.MOE  # MoE layers only, or every model layer of the range (dense ones zero)

    def to_json(self) -> dict[str, Any]:
        """The query's layer fields: the stage's layers when named, and `layer_axis`."""
        doc: dict[str, Any] = {}
        if self.moe_ordinals is not None:
            doc["moe_ordinals"] = list(self.moe_ordinals)
        if self.model_layer_range is not None:
            doc["model_layer_range"] = list(self.model_layer_range)
        doc["layer_axis"] = self.layer_axis.value
        return doc


@dataclass(frozen=True, kw_only=True)
class SliceQuery:
    """What one rank asks for, whatever the trainer: the micro-batch, its stage's layers, the missing-row policy.

    `missing` None and `strict` None mean strict; `strict` is the older alias of `missing`
    (`strict_alias`), which the service still takes and the client never sends. `versions`: whether a
    sequence may mix weight versions (sent only when `single`, so a service before 1.1 takes the rest).
    """

    sequences: tuple[SequenceRef, ...]  # the micro-batch, in order
    layers: StageLayers = field(default_factory=StageLayers)
    missing: MissingPolicy | None = None  # what a real token whose recorded row is flagged or missing gets
    strict: bool | None = None  # deprecated alias: true = missing=strict, false = missing=filler
    versions: VersionPolicy = VersionPolicy.ANY  # 1.1

    def _policy_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.missing is not None:
            doc["missing"] = self.missing.value
        if self.strict is not None:
            doc["strict"] = self.strict
        if self.versions is not VersionPolicy.ANY:
            doc["versions"] = self.versions.value
        return doc


@dataclass(frozen=True, kw_only=True)
class MegatronQuery(SliceQuery):
    """One rank of a Megatron micro-batch: the packing, the padding and where the rank sits.

    THD padding is a `convention`'s (with its knobs `data_pad_size_multiplier`, `fp8_padding`) or
    `pad_multiple`, `total_multiple` and `total_pad` (None: the service's default rule); BSHD pads
    every sequence to `seq_length`. The tokens are split over `tp_size` only when `sequence_parallel`.
    """

    packing: Packing = Packing.THD
    convention: Convention | None = None
    pad_multiple: int | None = None
    total_multiple: int | None = None
    total_pad: TotalPad | None = None
    cp_split: CpSplit = CpSplit.ZIGZAG
    data_pad_size_multiplier: int | None = None
    fp8_padding: bool | None = None
    seq_length: int | None = None
    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = True

    @property
    def sp_size(self) -> int:
        """Ranks a CP rank's tokens are split over: the TP size with sequence parallel, else 1."""
        return self.tp_size if self.sequence_parallel else 1

    @property
    def sp_rank(self) -> int:
        """This rank's part of the sequence-parallel split: the TP rank with sequence parallel, else 0."""
        return self.tp_rank if self.sequence_parallel else 0

    def to_json(self) -> dict[str, Any]:
        """The body of `POST /v1/trainer/megatron` (trainer_query.md); the optional fields only when set."""
        doc: dict[str, Any] = {"sequences": [s.to_json() for s in self.sequences], "packing": self.packing.value,
                               "cp_split": self.cp_split.value, "cp_size": self.cp_size, "cp_rank": self.cp_rank,
                               "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                               "sequence_parallel": self.sequence_parallel}
        optional = {"convention": None if self.convention is None else self.convention.value,
                    "pad_multiple": self.pad_multiple, "total_multiple": self.total_multiple,
                    "total_pad": None if self.total_pad is None else self.total_pad.value,
                    "data_pad_size_multiplier": self.data_pad_size_multiplier, "fp8_padding": self.fp8_padding,
                    "seq_length": self.seq_length}
        doc.update({k: v for k, v in optional.items() if v is not None})
        return {**doc, **self.layers.to_json(), **self._policy_json()}


@dataclass(frozen=True, kw_only=True)
class VerlQuery(SliceQuery):
    """A dense verl micro-batch `[batch, prompt_width + response_width]`: prompts left-, responses right-padded."""

    prompt_lengths: tuple[int, ...]  # prompt tokens of each sequence (before left padding)
    prompt_width: int  # padded prompt length
    response_width: int  # padded response length

    def to_json(self) -> dict[str, Any]:
        """The body of `POST /v1/trainer/verl` (trainer_query.md)."""
        doc: dict[str, Any] = {"sequences": [s.to_json() for s in self.sequences],
                               "prompt_lengths": list(self.prompt_lengths), "prompt_width": self.prompt_width,
                               "response_width": self.response_width}
        return {**doc, **self.layers.to_json(), **self._policy_json()}


TrainerQuery = MegatronQuery | VerlQuery
