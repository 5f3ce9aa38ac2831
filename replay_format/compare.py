"""Comparisons of a trainer's routing with the recorded one (spec: compare.md).

Two messages: the **compare body** a trainer posts (a row batch, rows.md, whose metadata may leave out
what the URL already says: `build_compare_body` / `read_compare_body`), and the **stored comparison
file** the service keeps per comparison (per request: the positions compared and a bit-packed
`(n, num_moe_layers)` mismatch matrix: `encode_compare_file` / `read_compare_file`).
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replay_format import rows
from replay_format.core import Flag, FormatError, FormatVersion, RunShape, Source, UndecodableError
from replay_format.rows import Rows, RowsMeta

FORMAT = "routing-replay.compare"
VERSION = FormatVersion(1, 0)
# A file without a `meta` entry was written before this spec: the same p<i>/m<i> arrays, with its
# request ids and MoE layer count kept only in the service's index. Read as such.
LEGACY_VERSION = FormatVersion(0, 0)
TRAINER_WRITER = "trainer"  # writer_id and seq a compare body stands for when it names none
TRAINER_SEQ = 0


# ---- the compare body (a row batch) -------------------------------------------------------------


def build_compare_body(shape: RunShape, request_ids: Sequence[str], positions, experts,
                       run_id: str | None = None) -> bytes:
    """The body of `POST /v1/runs/{run}/compare`: the trainer's own top-k `(n, L, K)`, one row per (request, position).

    FormatError (a ValueError) when `experts` is not `(n, num_moe_layers, top_k)` ids of the run.
    """
    ids = np.asarray(experts)
    if ids.ndim != 3 or ids.shape[1:] != (shape.num_moe_layers, shape.top_k):
        raise FormatError(f"experts must be (n, {shape.num_moe_layers}, {shape.top_k}), got {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        raise FormatError(f"ids must be in 0..{shape.num_experts - 1}")
    meta = RowsMeta(run_id or "", TRAINER_WRITER, TRAINER_SEQ, shape, Source.TRAINER)
    md = meta.to_metadata()
    if run_id is None:
        del md["run_id"]  # the URL names the run
    batch = rows.build_rows(shape, list(request_ids), np.asarray(positions), ids.astype(shape.dtype),
                            flags=np.zeros(len(ids), np.uint16), metadata=md)
    return rows.encode_stream(batch)


def read_compare_body(body: bytes | memoryview, run_id: str, shape: RunShape) -> Rows:
    """A compare body posted to run `run_id` of `shape`, validated; rows marked PADDING are kept (callers skip them).

    The metadata follows rows.md, except that `run_id` (if given, it must be `run_id`), `writer_id`
    and `seq` may be left out. UndecodableError when the body is not Arrow, ShapeMismatch when its
    rows have another shape than the run's, FormatError for the rest (an id >= num_experts included).
    """
    table, md = rows.read_stream(body)
    given = md.get("run_id", run_id)
    if given != run_id:
        raise FormatError(f"schema metadata run_id={given!r} but the comparison is posted to run {run_id!r}")
    meta = RowsMeta.from_metadata({"writer_id": TRAINER_WRITER, "seq": str(TRAINER_SEQ),
                                   "source": Source.TRAINER.value, **md, "run_id": run_id})
    if not same_shape(meta.shape, shape):
        raise ShapeMismatch(meta.shape, shape, run_id)
    body_rows = rows.read_rows(table, RowsMeta(run_id, meta.writer_id, meta.seq, shape, meta.source, meta.version))
    usable = (body_rows.flags & Flag.PADDING) == 0
    if usable.any() and int(body_rows.experts[usable].max()) >= shape.num_experts:
        raise FormatError(f"the trainer's rows hold an id >= num_experts={shape.num_experts}")
    return body_rows


def same_shape(a: RunShape, b: RunShape) -> bool:
    """Layers x top-k of the same expert count (which model layers they are is the run's to say)."""
    return (a.num_moe_layers, a.top_k, a.num_experts) == (b.num_moe_layers, b.top_k, b.num_experts)


class ShapeMismatch(FormatError):
    """A compare body whose rows have another shape than the run's (the service answers it as a conflict)."""

    def __init__(self, given: RunShape, run: RunShape, run_id: str) -> None:
        super().__init__(
            f"the trainer's rows are {given.num_moe_layers} layers x top-{given.top_k} of {given.num_experts} "
            f"experts; run {run_id!r} records {run.num_moe_layers} x top-{run.top_k} of {run.num_experts}")


# ---- the stored comparison file -----------------------------------------------------------------


@dataclass
class RequestMismatch:
    """One request of a comparison: the positions compared and, per position and MoE layer, whether the sets differ."""

    request_id: str
    positions: np.ndarray  # int32 (n,), increasing
    mismatch: np.ndarray  # bool (n, num_moe_layers)


@dataclass(frozen=True)
class CompareFileMeta:
    """The `meta` entry of a stored comparison file (compare.md, "Stored comparison file")."""

    run_id: str
    compare_id: str
    num_moe_layers: int
    request_ids: tuple[str, ...]
    version: FormatVersion = VERSION

    def to_metadata(self) -> dict:
        """The JSON object stored as the file's `meta` entry (always the current version)."""
        return {"format": FORMAT, "format_version": str(VERSION), "run_id": self.run_id,
                "compare_id": self.compare_id, "num_moe_layers": self.num_moe_layers,
                "request_ids": list(self.request_ids)}

    @classmethod
    def from_metadata(cls, md: dict) -> CompareFileMeta:
        """Parse and validate a `meta` object; FormatError naming the bad key or a newer major version."""
        what = "stored comparison"
        if md.get("format") != FORMAT:
            raise FormatError(f"{what}: meta format={md.get('format')!r}, expected {FORMAT!r}")
        version = FormatVersion.parse(str(md.get("format_version", "")), what).check(what, VERSION)
        try:
            layers = int(md["num_moe_layers"])
            request_ids = tuple(str(r) for r in md["request_ids"])
            return cls(str(md["run_id"]), str(md["compare_id"]), layers, request_ids, version)
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: meta lacks or garbles {exc}") from None


def encode_compare_file(meta: CompareFileMeta, items: Sequence[RequestMismatch]) -> bytes:
    """The file's bytes: a `.npz` with the `meta` entry and `p<i>` / `m<i>` per request, in `meta.request_ids` order."""
    if [item.request_id for item in items] != list(meta.request_ids):
        raise FormatError("stored comparison: items must follow meta.request_ids")
    arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta.to_metadata()))}
    for i, item in enumerate(items):
        if item.mismatch.shape != (len(item.positions), meta.num_moe_layers):
            raise FormatError(f"stored comparison: request {item.request_id!r} mismatch is {item.mismatch.shape}, "
                              f"expected ({len(item.positions)}, {meta.num_moe_layers})")
        arrays[f"p{i}"] = np.asarray(item.positions, np.int32)
        arrays[f"m{i}"] = np.packbits(item.mismatch.astype(np.bool_), axis=1)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub takes the dict of arrays as keywords
    return buf.getvalue()


def read_compare_file(source: Path | bytes, request_id: str, legacy: CompareFileMeta) -> RequestMismatch:
    """One request's mismatch from a stored comparison file.

    `legacy` names the file's run, id, MoE layer count and requests as the service's index
    remembers them: used for a file without a `meta` entry (LEGACY_VERSION) and checked against
    one with it. FormatError when the file breaks compare.md; KeyError when it holds no such request.
    """
    fp = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
    what = f"stored comparison {legacy.compare_id!r}"
    try:
        with np.load(fp, allow_pickle=False) as data:
            meta = CompareFileMeta.from_metadata(json.loads(str(data["meta"]))) if "meta" in data.files else legacy
            if meta.request_ids != legacy.request_ids or meta.num_moe_layers != legacy.num_moe_layers:
                raise FormatError(f"{what}: the file and the index disagree on its requests or layers")
            if request_id not in meta.request_ids:
                raise KeyError(request_id)
            i = meta.request_ids.index(request_id)
            if f"p{i}" not in data.files or f"m{i}" not in data.files:
                raise FormatError(f"{what}: the file lacks the arrays of request {request_id!r}")
            positions = data[f"p{i}"]
            packed = data[f"m{i}"]
    except (OSError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise UndecodableError(f"{what} is not a readable .npz: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{what}: {exc}") from None
    if packed.dtype != np.uint8 or packed.shape != (len(positions), (meta.num_moe_layers + 7) // 8):
        raise FormatError(f"{what}: m{i} is {packed.dtype} {packed.shape}, not the packed bits of "
                          f"{len(positions)} positions x {meta.num_moe_layers} layers")
    bits = np.unpackbits(packed, axis=1, count=meta.num_moe_layers)
    return RequestMismatch(request_id, positions.astype(np.int32, copy=False), bits.astype(np.bool_))


__all__ = [
    "FORMAT", "VERSION", "LEGACY_VERSION", "CompareFileMeta", "RequestMismatch", "ShapeMismatch",
    "build_compare_body", "read_compare_body", "same_shape", "encode_compare_file", "read_compare_file",
]
