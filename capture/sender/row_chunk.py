"""Rows on their way through the sender: one call's rows, copied and typed, until they are batched (no torch).

`RouteSender.submit` makes one `RowChunk` per call (`RowChunk.of`: the caller's buffers are reused
next step, so it copies); the batcher merges consecutive chunks into one row batch's columns
(`RowChunk.merged`), their small request dictionaries into one, and their weight versions (one label per
call: a step's rows ran under one) into the batch's `weight_version` column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from replay_format import NO_TOKEN
from replay_format.weight_versions import WeightVersions


@dataclass(frozen=True)
class RequestIndex:
    """Rows' request ids as a small dictionary: `names`, and per row an index into it (what a step already has)."""

    names: list[str]
    index: np.ndarray  # int32 [n]

    def to_arrow(self) -> pa.DictionaryArray:
        """The `request_id` column of a row batch (rows.md)."""
        return pa.DictionaryArray.from_arrays(pa.array(self.index), pa.array(self.names, pa.utf8()))


@dataclass(frozen=True)
class RowChunk:
    """Rows submitted together, in the run's dtypes (rows.md's columns, before Arrow)."""

    requests: RequestIndex
    positions: np.ndarray  # int32 [n]
    experts: np.ndarray  # [n, num_moe_layers * top_k] in the run's expert dtype
    token_ids: np.ndarray  # int32 [n], NO_TOKEN where unknown
    flags: np.ndarray  # uint16 [n]
    versions: WeightVersions  # the weights each row was computed with (unknown where the writer did not say)

    @property
    def num_rows(self) -> int:
        """Rows in the chunk."""
        return len(self.positions)

    @classmethod
    def of(cls, request_ids: str | RequestIndex | Sequence[str], positions, experts, token_ids, flags,
           expert_dtype: np.dtype, weight_version: str | None = None) -> RowChunk:
        """Copies of the caller's rows (`RouteSender.submit` says what each argument may be); ValueError when the
        request ids do not match the rows, FormatError (a ValueError) when `weight_version` is not a label."""
        n = len(positions)
        if isinstance(request_ids, str):
            requests = RequestIndex([request_ids], np.zeros(n, np.int32))
        elif isinstance(request_ids, RequestIndex):
            requests = RequestIndex(list(request_ids.names), np.array(request_ids.index, np.int32))
        else:
            encoded = pa.array(list(request_ids), pa.utf8()).dictionary_encode()
            requests = RequestIndex(encoded.dictionary.to_pylist(),
                                    encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32))
        if len(requests.index) != n:
            raise ValueError(f"{len(requests.index)} request ids for {n} rows")
        return cls(
            requests,
            np.array(positions, np.int32),
            np.array(experts, expert_dtype).reshape(n, -1),
            np.full(n, NO_TOKEN, np.int32) if token_ids is None else np.array(token_ids, np.int32),
            np.zeros(n, np.uint16) if flags is None else np.array(flags, np.uint16),
            WeightVersions.unknown(n) if weight_version is None else WeightVersions.single(weight_version, n),
        )

    @classmethod
    def merged(cls, chunks: Sequence[RowChunk]) -> RowChunk:
        """The chunks' rows in order, as one chunk with one request dictionary."""
        codes: dict[str, int] = {}
        indices = []
        for chunk in chunks:
            remap = np.array([codes.setdefault(name, len(codes)) for name in chunk.requests.names], np.int32)
            indices.append(remap[chunk.requests.index])
        return cls(
            RequestIndex(list(codes), np.concatenate(indices)),
            np.concatenate([c.positions for c in chunks]),
            np.concatenate([c.experts for c in chunks]),
            np.concatenate([c.token_ids for c in chunks]),
            np.concatenate([c.flags for c in chunks]),
            WeightVersions.concat(c.versions for c in chunks),
        )
