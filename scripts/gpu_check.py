#!/usr/bin/env python3
"""Device check of the graph-safe capture (capture/worker/graph_recorder.py) inside a real CUDA graph.

Plain PyTorch on one GPU: no vLLM (the lent machines have none). Imports only torch, numpy
and this repo's engine-neutral `capture.worker.graph_recorder` (+ `replay_format.RunShape`).

For each id dtype (uint8: 64 experts; uint16: 300 experts) and each padded size, a small MoE
router stack (`ToyRouter`: per layer gate -> top-k -> the capture write -> the layer's output
depends on the experts chosen) is captured into a `torch.cuda.CUDAGraph` with the recorder's
write inside it, then replayed step after step with new inputs and a new real-token count
(fewer than the padded size, some steps all of it). Each step: the experts and the stamps of
the real rows equal an eager reference run of the same model on the same padded input; rows
marked invalid read STALE with the sentinel id; padded rows (made invalid on purpose) are never
read; a graph captured without one layer reads every row STALE. The forward path (step begin,
replay, start of the close) runs under `torch.cuda.set_sync_debug_mode("error")`: a host sync
there fails the check.

    python scripts/gpu_check.py              # on the GPU (exit 0: PASS)
    python scripts/gpu_check.py --device cpu # the same checks, no CUDA graph (what the tests run)

Prints one line per case and a last line `gpu_check: PASS` / `gpu_check: FAIL (...)`. Seconds on an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import pyarrow  # noqa: E402, F401
except ImportError:
    # The device machines carry PyTorch only. `replay_format.core` (RunShape, Flag) imports pyarrow
    # for its Arrow helpers, which run only inside functions the recorder never calls: an empty
    # stand-in module lets it import there. Any use of it would fail loudly (AttributeError).
    import types  # noqa: E402

    sys.modules["pyarrow"] = types.ModuleType("pyarrow")

from capture.worker.graph_recorder import GraphStepRecorder  # noqa: E402
from replay_format import Flag, RunShape  # noqa: E402

HIDDEN = 64


class ToyRouter(torch.nn.Module):
    """L MoE routers: each layer's top-k ids go to `write(layer, ids)` and decide the layer's output."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gates = torch.nn.Parameter(torch.randn(num_layers, HIDDEN, num_experts, generator=g))
        self.experts = torch.nn.Parameter(torch.randn(num_layers, num_experts, HIDDEN, generator=g) * 0.5)
        self.top_k = top_k

    def forward(self, x: torch.Tensor, invalid: torch.Tensor, write: Callable[[int, torch.Tensor], None],
                skip: int = -1) -> torch.Tensor:
        """`invalid` [n] bool: rows whose ids are replaced by -1 before the write (a bad id, or padding)."""
        h = x
        for layer in range(self.gates.shape[0]):
            if layer == skip:  # a layer that does not run (static: a separate graph)
                continue
            logits = h @ self.gates[layer]
            ids = torch.topk(logits, self.top_k, dim=-1).indices.to(torch.int32)
            write(layer, torch.where(invalid[:, None], -1, ids))
            h = h + torch.tanh(self.experts[layer][ids].sum(dim=1))  # the routing decides the next layer's input
        return h


def reference(model: ToyRouter, x: torch.Tensor, skip: int = -1) -> np.ndarray:
    """[n, L, K] int64 ids of an eager run (no recorder); a skipped layer's ids are -1."""
    rows = torch.full((x.shape[0], model.gates.shape[0], model.top_k), -1, dtype=torch.int64, device=x.device)
    no_invalid = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)

    def keep(layer: int, ids: torch.Tensor) -> None:
        rows[:, layer] = ids

    with torch.no_grad():
        model(x, no_invalid, keep, skip)
    return rows.cpu().numpy()


class Case:
    """One compiled (captured) forward at one padded size, with its static input buffers."""

    def __init__(self, model: ToyRouter, rec: GraphStepRecorder, padded: int, device: torch.device,
                 skip: int = -1) -> None:
        self.padded, self.skip, self.model, self.rec = padded, skip, model, rec
        self.x = torch.zeros(padded, HIDDEN, device=device)
        self.invalid = torch.zeros(padded, dtype=torch.bool, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():  # warm-up outside the graph (lazy inits, autotune)
                for _ in range(2):
                    model(self.x, self.invalid, rec.write, skip)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.no_grad():
                model(self.x, self.invalid, rec.write, skip)

    def run(self) -> None:
        """One forward: a graph replay on CUDA (no Python callback runs), the eager model elsewhere."""
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self.model(self.x, self.invalid, self.rec.write, self.skip)


def check(num_experts: int, device: torch.device, steps: int, padded_sizes: tuple[int, ...],
          layers: int = 4, top_k: int = 4, seed: int = 0) -> list[str]:
    """Run every check for one id dtype; returns the failures (empty: pass)."""
    shape = RunShape(layers, top_k, num_experts)
    model = ToyRouter(layers, num_experts, top_k, seed).to(device)
    rec = GraphStepRecorder(shape, max_tokens=max(padded_sizes), device=device)
    cases = {p: Case(model, rec, p, device) for p in padded_sizes}
    skipped = Case(model, rec, padded_sizes[-1], device, skip=1)
    rng = np.random.default_rng(seed)
    sentinel = int(np.iinfo(shape.dtype).max)
    failures: list[str] = []
    sync_check = device.type == "cuda"

    def fail(msg: str) -> None:
        if len(failures) < 20:
            failures.append(msg)

    for step in range(steps):
        padded = padded_sizes[step % len(padded_sizes)]
        n = padded if step % 5 == 0 else int(rng.integers(1, padded + 1))
        case = skipped if step % 7 == 6 else cases[padded]
        padded, n = case.padded, min(n, case.padded)
        x = torch.from_numpy(rng.standard_normal((padded, HIDDEN)).astype(np.float32)).to(device)
        bad = rng.random(padded) < 0.1  # a few real rows with an invalid id
        bad[n:] = True  # every padded row is invalid: a clean real row proves the padding is never read
        case.x.copy_(x)
        case.invalid.copy_(torch.from_numpy(bad).to(device))
        experts = np.zeros((n, layers, top_k), shape.dtype)
        with torch.cuda.device(device) if sync_check else contextlib.nullcontext():
            if sync_check:
                torch.cuda.set_sync_debug_mode("error")
            try:
                stamp = rec.begin_step()
                case.run()
                rec.start_close(n)
            finally:
                if sync_check:
                    torch.cuda.set_sync_debug_mode("default")
        flags = rec.end_step_into(experts)
        flags = np.zeros(n, np.uint16) if flags is None else flags
        stamps = rec._host_stamps[:n].numpy()
        ref = reference(model, case.x, case.skip)[:n]
        where = f"E={num_experts} padded={padded} n={n} step={stamp}"
        ran = [layer for layer in range(layers) if layer != case.skip]
        real_bad = bad[:n]
        # Flags: STALE for an invalid row, and for every row of a step where a layer did not run.
        expect_flags = np.where(real_bad | (case.skip >= 0), int(Flag.STALE), 0)
        for row in np.flatnonzero(flags != expect_flags)[:3]:
            fail(f"{where}: row {row}: flag {int(flags[row])}, expected {int(expect_flags[row])}")
        # Stamps: this step on every layer that ran (-step on an invalid row); never it on the skipped layer.
        expect_stamps = np.where(real_bad, -stamp, stamp)[:, None]
        for row in np.flatnonzero((stamps[:, ran] != expect_stamps).any(axis=1))[:3]:
            fail(f"{where}: row {row}: stamps {stamps[row].tolist()}, expected {int(expect_stamps[row, 0])} "
                 f"on layers {ran}")
        if case.skip >= 0 and (np.abs(stamps[:, case.skip]) == stamp).any():
            fail(f"{where}: the skipped layer {case.skip} is stamped with this step")
        # Experts: the eager reference on a valid row, the sentinel on an invalid one.
        want = np.where(real_bad[:, None, None], sentinel, ref[:, ran])
        for row in np.flatnonzero((experts[:, ran].astype(np.int64) != want).any(axis=(1, 2)))[:3]:
            fail(f"{where}: row {row}: experts {experts[row].tolist()} != {want[row].tolist()} (layers {ran})")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (a CUDA graph; default) or cpu (the same checks, eager)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--padded", default="8,32,256", help="padded sizes to capture, comma separated")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: FAIL (no CUDA device; use --device cpu for the CPU checks)")
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: more threads only contend (seconds become minutes on shared cores)
    padded = tuple(sorted(int(p) for p in args.padded.split(",")))
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__} on {name}; "
          f"{'CUDA graphs' if device.type == 'cuda' else 'eager (no CUDA graph)'}; padded sizes {padded}")
    failures = []
    for num_experts in (64, 300):  # uint8 and uint16 ids
        case_failures = check(num_experts, device, args.steps, padded)
        print(f"  E={num_experts} ({RunShape(1, 1, num_experts).dtype}): "
              f"{'ok' if not case_failures else f'{len(case_failures)} failures'} ({args.steps} steps)")
        for line in case_failures:
            print("    " + line)
        failures += case_failures
    verdict = "PASS" if not failures else f"FAIL ({len(failures)} checks)"
    print(f"gpu_check: {verdict} in {time.perf_counter() - t0:.1f} s")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
