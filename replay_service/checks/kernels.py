"""The compiled row checks (`check.py` runs them, as the ingest check stage; rows.md, "Flags").

One compiled pass over a batch computes, per row, ZERO / DUPLICATE / OUT_OF_RANGE,
a 64-bit content hash (for the STALE content check and the batch digest) and adds clean
rows to the per-layer expert load. numba compiles it once per dtype; a batch of 48 x 8
uint8 rows costs a few hundred nanoseconds per row on one core (bench/ingest.py).
The STALE check's table of recently stored rows is `recent.py`.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from replay_format import Flag

_ZERO = np.uint16(Flag.ZERO)
_DUPLICATE = np.uint16(Flag.DUPLICATE)
_OUT_OF_RANGE = np.uint16(Flag.OUT_OF_RANGE)

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@numba.njit(nogil=True, cache=True)
def _check_rows(experts, words, num_moe_layers, top_k, num_experts, skip, flags, hashes, load):  # pragma: no cover
    # `words` is the same rows viewed as uint64 (zero-padded when a row is not a
    # multiple of 8 bytes): hashing and the zero test run on words, not ids.
    n = experts.shape[0]
    seen = np.zeros(65536 if experts.itemsize == 2 else 256, np.uint32)
    gen = np.uint32(0)
    num_words = words.shape[1]
    for r in range(n):
        if skip[r]:
            continue
        h = _FNV_OFFSET
        any_bits = np.uint64(0)
        for w in range(num_words):
            v = words[r, w]
            any_bits |= v
            h = (h ^ v) * _FNV_PRIME
        hashes[r] = h
        if any_bits == 0:  # a never-written row: ZERO says it all (its repeated 0 is not a DUPLICATE)
            flags[r] = _ZERO
            continue
        row_flags = np.uint16(0)
        for layer in range(num_moe_layers):
            gen += np.uint32(1)
            if gen == 0:  # wrapped: clear the stamps so old marks cannot look current
                seen[:] = 0
                gen = np.uint32(1)
            base = layer * top_k
            for j in range(top_k):
                e = experts[r, base + j]
                if e >= num_experts:
                    row_flags |= _OUT_OF_RANGE
                else:
                    if seen[e] == gen:
                        row_flags |= _DUPLICATE
                    seen[e] = gen
        flags[r] = row_flags
        if row_flags == 0:
            for layer in range(num_moe_layers):
                base = layer * top_k
                for j in range(top_k):
                    load[layer, experts[r, base + j]] += 1


_ONES = np.uint64(0x0101010101010101)
_HIGH_BITS = np.uint64(0x8080808080808080)


@numba.njit(nogil=True, cache=True, inline="always")
def _has_zero_byte(x):  # pragma: no cover - compiled
    return ((x - _ONES) & ~x & _HIGH_BITS) != np.uint64(0)


@numba.njit(nogil=True, cache=True, inline="always")
def _repeats_a_byte(x):  # pragma: no cover - compiled
    # Two equal bytes in x: some rotation by 1..4 bytes lines one up with the other.
    return (_has_zero_byte(x ^ ((x << np.uint64(8)) | (x >> np.uint64(56))))
            | _has_zero_byte(x ^ ((x << np.uint64(16)) | (x >> np.uint64(48))))
            | _has_zero_byte(x ^ ((x << np.uint64(24)) | (x >> np.uint64(40))))
            | _has_zero_byte(x ^ ((x << np.uint64(32)) | (x >> np.uint64(32)))))


@numba.njit(nogil=True, cache=True)
def _check_rows_top8_u8(experts, words, num_moe_layers, num_experts, skip, flags, hashes, load):  # pragma: no cover
    # The common shape (uint8 ids, top-8): one layer's ids are one uint64 word, so the
    # duplicate and range tests run on whole words (SWAR) instead of per id; 1.7x faster
    # than _check_rows on 48 x 8 rows (bench/ingest.py), same flags, hashes and load.
    below_128 = num_experts <= 128
    # byte + over_limit has bit 7 set iff byte >= num_experts
    over_limit = _ONES * np.uint64(128 - num_experts) if below_128 else np.uint64(0)
    for r in range(words.shape[0]):
        if skip[r]:
            continue
        h = _FNV_OFFSET
        any_bits = np.uint64(0)
        duplicate = False
        out_of_range = False
        for layer in range(num_moe_layers):
            x = words[r, layer]
            any_bits |= x
            h = (h ^ x) * _FNV_PRIME
            layer_oor = False
            if below_128:
                layer_oor = (((x & ~_HIGH_BITS) + over_limit) | x) & _HIGH_BITS != np.uint64(0)
            elif num_experts < 256 and (x & _HIGH_BITS) != np.uint64(0):
                for j in range(8):
                    layer_oor |= experts[r, layer * 8 + j] >= num_experts
            if layer_oor:  # rare; as in _check_rows, an id past num_experts is never a duplicate (-1 padding)
                out_of_range = True
                for j in range(8):
                    e = experts[r, layer * 8 + j]
                    if e < num_experts:
                        for i in range(j):
                            duplicate |= experts[r, layer * 8 + i] == e
            else:
                duplicate |= _repeats_a_byte(x)
        hashes[r] = h
        if any_bits == 0:
            flags[r] = _ZERO
            continue
        row_flags = np.uint16(0)
        if duplicate:
            row_flags |= _DUPLICATE
        if out_of_range:
            row_flags |= _OUT_OF_RANGE
        flags[r] = row_flags
        if row_flags == 0:
            for layer in range(num_moe_layers):
                for j in range(8):
                    load[layer, experts[r, layer * 8 + j]] += 1


def check_rows(
    experts: np.ndarray, num_moe_layers: int, top_k: int, num_experts: int, skip: np.ndarray, load: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Flags (ZERO|DUPLICATE|OUT_OF_RANGE) and content hashes for `experts` `(n, L*K)`.

    Rows where `skip` is true (writer padding) are left at flag 0 and hash 0.
    Clean rows are added to `load` `(L, num_experts)` int64 in place.
    """
    n = experts.shape[0]
    rows = np.ascontiguousarray(experts.reshape(n, num_moe_layers * top_k))
    row_bytes = rows.shape[1] * rows.itemsize
    if row_bytes % 8 == 0 and rows.ctypes.data % 8 == 0:
        words = rows.view(np.uint64)
    else:
        padded = np.zeros((n, -(-row_bytes // 8) * 8), np.uint8)
        padded[:, :row_bytes] = rows.view(np.uint8)
        words = padded.view(np.uint64)
    flags = np.zeros(n, np.uint16)
    hashes = np.zeros(n, np.uint64)
    if rows.itemsize == 1 and top_k == 8 and words.shape[1] == num_moe_layers:
        _check_rows_top8_u8(rows, words, num_moe_layers, num_experts, skip, flags, hashes, load)
    else:
        _check_rows(rows, words, num_moe_layers, top_k, num_experts, skip, flags, hashes, load)
    return flags, hashes


def warm_up() -> None:
    """Compile both dtype variants before the first ingest is timed by a client."""
    for dtype in (np.uint8, np.uint16):
        for writeable in (True, False):  # ingested ids are views of the request body
            for top_k in (8, 4):  # the top-8 uint8 fast path and the general kernel
                ids = np.zeros((1, 8), dtype)
                ids.flags.writeable = writeable
                check_rows(ids, 8 // top_k, top_k, 16, np.zeros(1, np.bool_), np.zeros((8 // top_k, 16), np.int64))


def route_entropy_bits(num_moe_layers: int, top_k: int, num_experts: int) -> float:
    """log2 of the number of distinct rows (unordered top-k sets per layer)."""
    return num_moe_layers * math.log2(math.comb(num_experts, top_k))
