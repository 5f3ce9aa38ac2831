"""A route answer as the client hands it out: `Route`, viewing the received body (replay_format/route.md).

`routes_from_stream` turns a route answer into `Route`s whose arrays view the body (no copy, writable so
`torch.from_numpy` wraps them without one either); `npy_view` does the same for a `.npy` answer.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay_format import LayerAxis, ReplayDeprecationWarning, flag_names
from replay_format.core import Backing
from replay_format.route import read_routes
from replay_format.trajectory import TrajectoryInfo
from replay_format.weight_versions import RecomputeRule, WeightVersions

__all__ = ["Route", "npy_view", "routes_from_stream"]


@dataclass
class Route:
    """A route as the service answers it: one request's rows `[start, start + n)`, dense by position (a missing one
    is a GAP row), with what the answer says of them (the run's shape, the layer axis, which computation of a
    recomputed position was served), or a trajectory's turns as one route (`get_trajectory`: `trajectory`, `turn`).

    The answer's per-request part alone is the format's `replay_format.route.RequestRoute`; `routes_from_stream`
    joins each to the answer's metadata. `experts` holds the layers of `layer_axis`: the run's MoE layers (`moe`),
    or every model layer with dense ones zero (`model`: vLLM's `routed_experts` layout); `layers` names each.
    """

    run_id: str
    request_id: str
    positions: np.ndarray  # int32 (n,)
    experts: np.ndarray  # (n, len(layers), K) uint8/uint16
    flags: np.ndarray  # uint16 (n,)
    token_ids: np.ndarray  # int32 (n,), replay_format.NO_TOKEN (-1) where unknown
    num_experts: int
    moe_layers: tuple[int, ...]  # model-layer index of each of the run's MoE layers
    layer_axis: LayerAxis = LayerAxis.MOE
    num_hidden_layers: int = 0  # the model's layer count (0: not said; max(moe_layers) + 1)
    weight_versions: WeightVersions | None = None  # which weights computed each row; None: none known
    recompute: RecomputeRule = RecomputeRule.FIRST  # which computation of a recomputed position was served
    trajectory: TrajectoryInfo | None = None  # `get_trajectory`: the turns and which one each row came from

    def __post_init__(self) -> None:
        self.layer_axis = LayerAxis(self.layer_axis)
        self.recompute = RecomputeRule(self.recompute)
        self.num_hidden_layers = self.num_hidden_layers or (self.moe_layers[-1] + 1 if self.moe_layers else 0)

    @property
    def layers(self) -> tuple[int, ...]:
        """The model-layer index of each layer of `experts`, in order."""
        if self.layer_axis == LayerAxis.MODEL:
            return tuple(range(self.num_hidden_layers))
        return self.moe_layers

    @property
    def clean(self) -> bool:
        """True when no row carries a flag."""
        return not self.flags.any()

    def flagged_rows(self) -> list[tuple[int, list[str]]]:
        """(position, flag names) of every flagged row."""
        return [(int(self.positions[i]), flag_names(int(self.flags[i]))) for i in np.flatnonzero(self.flags)]

    def versions(self) -> WeightVersions:
        """Each row's weight version (unknown: rows written before versions existed, GAP rows), as the format's and
        the store's routes give it; `.per_row()` lists the labels (None where unknown).

        For one release the answer also reads as that list, as it was (`==` a list, iteration, indexing, `len`),
        with a DeprecationWarning naming `.per_row()`.
        """
        versions = WeightVersions.unknown(len(self.positions)) if self.weight_versions is None else self.weight_versions
        return _ListedVersions(versions.labels, versions.index)

    @property
    def turn(self) -> np.ndarray | None:
        """A trajectory's rows: int32 per row, the index into `trajectory.turns` of the turn it came from (-1: a GAP
        row); None for one request's route."""
        return None if self.trajectory is None else self.trajectory.turn_index(self.positions)

    def torch(self):
        """The ids as a torch tensor sharing this route's memory (uint8/uint16)."""
        import torch

        return torch.from_numpy(self.experts)


@dataclass(frozen=True, eq=False)
class _ListedVersions(WeightVersions):
    """`Route.versions()`: a `WeightVersions` that also reads, deprecated, as the `list[str | None]` of labels
    `Route.versions()` answered before (one release)."""

    def _listed(self, what: str) -> list[str | None]:
        warnings.warn(f"Route.versions() answers a WeightVersions: {what} it as a list of labels is deprecated; use "
                      "Route.versions().per_row()", ReplayDeprecationWarning, stacklevel=3)
        return self.per_row()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WeightVersions):
            return self.per_row() == other.per_row()
        if isinstance(other, list | tuple):
            return self._listed("comparing") == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as WeightVersions' (its index is an array)

    def __iter__(self) -> Iterator[str | None]:
        return iter(self._listed("iterating"))

    def __getitem__(self, row: Any) -> Any:
        return self._listed("indexing")[row]

    def __len__(self) -> int:
        self._listed("taking the len() of")
        return self.num_rows


def npy_view(body: Backing) -> np.ndarray:
    """A `.npy` answer as a writable array viewing `body` (np.load would copy it twice)."""
    header = io.BytesIO(bytes(body[:4096]))  # header: magic, version, a padded dict; never near 4 KiB
    version = np.lib.format.read_magic(header)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(header)
    if dtype.hasobject:
        raise ValueError(".npy answer holds Python objects")
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(body, dtype, count, offset=header.tell())
    return flat.reshape(shape, order="F" if fortran_order else "C")


def routes_from_stream(backing: Backing) -> list[Route]:
    """A route answer (route.md) as `Route`s whose arrays view `backing`."""
    meta, routes = read_routes(backing)
    return [Route(meta.run_id, r.request_id, r.positions, r.experts, r.flags, r.token_ids, meta.shape.num_experts,
                  meta.shape.moe_layers, meta.layer_axis, meta.shape.num_hidden_layers, r.weight_versions,
                  meta.recompute) for r in routes]
