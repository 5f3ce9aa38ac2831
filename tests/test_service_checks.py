"""The row-check kernels: the top-8 uint8 fast path agrees with the general kernel.

Both are compiled numba code; the general kernel is the reference (per-id
duplicate stamps and range tests). Rows carry planted duplicates at every
distance inside a layer's 8 ids, ids at and past every range boundary, and
all-zero rows, for expert counts around the fast path's cases (<=128, 129-255, 256).
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.checks import kernels as checks

LAYERS, TOP_K, ROWS = 6, 8, 4000


def _planted_rows(num_experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.stack([
        np.stack([rng.choice(min(num_experts, 256), TOP_K, replace=num_experts < TOP_K) for _ in range(LAYERS)])
        for _ in range(ROWS)
    ]).astype(np.uint8)
    for r in range(0, ROWS, 7):  # duplicates at every pair of slots
        layer, i, j = rng.integers(LAYERS), *rng.choice(TOP_K, 2, replace=False)
        ids[r, layer, j] = ids[r, layer, i]
    if num_experts < 256:
        for r in range(3, ROWS, 11):  # the first id out of range, and others up to 255
            slot = (r, rng.integers(LAYERS), rng.integers(TOP_K))
            ids[slot] = rng.choice([num_experts, rng.integers(num_experts, 256)])
        for r in range(5, ROWS, 13):  # the last id in range
            ids[r, rng.integers(LAYERS), rng.integers(TOP_K)] = num_experts - 1
        for r in range(9, ROWS, 17):  # a layer of -1 padding (255 each: out of range, never a duplicate)
            ids[r, rng.integers(LAYERS)] = 255
        for r in range(10, ROWS, 19):  # one out-of-range id twice, and a duplicate beside out-of-range ids
            layer = rng.integers(LAYERS)
            ids[r, layer, :2] = num_experts
            if r % 2:
                ids[r, layer, 3] = ids[r, layer, 2]
    ids[::97] = 0
    return ids.reshape(ROWS, LAYERS * TOP_K)


@pytest.mark.parametrize("num_experts", [8, 64, 100, 127, 128, 129, 200, 255, 256])
def test_top8_fast_path_equals_general_kernel(num_experts):
    ids = _planted_rows(num_experts, seed=num_experts)
    words = ids.view(np.uint64)
    skip = np.zeros(ROWS, np.bool_)
    skip[1::50] = True
    results = []
    for kernel, args in ((checks._check_rows, (ids, words, LAYERS, TOP_K, num_experts)),
                         (checks._check_rows_top8_u8, (ids, words, LAYERS, num_experts))):
        flags, hashes = np.zeros(ROWS, np.uint16), np.zeros(ROWS, np.uint64)
        load = np.zeros((LAYERS, 256), np.int64)
        kernel(*args, skip, flags, hashes, load)
        results.append((flags, hashes, load))
    (flags, hashes, load), (fast_flags, fast_hashes, fast_load) = results
    kinds = {int(f) for f in np.unique(flags)}
    assert {1, 2} <= kinds and (num_experts == 256 or 4 in kinds)  # every planted kind is there to be found
    np.testing.assert_array_equal(fast_flags, flags)
    np.testing.assert_array_equal(fast_hashes, hashes)
    np.testing.assert_array_equal(fast_load, load)


def test_uint8_rows_check_as_their_uint16_widening():
    # check_rows picks the fast path for uint8 top-8 and the general kernel for uint16.
    ids = _planted_rows(128, seed=1)
    results = [checks.check_rows(rows, LAYERS, TOP_K, 128, np.zeros(ROWS, np.bool_), np.zeros((LAYERS, 128), np.int64))
               for rows in (ids, ids.astype(np.uint16))]
    np.testing.assert_array_equal(results[0][0], results[1][0])
