"""Rollout-vs-training routing agreement (pure numpy): the R3 paper's metrics.

For tokens the trainer sent that have a clean recorded row, per (token, layer), the top-k *sets* are compared
(`compare_rows`, in chunks of `CHUNK_ROWS`) and tallied per request (`Tally`, `add_request`). `finish` gives the
router-level mismatch (fraction of (token, layer) whose sets differ), the token-level mismatch (fraction of tokens
with any layer differing) and the mean Jaccard |A & B| / |A | B|, overall and per layer, with the worst layers and
tokens. A route compared with itself gives 0, 0 and 1.0.

Design: docs/design/service_data.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CHUNK_ROWS = 8192  # rows compared at once: bounds the (rows, L, K, K) temporary


@dataclass
class Tally:
    """Running sums over many requests; `finish` turns them into the answer."""

    num_moe_layers: int
    tokens: int = 0
    differing_tokens: int = 0
    layer_differ: np.ndarray = field(init=False)  # (L,) int64: tokens whose layer set differs
    layer_jaccard: np.ndarray = field(init=False)  # (L,) float64: sum of Jaccard
    # (layers differing, -jaccard, request, position) of the worst tokens so far
    worst: list[tuple[int, float, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layer_differ = np.zeros(self.num_moe_layers, np.int64)
        self.layer_jaccard = np.zeros(self.num_moe_layers, np.float64)


def compare_rows(trainer: np.ndarray, recorded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(n, L, K)` each -> (differs (n, L) bool, jaccard (n, L) float64)."""
    n, num_moe_layers, top_k = trainer.shape
    differs = np.empty((n, num_moe_layers), np.bool_)
    jaccard = np.empty((n, num_moe_layers), np.float64)
    for lo in range(0, n, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, n)
        a = np.sort(trainer[lo:hi].astype(np.int32), axis=-1)
        b = np.sort(recorded[lo:hi].astype(np.int32), axis=-1)
        differs[lo:hi] = (a != b).any(axis=-1)
        # |A & B| for sets of K distinct ids: count pairs equal (ids within a set are distinct)
        inter = (a[..., :, None] == b[..., None, :]).sum(axis=(-1, -2))
        jaccard[lo:hi] = inter / (2 * top_k - inter)
    return differs, jaccard


def add_request(tally: Tally, request_id: str, positions: np.ndarray, differs: np.ndarray, jaccard: np.ndarray,
                worst_tokens: int) -> None:
    """Add one request's compared rows to the tally, keeping the `worst_tokens` worst tokens overall."""
    if not len(positions):
        return
    per_token = differs.sum(axis=1)
    tally.tokens += len(positions)
    tally.differing_tokens += int(np.count_nonzero(per_token))
    tally.layer_differ += differs.sum(axis=0)
    tally.layer_jaccard += jaccard.sum(axis=0)
    token_jaccard = jaccard.mean(axis=1)
    bad = np.flatnonzero(per_token)
    if bad.size:
        # keep this request's worst few, then the overall worst
        top = bad[np.lexsort((token_jaccard[bad], -per_token[bad]))[:worst_tokens]]
        tally.worst.extend(
            (int(per_token[i]), -float(token_jaccard[i]), request_id, int(positions[i])) for i in top
        )
        tally.worst.sort(key=lambda w: (-w[0], -w[1], w[2], w[3]))
        del tally.worst[worst_tokens:]


def finish(tally: Tally, moe_layers: tuple[int, ...], worst_layers: int = 10) -> dict:
    """The figures of a tally: overall and per MoE layer, the worst layers (MoE ordinals) and tokens."""
    tokens = tally.tokens
    if tokens:
        layer_mismatch = tally.layer_differ / tokens
        layer_jaccard = tally.layer_jaccard / tokens
        router = float(tally.layer_differ.sum() / (tokens * tally.num_moe_layers))
        token = tally.differing_tokens / tokens
        jac = float(tally.layer_jaccard.sum() / (tokens * tally.num_moe_layers))
    else:
        layer_mismatch = np.zeros(tally.num_moe_layers)
        layer_jaccard = np.zeros(tally.num_moe_layers)
        router = token = jac = 0.0
    per_layer = [
        {"layer": i, "model_layer": int(moe_layers[i]), "router_mismatch": float(layer_mismatch[i]),
         "jaccard": float(layer_jaccard[i])}
        for i in range(tally.num_moe_layers)
    ]
    bad_layers = np.flatnonzero(tally.layer_differ)
    ranked = bad_layers[np.lexsort((bad_layers, layer_jaccard[bad_layers], -layer_mismatch[bad_layers]))]
    return {
        "tokens": tokens,
        "router_mismatch": router,
        "token_mismatch": float(token),
        "jaccard": jac,
        "per_layer": per_layer,
        "worst_layers": [int(i) for i in ranked[:worst_layers]],
        "worst_tokens": [
            {"request_id": r, "position": p, "layers_differing": n, "jaccard": -j} for n, j, r, p in tally.worst
        ],
    }
