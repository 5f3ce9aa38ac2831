"""A pool of gloo worker processes on CPU, spawned once and reused by every test.

    pool = gloo_pool(8)                       # one process group of 8 ranks per session
    results = pool.run(case_fn, *args)        # case_fn(*args) on every rank; list by rank

`case_fn` must be a module-level function (it is pickled by reference); it runs inside
the worker with the default process group up. `groups(dp, pcp, tp)` in a worker gives
the DP/PCP/TP sub-groups of a layout (TP innermost, then PCP, then DP, as vLLM orders
ranks), creating each rank set's group once per worker. Ranks beyond dp*pcp*tp idle.
An exception on any rank re-raises here with that rank's traceback; a hang times out,
and the pool is then respawned on next use.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TASK_TIMEOUT_S = 120


def _worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # any error: reported to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ctx = mp.get_context("spawn")
        fd, self.init_file = tempfile.mkstemp(prefix="gloo_pool_")
        os.close(fd)
        os.unlink(self.init_file)  # FileStore wants a fresh path
        self.tasks = [self.ctx.Queue() for _ in range(world_size)]
        self.results = self.ctx.Queue()
        self.procs = [
            self.ctx.Process(target=_worker, args=(r, world_size, self.init_file, self.tasks[r], self.results),
                             daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: list = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            try:
                # Once a rank failed, the others may sit in a collective it never joined:
                # wait briefly, then give up on this pool (it is respawned on next use).
                rank, ok, value = self.results.get(timeout=5 if errors else TASK_TIMEOUT_S)
            except queue.Empty:
                self.broken = True
                if errors:
                    break
                raise TimeoutError(f"{fn.__name__}: no answer from every rank in {TASK_TIMEOUT_S}s") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            rank, tb = sorted(errors)[0]
            raise AssertionError(f"{fn.__name__} failed on rank {rank} ({len(errors)} ranks failed):\n{tb}")
        return out

    def close(self) -> None:
        if self.broken:  # ranks may be stuck in a collective: no clean shutdown
            for p in self.procs:
                p.kill()
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


_POOLS: dict[int, GlooPool] = {}


def gloo_pool(world_size: int) -> GlooPool:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = GlooPool(world_size)
    return pool


@atexit.register
def close_pools() -> None:
    """Stop every pool's workers (at exit; and before conftest's `os._exit`, which skips atexit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


# ---- inside a worker -------------------------------------------------------------------

_GROUPS: dict[tuple[int, ...], object] = {}


def group_of(ranks) -> object:
    """The group of these global ranks; every world rank must call this alike (collective)."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


@dataclass
class Groups:
    active: bool
    dp_rank: int = 0
    pcp_rank: int = 0
    tp_rank: int = 0
    dp_group: object = None
    pcp_group: object = None
    tp_group: object = None


def groups(dp: int, pcp: int, tp: int) -> Groups:
    """This rank's place in a dp x pcp x tp layout (global rank = (d * pcp + p) * tp + t)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = dp * pcp * tp
    assert size <= world, f"layout {dp}x{pcp}x{tp} needs {size} ranks, pool has {world}"
    at = lambda d, p, t: (d * pcp + p) * tp + t  # noqa: E731
    # Create every group of the layout in one fixed order on every rank.
    by_rank: dict[int, dict[str, object]] = {r: {} for r in range(size)}

    def make(axis: str, members: list[list[int]]) -> None:
        for ranks in members:
            group = group_of(ranks)
            for r in ranks:
                by_rank[r][axis] = group

    make("tp", [[at(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pcp)])
    make("pcp", [[at(d, p, t) for p in range(pcp)] for d in range(dp) for t in range(tp)])
    make("dp", [[at(d, p, t) for d in range(dp)] for p in range(pcp) for t in range(tp)])
    if rank >= size:
        return Groups(active=False)
    d, rem = divmod(rank, pcp * tp)
    p, t = divmod(rem, tp)
    mine = by_rank[rank]
    return Groups(True, d, p, t, mine["dp"], mine["pcp"], mine["tp"])


class CollectiveCounter:
    """Counts real torch.distributed collective calls made through the module (call boundary)."""

    NAMES = (
        "all_gather",
        "all_gather_single",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "reduce_scatter",
        "all_to_all",
        "all_to_all_single",
    )

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._orig: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for name in self.NAMES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._orig[name] = orig

            def wrapped(*a, _orig_fn=orig, _name=name, **k):
                self.calls.append(_name)
                return _orig_fn(*a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)

    def __len__(self) -> int:
        return len(self.calls)
