"""One training step's routes through Ray's object store, as RL frameworks move them (verl, NeMo-RL): the baseline
`bench/step_fetch.py` is compared against.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`: two raylets, objects travel between them through Ray's
object manager over loopback, as between hosts). A rollout actor on the first node `ray.put`s each request's
`[rows, 48, 8]` uint8 routes, for the previous step and then the step; N rank actors on the second node each
`ray.get` their DP group's requests at one barrier and cut their CP x TP share (a contiguous copy, as the service's
slice is): the previous step (fresh actors, objects new to their node: "fresh"), then the step (actors that
fetched before, objects new to the node: "first", as bench/step_fetch.py's), then warm rounds (objects already on
the node). Prints rows per second (the ranks' shares summed over the last rank's wall) as JSON.
Ray is in the test environment (`.venv`, for verl's imports), not a dependency of the service.

    python bench/ray_step.py [--ranks 16] [--sequences 256] [--tokens 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
import ray
from ray.cluster_utils import Cluster

TP, CP = 2, 2
LAYERS, TOP_K, EXPERTS = 48, 8, 128  # bench/segment_files.py's SHAPE; the actors import numpy only


@ray.remote(resources={"rollout": 1}, num_cpus=0)
class Rollout:
    """The rollout side: the step's routes, one object per request."""

    def __init__(self, sequences: int, rows: int) -> None:
        self.table = np.random.default_rng(0).integers(0, EXPERTS, (sequences, rows, LAYERS, TOP_K), dtype=np.uint8)

    def put_all(self) -> list:
        return [ray.put(self.table[i]) for i in range(len(self.table))]


@ray.remote(resources={"trainer": 1}, num_cpus=0)
class Rank:
    """One trainer rank: its DP group's requests fetched, its CP x TP share cut."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def fetch(self, refs: list, start_at: float) -> tuple[float, float, int]:
        while time.time() < start_at:  # the barrier: every rank released at one moment
            pass
        started = time.time()
        arrays = ray.get(refs)
        share = self.rank % (TP * CP)
        cut = np.concatenate([a[share::TP * CP] for a in arrays])  # its quarter of each sequence's tokens
        return started, time.time(), int(cut.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = args.tokens - 1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"rollout": 1},
                                                            "object_store_memory": 2 << 30})
    cluster.add_node(num_cpus=1, resources={"trainer": args.ranks}, object_store_memory=3 << 30)
    ray.init(address=cluster.address)
    try:
        rollout = Rollout.remote(args.sequences, rows)
        previous = ray.get(rollout.put_all.remote())
        refs = ray.get(rollout.put_all.remote())
        ranks = [Rank.remote(r) for r in range(args.ranks)]
        ray.get([r.__ray_ready__.remote() for r in ranks])
        dp = args.ranks // (TP * CP)
        per = args.sequences // dp
        walls = []
        for step in [previous, refs] + [refs] * args.rounds:
            start_at = time.time() + 1.0
            got = ray.get([rank.fetch.remote(step[(r // (TP * CP)) * per:(r // (TP * CP) + 1) * per], start_at)
                           for r, rank in enumerate(ranks)])
            wall = max(g[1] for g in got) - min(g[0] for g in got)
            walls.append((wall, sum(g[2] for g in got)))
        fresh, first = (n / w for w, n in walls[:2])
        warm = statistics.median(n / w for w, n in walls[2:])
        print(json.dumps({"ranks": args.ranks, "sequences": args.sequences, "tokens": args.tokens,
                          "fresh_rows_per_s": round(fresh), "first_rows_per_s": round(first),
                          "warm_rows_per_s": round(warm)}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
