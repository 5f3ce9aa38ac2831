"""CPU of each ingest stage, in one thread, without HTTP: where a batch's service CPU goes (bench/ingest.py's
"where the CPU went" says how much there is).

The same batches as `bench/ingest.py` (48 x top-8 uint8 rows, requests of 1024 tokens) go through the stages of
`replay_service/ingest/pipeline.py` one by one, on a store opened as `serve` opens it (fsync on), each timed with
`time.thread_time` (this thread's CPU: waits on the disk are not counted):

    decode (the body to Rows) -> check (flags, hashes, expert load: checks/kernels.py) -> duplicate lookup
    -> STALE check -> segment (image, CRC, O_DIRECT write, fsync) -> commit (index, folder fsync)

and, beside them, the check's compiled kernel alone (`check_rows`) and a pass that only hashes the rows' words and
one that only counts the expert load, the two parts of its work that every row needs.

    python bench/ingest_stages.py [--rows 8192 16384 32768] [--batches 16] [--rounds 3]

Prints medians over every batch of every round, per batch and per row; the last line is JSON. Asserts nothing.
With two or more batch sizes it also splits each stage's CPU into what a batch costs whatever its rows and what each
row adds (a least-squares line through the sizes' medians): the first is what larger batches amortise, the second
what no batch size does (in CPU-s per GB of rows too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/ingest_stages.py` from anywhere
    sys.path.insert(0, ROOT)

import numba
import numpy as np

from bench.ingest import SHAPE, arrow_jobs, make_batches
from bench.stopping import exit_on_sigterm
from replay_format import ARROW_STREAM_MEDIA_TYPE
from replay_service.app import open_store
from replay_service.checks.check import check, check_stale
from replay_service.checks.kernels import _FNV_OFFSET, _FNV_PRIME, check_rows
from replay_service.ingest.decode import decode_batch
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ops.demo import bulk_routes
from replay_service.settings import ServiceSettings

T = TypeVar("T")
STAGES = ("decode", "check", "duplicate lookup", "STALE check", "segment", "commit")


@numba.njit(nogil=True, cache=True)
def _hash_words(words):  # pragma: no cover - compiled; the FNV-1a of check_rows, nothing else
    out = np.empty(words.shape[0], np.uint64)
    for r in range(words.shape[0]):
        h = _FNV_OFFSET
        for w in range(words.shape[1]):
            h = (h ^ words[r, w]) * _FNV_PRIME
        out[r] = h
    return out


@numba.njit(nogil=True, cache=True)
def _count_load(experts, num_moe_layers, top_k, load):  # pragma: no cover - compiled; check_rows' load, alone
    for r in range(experts.shape[0]):
        for layer in range(num_moe_layers):
            base = layer * top_k
            for j in range(top_k):
                load[layer, experts[r, base + j]] += 1


def cpu_of(call: Callable[..., T], *args: Any) -> tuple[float, T]:
    """This thread's CPU seconds for `call(*args)`, and what it returned."""
    started = time.thread_time()
    result = call(*args)
    return time.thread_time() - started, result


def stage_times(rows_per_batch: int, batches: int, rounds: int, tmp: Path) -> dict[str, list[float]]:
    """CPU seconds per batch of every stage, over `rounds` runs of `batches` batches."""
    ids = bulk_routes(rows_per_batch * batches, 0)
    planned = make_batches(ids, rows_per_batch, 1024)
    times: dict[str, list[float]] = {name: [] for name in (*STAGES, "kernel", "kernel: hash", "kernel: load")}
    store = open_store(ServiceSettings(data_dir=tmp / f"data-{rows_per_batch}"))
    try:
        pipeline = IngestPipeline.over(store)
        shape = SHAPE
        for r in range(rounds):
            for _, body, _ in arrow_jobs(planned, f"stages-{rows_per_batch}-{r}", 1):
                spent, rows = cpu_of(decode_batch, ARROW_STREAM_MEDIA_TYPE, body)
                times["decode"].append(spent)
                run = pipeline.runs.for_batch(rows.meta)
                spent, checked = cpu_of(check, rows, run.shape)
                times["check"].append(spent)
                spent, duplicate = cpu_of(pipeline.committer.find_duplicate, checked)
                times["duplicate lookup"].append(spent)
                assert duplicate is None
                times["STALE check"].append(cpu_of(check_stale, checked, pipeline.recent)[0])
                spent, segment = cpu_of(pipeline.segments.write, checked)
                times["segment"].append(spent)
                times["commit"].append(cpu_of(pipeline.committer.commit, segment, run)[0])

                experts = rows.experts.reshape(rows.num_rows, -1)
                load = np.zeros((shape.num_moe_layers, shape.num_experts), np.int64)
                skip = np.zeros(rows.num_rows, np.bool_)
                times["kernel"].append(cpu_of(check_rows, experts, shape.num_moe_layers, shape.top_k,
                                              shape.num_experts, skip, load)[0])
                words = np.ascontiguousarray(experts).view(np.uint64)
                times["kernel: hash"].append(cpu_of(_hash_words, words)[0])
                times["kernel: load"].append(cpu_of(_count_load, experts, shape.num_moe_layers, shape.top_k, load)[0])
        pipeline.close()
    finally:
        store.close()
    return times


def split(medians: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per stage, its CPU per batch as `per_batch_ms + rows * per_row_ns`: a least-squares line through the medians
    of each batch size (`medians[rows][stage]`, seconds; at least two sizes)."""
    sizes = np.array(sorted(medians), np.float64)
    out: dict[str, dict[str, float]] = {}
    for name in (*STAGES, "kernel", "kernel: hash", "kernel: load"):
        seconds = np.array([medians[int(n)][name] for n in sizes])
        per_row, per_batch = np.polyfit(sizes, seconds, 1)
        out[name] = {"per_batch_ms": round(per_batch * 1e3, 3), "per_row_ns": round(per_row * 1e9, 1)}
    return out


def print_split(parts: dict[str, dict[str, float]]) -> None:
    """`split`'s figures, and the stages' sum: ms a batch, ns a row, and that row cost in CPU-s per GB of rows."""
    print("what a batch costs whatever its rows, and what each row adds (a line through the sizes' medians):")
    for name, part in parts.items():
        print(f"  {name:<18} {part['per_batch_ms']:7.2f} ms a batch + {part['per_row_ns']:5.0f} ns a row")
    batch = sum(parts[name]["per_batch_ms"] for name in STAGES)
    row = sum(parts[name]["per_row_ns"] for name in STAGES)
    print(f"  the stages         {batch:7.2f} ms a batch + {row:5.0f} ns a row ({row / SHAPE.row_width:.2f} CPU-s per "
          f"GB of {SHAPE.row_width}-byte rows, at any batch size)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 16384, 32768],
                        help="rows per batch (the sink ships 16384)")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    words = np.zeros((1, SHAPE.num_moe_layers), np.uint64)
    _hash_words(words)  # compiled before anything is timed
    _count_load(np.zeros((1, SHAPE.row_width), np.uint8), SHAPE.num_moe_layers, SHAPE.top_k,
                np.zeros((SHAPE.num_moe_layers, SHAPE.num_experts), np.int64))
    figures = {}
    all_medians: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for rows in args.rows:
            times = stage_times(rows, args.batches, args.rounds, Path(tmp))
            medians = all_medians[rows] = {name: statistics.median(values) for name, values in times.items()}
            total = sum(medians[name] for name in STAGES)
            print(f"{rows}-row batches of {SHAPE.num_moe_layers} x top-{SHAPE.top_k} uint8 rows, CPU of this thread "
                  f"(medians of {len(times['decode'])} batches): {total * 1e3:.2f} ms per batch, "
                  f"{total / rows * 1e9:.0f} ns per row")
            for name, value in medians.items():
                share = f"{value / total:4.0%}" if name in STAGES else "    "
                print(f"  {name:<18} {value * 1e3:7.2f} ms  {value / rows * 1e9:5.0f} ns/row  {share}")
            figures[rows] = {name: round(value / rows * 1e9, 1) for name, value in medians.items()}
    report: dict[str, Any] = {"ns_per_row": figures}
    if len(all_medians) > 1:
        report["split"], report["row_bytes"] = split(all_medians), SHAPE.row_width
        print_split(report["split"])
    print(json.dumps(report))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
