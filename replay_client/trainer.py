"""Trainer side: one rank's routes in the layout its router needs (runs in the trainer process; torch lazily).

Contract: `megatron_query` / `verl_query` build the query of `POST /v1/trainer/megatron` or `verl` (its body is
`to_json()`, replay_format/trainer_query.md); the answer is a trainer slice (replay_format/trainer_slice.md) that
`TrainerBatch` views without a copy: `replay_data()` (one int64 `[tokens, top_k]` per MoE layer, all -1 on a
`fallback` token), `valid_tensor()` (the loss mask), verl's `dense()` / `mask()`, and `staleness()` (replayed rows per
weight version). `recorded_rows` / `compare_body` carry RECORD mode's top-k to `POST .../compare`
(replay_format/compare.md).
Design: docs/design/trainer_client.md ("Trainer batches").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np

from replay_format import LayerAxis, RunShape
from replay_format.compare import build_compare_body
from replay_format.core import Backing
from replay_format.trainer_query import (
    MegatronQuery,
    SequenceRef,
    StageLayers,
    VerlQuery,
    VersionPolicy,
    strict_alias,
)
from replay_format.trainer_slice import (
    Convention,
    CpSplit,
    MissingPolicy,
    Packing,
    TotalPad,
    TrainerSlice,
    read_slice,
)

SEQUENCE_FIELDS = frozenset(f.name for f in fields(SequenceRef))  # what a sequence given as a dict may hold
MISSING_ROUTE = -1  # the id `replay_data` gives a fallback token on every k (NeMo-RL's missing-route sentinel)


@dataclass(frozen=True)
class Staleness:
    """How many replayed rows of a batch each weight version computed: the number asynchronous RL runs log.

    Counts the tokens replayed from a recorded row (`valid == 1`) of this rank's slice; filler has no row.
    Under TP without sequence parallelism every TP rank holds the same tokens: count one of them.
    """

    rows: dict[str, int]  # replayed rows per version label, in the slice's label order
    unknown: int  # replayed rows whose version is not known (written before versions existed)
    current: str | None = None  # the trainer's own weight version, when given
    lags: dict[str, int] = field(default_factory=dict)  # versions behind `current`, when every label is an integer

    @property
    def total(self) -> int:
        """Replayed rows counted."""
        return sum(self.rows.values()) + self.unknown

    @property
    def stale_rows(self) -> int | None:
        """Rows of a known version other than `current` (None without `current`)."""
        if self.current is None:
            return None
        return sum(n for label, n in self.rows.items() if label != self.current)

    def metrics(self, prefix: str = "replay/") -> dict[str, float]:
        """A flat dict for a metrics logger: rows per version, unknown rows, versions seen; with `current` the
        stale rows and their fraction of the known ones; with integer labels the largest and the mean lag."""
        out: dict[str, float] = {f"{prefix}rows/{label}": float(n) for label, n in self.rows.items()}
        out[f"{prefix}rows_unknown"] = float(self.unknown)
        out[f"{prefix}versions"] = float(len(self.rows))
        stale, known = self.stale_rows, sum(self.rows.values())
        if stale is not None:
            out[f"{prefix}stale_rows"] = float(stale)
            out[f"{prefix}stale_fraction"] = stale / known if known else 0.0
        if self.lags and known:
            out[f"{prefix}max_lag"] = float(max(self.lags[label] for label, n in self.rows.items() if n))
            out[f"{prefix}mean_lag"] = sum(self.lags[label] * n for label, n in self.rows.items()) / known
        return out


def _integer(label: str) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


class RecordedRows(NamedTuple):
    """The trainer's own top-k as `ReplayClient.compare` takes it (`client.compare(run, *rows)`): one row per
    token the rollout has a row for."""

    request_ids: list[str]
    positions: np.ndarray  # int [n]
    experts: np.ndarray  # int [n, num_moe_layers, top_k]


@dataclass
class TrainerBatch(TrainerSlice):
    """One rank's router tokens, in the router's order, with the tensors Megatron and verl take."""

    @classmethod
    def from_slice(cls, piece: TrainerSlice) -> TrainerBatch:
        """The batch over a read slice's arrays (no copy)."""
        return cls(piece.meta, piece.experts, piece.valid, piece.sequence, piece.position, piece.fallback,
                   piece.weight_version)

    @classmethod
    def read(cls, backing: Backing) -> TrainerBatch:
        """A received answer body (`read_slice`), its arrays viewing `backing`."""
        return cls.from_slice(read_slice(backing))

    def replay_data(self, device=None) -> list:
        """The list `RouterReplay.set_replay_data` takes: one contiguous int64 `[tokens, top_k]` per MoE layer.

        One tensor per MoE layer held, in order, on either layer axis (dense layers have no router).
        A `fallback` token (missing=router) is all -1: NeMo-RL's missing-route sentinel, for a
        RouterReplay that routes such rows itself (megatron-core's own does not: it would index -1).
        With `device` (e.g. "cuda"), the uint8/uint16 ids travel to it first and widen there:
        8x fewer bytes over PCIe than moving int64, and no 8x host copy.
        """
        import torch

        m, _, top_k = self.experts.shape
        ids = torch.from_numpy(self.experts)
        if device is not None:
            ids = ids.to(device)
        if self.layer_axis is LayerAxis.MODEL:
            ids = ids[:, torch.as_tensor(self.meta.moe_positions, device=ids.device)]
        out = torch.empty((ids.shape[1], m, top_k), dtype=torch.int64, device=ids.device)
        out.copy_(ids.permute(1, 0, 2))
        if self.fallback.any():
            out[:, torch.from_numpy(self.fallback.astype(np.bool_)).to(ids.device)] = MISSING_ROUTE
        return list(out.unbind(0))

    def replay_mask(self):
        """`(m,)` bool: False where the router must choose itself (`fallback`), True where the ids are to be replayed.

        verl 0.9.1's `set_router_replay_data(..., replay_mask=)` takes this meaning: masked tokens
        replay, unmasked ones keep the router's own top-k.
        """
        import torch

        return torch.from_numpy(self.fallback == 0)

    def torch(self):
        """`(m, L_stage, K)` ids as a torch tensor sharing this batch's memory."""
        import torch

        return torch.from_numpy(self.experts)

    def valid_tensor(self):
        """`(m,)` bool: True where the token has a clean recorded row (the loss mask)."""
        import torch

        return torch.from_numpy(self.valid.astype(np.bool_))

    # ---- weight versions ------------------------------------------------------

    def staleness(self, current: str | None = None) -> Staleness:
        """Replayed rows per weight version of this batch; `current`: the trainer's version, for the stale count
        (and the lag in versions, when every label and `current` are integers, e.g. training steps)."""
        replayed = self.weight_version[self.valid.astype(bool)]
        counts = np.bincount(replayed[replayed >= 0].astype(np.int64), minlength=len(self.weight_versions))
        rows = {label: int(n) for label, n in zip(self.weight_versions, counts.tolist()) if n}
        now = None if current is None else _integer(current)
        steps = {label: _integer(label) for label in rows}
        lags: dict[str, int] = {}
        if now is not None and all(v is not None for v in steps.values()):
            lags = {label: now - v for label, v in steps.items() if v is not None}
        return Staleness(rows, int((replayed < 0).sum()), current, lags)

    def versions_tensor(self):
        """`(m,)` int16: each token's index into `weight_versions` (-1: filler or unknown), sharing memory."""
        import torch

        return torch.from_numpy(self.weight_version)

    # ---- verl -------------------------------------------------------------

    def _dense_shape(self) -> tuple[int, int]:
        return self.layout.sequences, self.layout.seq_length

    def dense(self):
        """verl: `[batch, prompt_width + response_width, L, K]` (a view, run dtype; `.long()` for int64)."""
        import torch

        return torch.from_numpy(self.experts).view(*self._dense_shape(), *self.experts.shape[1:])

    def mask(self):
        """verl: `[batch, seq]` bool, True where the token has a recorded row."""
        import torch

        return torch.from_numpy(self.valid.astype(np.bool_)).view(*self._dense_shape())

    def dense_versions(self):
        """verl: `[batch, seq]` int16 index into `weight_versions` per token (-1: padding, filler, unknown)."""
        return self.versions_tensor().view(*self._dense_shape())

    def dense_replay_mask(self):
        """verl: `[batch, seq]` bool, False where the router must choose itself (missing=router)."""
        return self.replay_mask().view(*self._dense_shape())

    def attention_mask(self):
        """verl: `[batch, seq]` bool, True on every real token (including the last, which has no row)."""
        import torch

        return torch.from_numpy(self.sequence >= 0).view(*self._dense_shape())

    # ---- agreement ----------------------------------------------------------

    def recorded_rows(self, recorded, request_ids: list) -> RecordedRows:
        """Turn `RouterReplay.get_recorded_data()` (RECORD mode, one `[tokens, K]` per layer, this batch's
        token order) into (request ids, positions, experts (n, L, K)) to post to compare: the tokens the rollout
        has a row for (replayed, or left to the router: missing=router). Padding and each sequence's last token
        (sampled, never run through the engine: no row) are left out, so the comparison's `missing_rows` counts
        only rows that are missing."""
        import torch

        ids = torch.stack([t.detach().to("cpu", torch.int64) for t in recorded], dim=1).numpy()
        real = (self.sequence >= 0) & ((self.valid != 0) | (self.fallback != 0))
        names = [r["request"] if isinstance(r, dict) else r if isinstance(r, str) else r[1] for r in request_ids]
        reqs = [names[i] for i in self.sequence[real].tolist()]
        return RecordedRows(reqs, self.position[real], ids[real])


def sequence_refs(sequences: Iterable) -> tuple[SequenceRef, ...]:
    """(run, request) tuples, or dicts with run, request and optional start / num_tokens.

    ValueError for a dict with another field (the service would refuse it: an unknown field is never ignored).
    """
    refs = []
    for s in sequences:
        if isinstance(s, dict):
            unknown = sorted(set(s) - SEQUENCE_FIELDS)
            if unknown:
                raise ValueError(f"a sequence has fields {', '.join(map(str, unknown))}; it takes "
                                 f"{', '.join(sorted(SEQUENCE_FIELDS))}")
            refs.append(SequenceRef(s["run"], s["request"], s.get("start", 0), s.get("num_tokens")))
        else:
            refs.append(SequenceRef(s[0], s[1]))
    return tuple(refs)


def _layers(moe_ordinals: Sequence[int] | None, model_layer_range: tuple[int, int] | None,
            layer_axis: LayerAxis | str) -> StageLayers:
    """This pipeline stage's layers and the axis they are held on."""
    ordinals = None if moe_ordinals is None else tuple(int(x) for x in moe_ordinals)
    stage_range = None
    if model_layer_range is not None:
        lo, hi = model_layer_range
        stage_range = (int(lo), int(hi))
    return StageLayers(ordinals, stage_range, LayerAxis(layer_axis))


def _missing(missing: MissingPolicy | str | None, strict: bool | None) -> MissingPolicy:
    """The missing-row policy asked for (strict by default); `strict=` is its older alias, never given with it."""
    if strict is not None:
        if missing is not None:
            raise ValueError("give missing= only (strict= is its older alias)")
        return strict_alias(strict)
    return MissingPolicy(missing or MissingPolicy.STRICT)


def megatron_query(
    sequences: Iterable,
    packing: Packing | str = Packing.THD,
    *,
    convention: Convention | str | None = None,
    pad_multiple: int | None = None,
    total_multiple: int | None = None,
    total_pad: TotalPad | str | None = None,
    cp_split: CpSplit | str = CpSplit.ZIGZAG,
    data_pad_size_multiplier: int | None = None,
    fp8_padding: bool | None = None,
    seq_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = True,
    moe_ordinals: Sequence[int] | None = None,
    model_layer_range: tuple[int, int] | None = None,
    layer_axis: LayerAxis | str = LayerAxis.MOE,
    missing: MissingPolicy | str | None = None,
    strict: bool | None = None,
    versions: VersionPolicy | str = VersionPolicy.ANY,
) -> MegatronQuery:
    """The query of `POST /v1/trainer/megatron` for one rank (its body: `to_json()`).

    `convention` ("verl", "slime", "miles") pads as that trainer does (with its knobs
    `fp8_padding` / `data_pad_size_multiplier`); otherwise `pad_multiple`, `total_multiple`
    and `total_pad` say it. `cp_split="contiguous"` is slime/miles `--allgather-cp`.
    `tp_size` is the TP size, the tokens split over it when `sequence_parallel`.
    `moe_ordinals` (MoE ordinals) or `model_layer_range` ([lo, hi) of model layers) names this
    pipeline stage's layers; `layer_axis="model"` holds every model layer, dense ones zero.
    `missing`: "strict" (default), "router" or "filler" (`strict=` is its older alias).
    `versions="single"`: refuse (409) sequences whose rows mix weight versions.
    """
    return MegatronQuery(
        sequences=sequence_refs(sequences), packing=Packing(packing), cp_split=CpSplit(cp_split), cp_size=cp_size,
        cp_rank=cp_rank, tp_size=tp_size, tp_rank=tp_rank, sequence_parallel=bool(sequence_parallel),
        convention=None if convention is None else Convention(convention), pad_multiple=pad_multiple,
        total_multiple=total_multiple, total_pad=None if total_pad is None else TotalPad(total_pad),
        data_pad_size_multiplier=data_pad_size_multiplier, fp8_padding=fp8_padding, seq_length=seq_length,
        layers=_layers(moe_ordinals, model_layer_range, layer_axis), missing=_missing(missing, strict),
        versions=VersionPolicy(versions),
    )


def verl_query(
    sequences: Iterable,
    prompt_lengths: Sequence[int],
    prompt_width: int,
    response_width: int,
    *,
    moe_ordinals: Sequence[int] | None = None,
    model_layer_range: tuple[int, int] | None = None,
    layer_axis: LayerAxis | str = LayerAxis.MOE,
    missing: MissingPolicy | str | None = None,
    strict: bool | None = None,
    versions: VersionPolicy | str = VersionPolicy.ANY,
) -> VerlQuery:
    """The query of `POST /v1/trainer/verl`: dense `[batch, prompt_width + response_width]` (its body: `to_json()`).

    verl's `set_router_replay_data` wants every layer (it picks each stage's itself): leave the
    stage fields unset; `layer_axis="model"` gives `num_hidden_layers` layers, as vLLM does.
    """
    return VerlQuery(
        sequences=sequence_refs(sequences), prompt_lengths=tuple(int(p) for p in prompt_lengths),
        prompt_width=prompt_width, response_width=response_width,
        layers=_layers(moe_ordinals, model_layer_range, layer_axis), missing=_missing(missing, strict),
        versions=VersionPolicy(versions),
    )


def compare_body(run_id: str, shape: RunShape, request_ids, positions, experts) -> bytes:
    """The body of POST /v1/runs/{run}/compare (compare.md): the trainer's top-k `(n, L, K)` per (request, position).

    ValueError (a FormatError) when `experts` is not `(n, num_moe_layers, top_k)` ids of the run.
    """
    return build_compare_body(shape, list(request_ids), positions, experts, run_id=run_id)


__all__ = ["Staleness", "TrainerBatch", "compare_body", "megatron_query", "sequence_refs", "verl_query"]
