"""Per-rank slices are computed on the server: every rank gets exactly its router tokens, and ~1/ranks of the bytes.

BSHD context-parallel and sequence-parallel splits are checked against megatron-core's own
`get_batch_on_this_cp_rank` and `_split_along_first_dim` (run on a stand-in process group:
both only ask the group for size() and rank()). THD context parallel needs Transformer
Engine's `thd_get_partitioned_indices`, not installable here; its rule (per padded
sequence, 2*cp chunks, rank r keeps r and 2cp-1-r) is restated below.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient
from replay_format.trainer_slice import read_slice
from tests.support.data import QWEN3_SHAPE, store_requests

torch = pytest.importorskip("torch")

L, K = QWEN3_SHAPE.num_moe_layers, QWEN3_SHAPE.top_k
LENGTHS = {"s-a": 301, "s-b": 180, "s-c": 257, "s-d": 96}
ORDER = list(LENGTHS)


class Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    return client, store_requests(client, "sl", LENGTHS, seed=9)


def _fetch(client, **kw):
    doc = {"sequences": [{"run": "sl", "request": r} for r in ORDER], **kw}
    response = client.http.post("/v1/trainer/megatron", json=doc)
    assert response.status_code == 200, response.text
    return read_slice(bytearray(response.content)), len(response.content)


def _token_ids(batch) -> np.ndarray:
    """A token's identity: sequence * 100000 + position (-1 for padding)."""
    return np.where(batch.sequence >= 0, batch.sequence.astype(np.int64) * 100000 + batch.position, -1)


def _check_rows(batch, full):
    real = np.flatnonzero(batch.valid)
    for i in real[:: max(1, len(real) // 200)]:
        assert np.array_equal(batch.experts[i], full[ORDER[batch.sequence[i]]][batch.position[i]])


@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_thd_slices_reassemble_the_whole_batch(stored, cp, tp):
    client, full = stored
    # the whole micro-batch, padded as the ranks pad it by default (verl: tp*cp*2 with CP, else tp)
    whole, whole_bytes = _fetch(client, packing="thd", pad_multiple=2 * cp * tp if cp > 1 else tp)
    cu_padded = whole.layout.cu_seqlens_padded
    parts, sizes = {}, []
    for c in range(cp):
        for t in range(tp):
            part, size = _fetch(client, packing="thd", cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t)
            assert part.layout.cu_seqlens_padded == cu_padded
            parts[c, t] = part
            sizes.append(size)
            _check_rows(part, full)
    # SP: the TP ranks' slices concatenated in rank order are the CP rank's tokens
    for c in range(cp):
        local = np.concatenate([_token_ids(parts[c, t]) for t in range(tp)])
        experts = np.concatenate([parts[c, t].experts for t in range(tp)])
        # CP (TE's THD rule): per padded sequence, chunks c and 2cp-1-c of 2cp
        expected_index = []
        for i in range(len(ORDER)):
            lo, hi = cu_padded[i], cu_padded[i + 1]
            chunk = (hi - lo) // (2 * cp)
            expected_index += list(range(lo + c * chunk, lo + (c + 1) * chunk))
            expected_index += list(range(lo + (2 * cp - 1 - c) * chunk, lo + (2 * cp - c) * chunk))
        assert np.array_equal(local, _token_ids(whole)[expected_index])
        assert np.array_equal(experts, whole.experts[expected_index])
    # bytes on the wire: about 1/ranks of the whole each
    ranks = cp * tp
    assert max(sizes) < whole_bytes / ranks * 1.1 + 4096, (sizes, whole_bytes)
    assert sum(sizes) < whole_bytes * 1.1 + 4096 * ranks


@pytest.mark.parametrize("cp,tp", [(2, 1), (1, 4), (2, 2)])
def test_bshd_slices_match_megatron_cp_and_sp_splits(stored, cp, tp, monkeypatch):
    mutils = pytest.importorskip("megatron.core.utils")  # here, not at the top: ~7 s of imports the fast loop skips
    mappings = pytest.importorskip("megatron.core.tensor_parallel.mappings")
    client, full = stored
    whole, whole_bytes = _fetch(client, packing="bshd", seq_length=304)
    s = whole.layout.seq_length
    b = len(ORDER)
    ids_sb = torch.from_numpy(_token_ids(whole).reshape(s, b))  # router order is [s, b]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    sizes = []
    for c in range(cp):
        # megatron's CP split works on [b, s] batches (seq dim 1)
        cp_batch = mutils.get_batch_on_this_cp_rank({"tokens": ids_sb.T.contiguous()}, cp_group=Group(cp, c))
        local_sb = cp_batch["tokens"].T.contiguous()  # [s/cp, b], as the model sees it
        for t in range(tp):
            sp = mappings._split_along_first_dim(local_sb, Group(tp, t))  # SP: split along s
            part, size = _fetch(client, packing="bshd", seq_length=304, cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t)
            sizes.append(size)
            assert np.array_equal(_token_ids(part), sp.reshape(-1).numpy())
            _check_rows(part, full)
    assert max(sizes) < whole_bytes / (cp * tp) * 1.1 + 4096


def test_slice_of_a_realistic_batch_is_a_fraction_of_the_bytes(shared_service):
    client = ReplayClient(shared_service.url)
    store_requests(client, "sl-big", {f"b{i}": 2049 for i in range(8)}, seed=3)
    seqs = [{"run": "sl-big", "request": f"b{i}"} for i in range(8)]
    whole = client.http.post("/v1/trainer/megatron", json={"sequences": seqs, "pad_multiple": 8})
    sizes = [
        len(client.http.post("/v1/trainer/megatron", json={"sequences": seqs, "cp_size": 2, "cp_rank": c,
                                                             "tp_size": 2, "tp_rank": t}).content)
        for c in range(2) for t in range(2)
    ]
    ratio = max(sizes) / len(whole.content)
    assert 0.24 < ratio < 0.26, (sizes, len(whole.content))


@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2), (4, 1)])
def test_bshd_contiguous_cp_keeps_one_run_of_positions_per_rank(stored, cp, tp):
    """`cp_split="contiguous"` (miles `--allgather-cp` for BSHD): CP rank r holds positions [r*s/cp, (r+1)*s/cp)."""
    mappings = pytest.importorskip("megatron.core.tensor_parallel.mappings")
    client, full = stored
    whole, _ = _fetch(client, packing="bshd", seq_length=304)
    s, b = whole.layout.seq_length, len(ORDER)
    ids_sb = torch.from_numpy(_token_ids(whole).reshape(s, b))
    for c in range(cp):
        local_sb = ids_sb[c * s // cp : (c + 1) * s // cp]
        for t in range(tp):
            sp = mappings._split_along_first_dim(local_sb, Group(tp, t))
            part, _ = _fetch(client, packing="bshd", seq_length=304, cp_split="contiguous", cp_size=cp, cp_rank=c,
                             tp_size=tp, tp_rank=t)
            assert part.layout.cp_split == "contiguous"
            assert np.array_equal(_token_ids(part), sp.reshape(-1).numpy())
            _check_rows(part, full)


def test_without_sequence_parallel_every_tp_rank_holds_the_cp_ranks_tokens(stored):
    client, _ = stored
    parts = [_fetch(client, packing="thd", cp_size=2, cp_rank=1, tp_size=2, tp_rank=t, sequence_parallel=False)[0]
             for t in range(2)]
    with_sp = [_fetch(client, packing="thd", cp_size=2, cp_rank=1, tp_size=2, tp_rank=t)[0] for t in range(2)]
    assert np.array_equal(_token_ids(parts[0]), _token_ids(parts[1]))
    assert np.array_equal(_token_ids(parts[0]), np.concatenate([_token_ids(p) for p in with_sp]))
    assert not parts[0].layout.sequence_parallel and parts[0].layout.pad_multiple == 8  # tp*cp*2: TP pads anyway


def test_last_sequence_padding_grows_the_last_sequence_before_the_cp_split(stored):
    """NeMo-RL (`pad_packed_seq_to_multiple_of`) and verl fp8: the padded total is reached by the last sequence,
    so under CP its zigzag chunks include that padding (unlike slime's tail after the split)."""
    client, _ = stored
    whole, _ = _fetch(client, packing="thd", pad_multiple=4, total_multiple=1024)
    assert whole.layout.cu_seqlens_padded == [0, 304, 484, 744, 1024] and whole.num_tokens == 1024
    tail, _ = _fetch(client, packing="thd", pad_multiple=4, total_multiple=1024, total_pad="tail")
    assert tail.layout.cu_seqlens_padded == [0, 304, 484, 744, 840] and tail.num_tokens == 1024
    assert np.array_equal(_token_ids(whole), _token_ids(tail))  # one rank: the same positions either way
    c1, _ = _fetch(client, packing="thd", pad_multiple=4, total_multiple=1024, cp_size=2, cp_rank=1)
    lo, hi = whole.layout.cu_seqlens_padded[3:5]
    chunk = (hi - lo) // 4
    # CP rank 1 holds chunks 1 and 2 of the grown last sequence: its ids end with the last sequence's middle
    tail_ids = _token_ids(whole)[lo + chunk : lo + 3 * chunk]
    assert np.array_equal(_token_ids(c1)[-2 * chunk :], tail_ids)
