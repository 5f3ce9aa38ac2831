"""The PCP restore index checks and the layouts that need it, on one process (the gloo runs: test_capture_pcp_v2.py).

The batch is the example in vLLM's own `PCPManager._build_batch_layout` comment (PCP 2: global [A B C D E F G],
rank 0 / rank 1 hold [A B G] / [C D E F], gathered [A B G _ | C D E F], restore index [0, 1, 4, 5, 6, 7, 2]).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from capture.vllm.worker.forward_sharding import MoeLayout, Parallel, PcpStep, ShardingError, restore, restore_pcp
from capture.worker.restore import check_pcp_restore_index, restore_pcp_order

GATHERED = torch.tensor([[0, 1], [1, 2], [6, 7], [-1, -1], [2, 3], [3, 4], [4, 5], [5, 6]])  # A B G _ | C D E F
MASK = torch.tensor([False, False, False, True, False, False, False, False])
INDEX = torch.tensor([0, 1, 4, 5, 6, 7, 2])


def moe(pcp=2, a2a=False, naive=False, sp=False):
    cfg = SimpleNamespace(pcp_size=pcp, dp_size=1, is_sequence_parallel=sp,
                          moe_parallel_config=SimpleNamespace(use_all2all_kernels=a2a))
    return SimpleNamespace(moe_config=cfg, do_naive_dispatch_combine=naive)


def test_vllms_example_restores_the_global_order():
    check_pcp_restore_index(INDEX, MASK, 7)
    assert restore_pcp_order(GATHERED, INDEX)[:, 0].tolist() == list(range(7))  # A..G


@pytest.mark.parametrize("index,match", [
    ([0, 1, 3, 5, 6, 7, 2], "padding row"),  # reads the pad row
    ([0, 1, 4, 5, 6, 6, 2], "twice"),  # a replicated copy read twice
    ([0, 1, 4, 5, 6, 8, 2], "outside"),
    ([0, 1, 4, 5, 6, 7], "lists 6 rows"),
])
def test_a_bad_index_is_refused(index, match):
    with pytest.raises(ValueError, match=match):
        check_pcp_restore_index(torch.tensor(index), MASK, 7)


def test_restore_pcp_refuses_before_any_collective():
    """What `restore_pcp` cannot restore is refused (the layer's rows go STALE) before it gathers anything."""
    par = Parallel(pcp_size=2, pcp_rank=0)
    step = PcpStep(INDEX, 4, MASK)
    with pytest.raises(ShardingError, match="PCP group"):  # PCP 2 without its process group: refused, no collective
        restore_pcp(GATHERED, moe(), par, step, 7)
    one = Parallel()  # a PCP-2 layer on a worker that says PCP 1
    with pytest.raises(ShardingError, match="PCP 2, this worker on PCP 1"):
        restore_pcp(GATHERED, moe(), one, step, 7)
    with pytest.raises(ShardingError, match="no restore index"):
        restore_pcp(GATHERED, moe(pcp=1), one, PcpStep(None, 4, MASK), 7)
    with pytest.raises(ShardingError, match="naive DP dispatch"):
        restore_pcp(GATHERED, moe(pcp=1, naive=True), one, PcpStep(INDEX, 8, MASK), 7)


def test_layouts_under_pcp():
    assert not MoeLayout.of(moe(a2a=True)).local  # all2all kernels under PCP: the router sees a rank's part
    assert MoeLayout.of(moe(pcp=1, a2a=True)).local
    with pytest.raises(ShardingError, match="all2all kernels"):  # the V1 path has no index for it
        restore(GATHERED[:4], moe(a2a=True), None, Parallel(pcp_size=2), 4)
