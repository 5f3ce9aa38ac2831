"""Per-step capture cost on CPU: restore_rows over gloo TP=2, the StepRecorder, and the sender's enqueue.

restore_rows: an 8192-token step of top-8 int32 ids (vLLM's topk dtype) on 2 gloo ranks
(TP=2), x48 MoE layers = one step; next to it the bare all_gather of the same shard (the
collective floor) in the same run. Recorder: record 48 layers of 8192 x top-8 + end_step.
Enqueue: RouteSender.submit of that step's rows (what the forward pass pays; the sending
itself runs on the sender's threads against a real service process).
vLLM step: the plugin's per-step hooks (`StepHooks`: execute, step open, router
callbacks, step close and hand-off to a real sink process and service) on a stand-in
runner, decode steps of the tests' toy model (8 sequences, 2 layers, top-2 of 8) and of
`--model small` (16 sequences, 8 layers, top-4 of 32), outside the engine: the fixed
per-step cost without the engine's noise, each step timed (median and quartiles of
`--steps` x `--repeats` steps), then per part (`capture/vllm/worker/step_profile.py`).
Spill (`--only spill`): the sender's spill of one step's batch (`SpillFolder.write`: the file written and fsynced,
renamed, the folder fsynced), beside the same write without the folder's fsync, alternated, in `BENCH_TMP`.
Medians of several repeats; prints figures, asserts nothing (shared, noisy machines).

    python bench/capture.py [--tokens 8192] [--layers 48] [--repeats 7] [--only vllm-step|spill]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.stopping import exit_on_sigterm
from capture import RowSharding, StepRecorder, Strategy, restore_rows
from capture.worker.restore import gather_single
from replay_format import RunShape

K = 8


def _median_step(fn, layers: int, repeats: int) -> float:
    """Median seconds for `layers` calls of fn."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(layers):
            fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _restore_worker(rank: int, init_file: str, tokens: int, layers: int, repeats: int, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    rows = {}
    for label, n, strategy in (
        (f"alltoall {tokens} (even split)", tokens, Strategy.ALLTOALL),
        (f"alltoall {tokens - 1} (uneven split)", tokens - 1, Strategy.ALLTOALL),
        (f"mc2 {tokens}", tokens, Strategy.MC2),
        (f"sequence_parallel {tokens}", tokens, Strategy.SEQUENCE_PARALLEL),
    ):
        batch = torch.randint(0, 128, (n, K), generator=g, dtype=torch.int32)
        sharding = RowSharding(num_tokens=n, strategy=strategy, tp_size=2, tp_rank=rank)
        pad = sharding.plan().tp_sizes
        shard = torch.tensor_split(torch.cat([batch, batch.new_full((max(0, sum(pad) - n), K), -1)]), 2)[rank]
        got = restore_rows(shard, sharding)
        assert torch.equal(got, batch), label
        rows[label] = _median_step(lambda s=shard, sh=sharding: restore_rows(s, sh), layers, repeats)
    half = torch.randint(0, 128, (tokens // 2, K), generator=g, dtype=torch.int32)
    buf = half.new_empty((tokens, K))
    rows["bare all_gather (floor)"] = _median_step(lambda: gather_single(buf, half, None), layers, repeats)
    # PCP=2 over the same two ranks: the mask gather plus the padding drop and restore index.
    chunk = tokens // 2 + 3
    mask = torch.zeros(chunk, dtype=torch.bool)
    mask[-3:] = True
    gathered = torch.randint(0, 128, (2 * chunk, K), generator=g, dtype=torch.int32)
    real = torch.cat([torch.arange(chunk - 3), torch.arange(chunk, 2 * chunk - 3)])
    index = real[torch.randperm(real.numel(), generator=torch.Generator().manual_seed(1))]
    lay = RowSharding(num_tokens=2 * chunk - 6, strategy=Strategy.LOCAL, pcp_size=2, pcp_rank=rank)
    rows[f"pcp=2 local {2 * chunk - 6} + mask + restore index"] = _median_step(
        lambda: restore_rows(gathered, lay, pcp_group=None, pcp_padding=mask, pcp_restore_index=index), layers, repeats
    )
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def bench_restore(tokens: int, layers: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix="bench_gloo_")
    os.close(fd)
    os.unlink(init_file)
    out = ctx.Queue()
    procs = [ctx.Process(target=_restore_worker, args=(r, init_file, tokens, layers, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def bench_recorder(tokens: int, layers: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    shape = RunShape(num_moe_layers=layers, top_k=K, num_experts=128)
    rec = StepRecorder(shape, max_tokens=tokens)
    g = torch.Generator().manual_seed(0)
    per_layer = [torch.randint(0, 128, (tokens, K), generator=g, dtype=torch.int32) for _ in range(layers)]
    bad = per_layer[0].clone()
    bad[5, 3] = -1
    request_ids = np.array(["req"] * tokens, dtype=object)
    positions = np.arange(tokens, dtype=np.int32)
    res = {}
    cases = (("clean ids", per_layer, "record"), ("one -1 id per layer", [bad] * layers, "record"),
             ("clean ids", per_layer, "keep"))  # keep: by reference, what the vLLM hook does on CPU
    for label, rows, how in cases:
        rec_t, end_t = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            rec.begin_step()
            for i, r in enumerate(rows):
                getattr(rec, how)(i, r)
            t1 = time.perf_counter()
            step = rec.end_step(request_ids, positions)
            t2 = time.perf_counter()
            rec_t.append(t1 - t0)
            end_t.append(t2 - t1)
        res[(label, how)] = (statistics.median(rec_t[1:]), statistics.median(end_t[1:]), step.stale_rows)
    return res


def bench_enqueue(tokens: int, layers: int, repeats: int) -> tuple[float, dict]:
    from capture.sender import RouteSender, SenderConfig
    from tests.support.service import ServiceProcess

    shape = RunShape(num_moe_layers=layers, top_k=K, num_experts=128)
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 128, (tokens, layers, K), dtype=np.uint8)
    request_ids = [f"req-{i // 512}" for i in range(tokens)]
    tokens_ids = rng.integers(0, 32000, tokens)
    times = []
    with tempfile.TemporaryDirectory() as tmp, ServiceProcess(Path(tmp) / "data") as service:
        sender = RouteSender(SenderConfig(url=service.url, run_id="bench", shape=shape, spill_dir=Path(tmp) / "spill"))
        for step in range(repeats + 1):
            positions = np.arange(tokens, dtype=np.int32) % 512 + step * 512
            t0 = time.perf_counter()
            sender.submit(request_ids, positions, experts, token_ids=tokens_ids)
            times.append(time.perf_counter() - t0)
        sender.close(120)
        stats = sender.stats.as_dict()
    return statistics.median(times[1:]), stats


class _Ns:
    """A stand-in for the attributes the hooks read (vLLM's runner, input batch, CpuGpuBuffer)."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _MoERunner:
    """A stand-in MoERunner: `layer_id` parses the layer name on each read, as vLLM's property does."""

    def __init__(self, layer: int) -> None:
        self.layer_name = f"model.layers.{layer}.mlp.experts"

    @property
    def layer_id(self) -> int:
        return next(int(part) for part in self.layer_name.split(".") if part.isdigit())


def bench_vllm_step(steps: int, blocks: int) -> dict:
    """us per decode step of the plugin's hooks outside the engine (module docstring), median of blocks."""
    from tests.support.service import ServiceProcess

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, ServiceProcess(Path(tmp) / "data") as service:
        return {label: _hook_step(service.url, Path(tmp), label, seqs, layers, k, experts, steps, blocks)
                for label, seqs, layers, k, experts in (("toy", 8, 2, 2, 8), ("small", 16, 8, 4, 32))}


def _hook_step(url: str, tmp, label: str, seqs: int, layers: int, k: int, experts: int, steps: int,
               blocks: int) -> dict:
    from capture.sender import SenderConfig
    from capture.vllm.sink.handoff import StepHandoff
    from capture.vllm.worker.binder import ChainedCapture
    from capture.vllm.worker.forward_sharding import Parallel
    from capture.vllm.worker.frame_buffer import StepFrameBuffer
    from capture.vllm.worker.runner import v1_sampled_counts
    from capture.vllm.worker.step_hooks import StepHooks
    from capture.vllm.worker.step_profile import StepProfile

    shape = RunShape(num_moe_layers=layers, top_k=k, num_experts=experts)
    handoff = StepHandoff(SenderConfig(url=url, run_id=f"bench-{label}", shape=shape, writer_id=label,
                                       spill_dir=tmp / "spill" / label))
    wc = StepHooks(StepRecorder(shape, max_tokens=2048 + 64), Parallel(), {i: i for i in range(layers)},
                   frame=StepFrameBuffer(shape), handoff=handoff)
    wc.local_layers = dict.fromkeys(range(layers), True)
    chains = [ChainedCapture(wc.on_topk, None, _MoERunner(i)) for i in range(layers)]
    wc.moe_ordinal_by_runner = {id(chain.runner): i for i, chain in enumerate(chains)}  # what startup() notes
    runner = _Ns(input_batch=_Ns(num_reqs=seqs, req_ids=[f"req-{i}-0123abcd" for i in range(seqs)]),
                 query_start_loc=_Ns(np=np.arange(2048 + 1, dtype=np.int32)),
                 input_ids=_Ns(gpu=torch.zeros(2048, dtype=torch.int32)))
    positions = torch.zeros(2048, dtype=torch.int64)
    input_ids = torch.zeros(2048, dtype=torch.int32)
    sched = _Ns(finished_req_ids=set())
    g = torch.Generator().manual_seed(0)
    topk = [torch.randint(0, experts, (seqs, k), generator=g, dtype=torch.int32) for _ in range(layers)]

    def run(n: int, step0: int) -> list[int]:
        """n decode steps; each one's hook time in ns (the stand-in's own work is outside the clock)."""
        spent = []
        clock = time.perf_counter_ns
        for step in range(step0, step0 + n):
            positions[:seqs] = 8 + step
            ids, pos = input_ids[:seqs], positions[:seqs]
            fresh = [rows.clone() for rows in topk]  # the router returns a new tensor per layer
            t0 = clock()
            wc.on_execute(sched)
            wc.open_step(runner, ids, pos)
            for chain, rows in zip(chains, fresh):
                chain(rows)
            wc.close_forward()
            wc.on_sampled(None, v1_sampled_counts)
            spent.append(clock() - t0)
        return spent

    run(steps, 0)  # warm-up
    each = sorted(run(steps * blocks, steps))
    profile = StepProfile()
    profile.install(wc, chains)
    run(steps, (blocks + 1) * steps)
    profile.uninstall()
    handoff.close(60.0)
    quartiles = (each[len(each) // 4] / 1e3, each[3 * len(each) // 4] / 1e3)
    return {"us_per_step": statistics.median(each) / 1e3, "quartiles": quartiles, "steps": len(each),
            "parts": profile.report(steps), "seqs": seqs, "layers": layers}


def bench_spill(tokens: int, layers: int, repeats: int, items: int = 20) -> dict[str, list[float]]:
    """Seconds per `SpillFolder.write` of a `tokens`-row batch, with the folder's fsync and without, per repeat."""
    import threading

    import capture.sender.spill as spill
    from capture.sender.items import Item
    from replay_format.spill import ItemKind, SpillHeader

    payload = np.random.default_rng(0).integers(0, 128, tokens * layers * K, dtype=np.uint8).tobytes()
    real = spill.fsync_dir
    out: dict[str, list[float]] = {"with the folder's fsync": [], "without it": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for repeat in range(repeats):
            for label in list(out)[:: 1 if repeat % 2 == 0 else -1]:  # each first in every other repeat
                spill.fsync_dir = real if label == "with the folder's fsync" else (lambda path: None)
                folder = spill.SpillFolder(Path(tmp) / f"{repeat}-{len(out[label])}", 1 << 40, threading.Condition())
                started = time.perf_counter()
                for seq in range(items):
                    folder.write(Item(SpillHeader(ItemKind.BATCH, seq, rows=tokens), payload), "bench")
                out[label].append((time.perf_counter() - started) / items)
    spill.fsync_dir = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", choices=("vllm-step", "spill"), help="run one section")
    ap.add_argument("--steps", type=int, default=500, help="vllm-step: steps per timed block")
    args = ap.parse_args()
    if args.only == "spill":
        print(f"the sender's spill of one {args.tokens}-row batch ({args.tokens * args.layers * K / 1e6:.1f} MB), "
              f"medians of {args.repeats} x 20 writes, alternated")
        results = bench_spill(args.tokens, args.layers, args.repeats)
        for label, secs in results.items():
            print(f"  {label:<24} {1e3 * statistics.median(secs):7.2f} ms a batch (min {1e3 * min(secs):.2f}, max "
                  f"{1e3 * max(secs):.2f})")
        with_, without = (statistics.median(v) for v in results.values())
        print(f"  ratio {with_ / without:.2f}")
        return
    if args.only != "vllm-step":
        main_sections(args)
    print("vLLM plugin hooks per decode step outside the engine (stand-in runner, real sink and service)")
    for label, r in bench_vllm_step(args.steps, args.repeats).items():
        print(f"  {label:<6} {r['seqs']} seqs x {r['layers']} layers: median {r['us_per_step']:6.1f} us/step "
              f"(quartiles {r['quartiles'][0]:.1f}-{r['quartiles'][1]:.1f}, {r['steps']} steps); "
              "parts (median us/call, nested; timing each adds ~0.3 us):")
        for part, v in r["parts"].items():
            print(f"    {part:<22} {v['median_us_per_call']:7.2f} us x {v['calls_per_step']:.2f}/step")


def main_sections(args) -> None:
    """The restore, recorder and enqueue sections."""
    print(f"restore_rows, gloo TP=2 on CPU, {args.tokens} tokens x top-{K} int32, {args.layers} layers/step")
    for label, secs in bench_restore(args.tokens, args.layers, args.repeats).items():
        print(f"  {label:<48} {1e6 * secs / args.layers:9.1f} us/layer {1e3 * secs:9.2f} ms/step")
    print(f"StepRecorder, {args.tokens} tokens x {args.layers} layers x top-{K} (uint8)")
    for (label, how), (rec_s, end_s, stale) in bench_recorder(args.tokens, args.layers, args.repeats).items():
        print(
            f"  {label:<22} {how:<6} x{args.layers} {1e3 * rec_s:7.2f} ms  end_step {1e3 * end_s:6.2f} ms"
            f"  step {1e3 * (rec_s + end_s):7.2f} ms  ({args.tokens / (rec_s + end_s) / 1e6:.2f} M tokens/s,"
            f" stale rows {stale})"
        )
    enqueue_s, stats = bench_enqueue(args.tokens, args.layers, args.repeats)
    print(f"RouteSender.submit, {args.tokens} rows of {args.layers} x top-{K} uint8 (forward-thread cost)")
    print(f"  submit {1e3 * enqueue_s:7.2f} ms/step  (sent {stats['sent_rows']} rows, retried {stats['retried']}, "
          f"spilled {stats['spilled_batches']}, dropped {stats['dropped_rows']})")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
