"""Gloo ranks forked from a process that has already imported what they need (vLLM 0.33/0.34 takes ~15 s to import).

    results = run_forked(4, case_fn, *args)   # case_fn(*args) on ranks 0..3 of a gloo world of their own; by rank

For scripts run in `.venv-vllm`'s Python (`tests/support/vllm_releases.py`), where `gloo.py`'s spawned pool would
import vLLM again in every rank. Each call forks `world` processes; each starts a gloo process group over a fresh
FileStore, runs `fn(*args)` and sends back its result (pickled) or its traceback, so `gloo.groups` works inside.
The parent must not have started torch work on other threads before forking (importing is fine). An exception on
a rank re-raises here (AssertionError) with that rank's traceback; ranks that do not answer within `timeout`
seconds are killed (TimeoutError).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _rank_main(rank: int, world: int, init_file: str, fn, args, results) -> None:
    """One forked rank: the process group, the function, its answer, then a clean exit."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        # Pickled here: the queue would hand tensors over as shared memory, gone once this process exits.
        answer = (rank, True, pickle.dumps(fn(*args)))
    except BaseException:  # any error: reported to the parent
        answer = (rank, False, traceback.format_exc())
    results.put(answer)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_forked(world: int, fn, *args, timeout: float = 120) -> list:
    """`fn(*args)` on each rank of a fresh `world`-rank gloo world (forked); the results, by rank (module docstring)."""
    ctx = multiprocessing.get_context("fork")
    fd, init_file = tempfile.mkstemp(prefix="gloo_fork_")
    os.close(fd)
    os.unlink(init_file)  # FileStore wants a fresh path
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, init_file, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: list = [None] * world
    errors: list[tuple[int, str]] = []
    try:
        for _ in range(world):
            try:
                # Once a rank failed, the others may wait in a collective it never joined: wait briefly.
                rank, ok, value = results.get(timeout=5 if errors else timeout)
            except queue.Empty:
                if errors:
                    break
                raise TimeoutError(f"{fn.__name__}: no answer from every rank in {timeout}s") from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append((rank, value))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"{fn.__name__} failed on rank {rank} ({len(errors)} ranks failed):\n{tb}")
    return out


__all__ = ["run_forked"]
