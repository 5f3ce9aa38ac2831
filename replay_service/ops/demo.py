"""A synthetic run whose requests carry every kind of flagged row, for newcomers and the web view.

Idempotent: the batches have fixed (writer_id, seq), so loading it twice stores it once.
"""

from __future__ import annotations

import numpy as np

from replay_format import Flag, RunShape, Source
from replay_format.compare import build_compare_body
from replay_format.rows import Rows, RowsMeta
from replay_service.compare.comparison import run_compare
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.store import RequestStatus, RouteStore
from replay_service.store.requests.summaries import RunRecord

DEMO_RUN = "demo"
DEMO_SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)


def synthetic_routes(rng: np.random.Generator, num_rows: int, shape: RunShape = DEMO_SHAPE) -> np.ndarray:
    """Distinct top-k per layer from a skewed per-layer expert popularity, like real routers.

    Each row's k experts are a draw without replacement weighted by popularity: the k smallest of
    `Exp(1) / popularity` (an exponential race, the same draw as the Gumbel top-k over log-popularity), in
    float32: ~14x faster than float64 Gumbel noise, which made `serve --demo` spend ~5 s and ~1 GB on it."""
    popularity = rng.gamma(0.6, size=(shape.num_moe_layers, shape.num_experts)).astype(np.float32)
    keys = rng.standard_exponential(size=(num_rows, shape.num_moe_layers, shape.num_experts), dtype=np.float32)
    keys /= popularity[None]
    return np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)


def bulk_routes(n: int, seed: int = 0, shape: RunShape = DEMO_SHAPE) -> np.ndarray:
    """Many distinct rows, fast (benchmarks): a 4096-row pool of distinct top-k sets, each
    block of it relabelled by a random expert permutation (ids stay distinct per layer)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((4096, shape.num_moe_layers, shape.num_experts), np.float32)
    pool = np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k].astype(shape.dtype)
    blocks = [rng.permutation(shape.num_experts).astype(shape.dtype)[pool] for _ in range(-(-n // 4096))]
    return np.concatenate(blocks)[:n]


def _rows(request_id, positions, experts, tokens, flags=None) -> dict:
    n = len(positions)
    return {
        "request_id": request_id,
        "positions": np.asarray(positions, np.int32),
        "experts": experts.reshape(n, -1),
        "tokens": np.asarray(tokens, np.int32),
        "flags": np.zeros(n, np.uint16) if flags is None else np.asarray(flags, np.uint16),
    }


def _incoming(parts: list[dict], seq: int) -> Rows:
    ids = [p["request_id"] for p in parts]
    return Rows(
        meta=RowsMeta(DEMO_RUN, "demo", seq, DEMO_SHAPE, source=Source.SYNTHETIC),
        request_ids=ids,
        request_index=np.concatenate([np.full(len(p["positions"]), i, np.int32) for i, p in enumerate(parts)]),
        positions=np.concatenate([p["positions"] for p in parts]),
        token_ids=np.concatenate([p["tokens"] for p in parts]),
        experts=np.concatenate([p["experts"] for p in parts]),
        flags=np.concatenate([p["flags"] for p in parts]),
    )


def load_demo(pipeline: IngestPipeline, seed: int = 7) -> RunRecord:
    """Store the demo run (once: it is idempotent) and return its run summary.

    A store that holds the whole demo already (its comparison is stored last) is not written again: the
    routes are not even made (a second `serve --demo` starts at once). Its batches go through `pipeline`, as an
    ingest's would."""
    store = pipeline.store
    if store.has_run(DEMO_RUN) and _stored_compare(store) is not None:
        return store.run_summary(DEMO_RUN)
    rng = np.random.default_rng(seed)
    finished: dict[str, int] = {}
    clean = []
    for i in range(16):
        n = int(rng.integers(64, 2048))
        clean.append(_rows(f"clean-{i:02d}", np.arange(n), synthetic_routes(rng, n), rng.integers(0, 32000, n)))
        finished[f"clean-{i:02d}"] = n + 1
    pipeline.ingest(_incoming(clean, 0))

    n = 512
    kinds = ("zero", "duplicate", "out-of-range", "stale", "gap", "padding", "conflict")
    bad = {name: synthetic_routes(rng, n) for name in kinds}
    bad["zero"][100:104] = 0  # never-written buffer rows
    bad["duplicate"][200, 5, 1] = bad["duplicate"][200, 5, 0]  # one layer repeats an id
    bad["out-of-range"][300, 10, 3] = 255  # padding -1 cast to uint8
    # another request's row
    bad["stale"][50] = clean[0]["experts"][10].reshape(DEMO_SHAPE.num_moe_layers, DEMO_SHAPE.top_k)
    writer_stale = np.zeros(n, np.uint16)
    writer_stale[400:402] = Flag.STALE  # the capture's write stamp said: not written this step
    tokens = {name: rng.integers(0, 32000, n) for name in bad}
    parts = []
    for name, experts in bad.items():
        positions = np.arange(n)
        flags = writer_stale if name == "stale" else None
        if name == "gap":
            keep = (positions < 128) | (positions >= 160)  # 32 positions never sent
            parts.append(_rows(f"flagged-{name}", positions[keep], experts[keep], tokens[name][keep]))
        elif name == "padding":
            pad = np.zeros(n + 4, np.uint16)
            pad[n:] = Flag.PADDING  # capture-side padding rows: dropped, never data
            padded = np.concatenate([experts, np.full((4, *experts.shape[1:]), 255, experts.dtype)])
            parts.append(_rows(f"flagged-{name}", np.arange(n + 4), padded, np.arange(n + 4), pad))
        else:
            parts.append(_rows(f"flagged-{name}", positions, experts, tokens[name], flags))
        finished[f"flagged-{name}"] = n + 1
    pipeline.ingest(_incoming(parts, 1))
    # The same positions again with other ids: a recompute that disagrees.
    again = synthetic_routes(rng, 3)
    pipeline.ingest(_incoming([_rows("flagged-conflict", [20, 21, 22], again, tokens["conflict"][20:23])], 2))
    for request_id, num_tokens in finished.items():
        store.finish(DEMO_RUN, request_id, num_tokens, RequestStatus.FINISHED)
    # One request still generating (open), and one aborted halfway.
    for seq, (request_id, n) in enumerate((("open-0", 300), ("aborted-0", 90)), start=3):
        part = _rows(request_id, np.arange(n), synthetic_routes(rng, n), rng.integers(0, 32000, n))
        pipeline.ingest(_incoming([part], seq))
    store.finish(DEMO_RUN, "aborted-0", 91, RequestStatus.ABORTED)
    load_demo_compare(store)
    return store.run_summary(DEMO_RUN)


DEMO_COMPARE = "demo-r3"


def _stored_compare(store: RouteStore) -> dict | None:
    """The demo's comparison as stored, or None before it is (it is the demo's last write)."""
    return next((c for c in store.compares.list(DEMO_RUN) if c["compare_id"] == DEMO_COMPARE), None)


def load_demo_compare(store: RouteStore, seed: int = 11) -> dict:
    """A stored comparison on the demo run, as a trainer without replay would post it.

    The "trainer" routing is the recorded one of four clean requests with one
    expert swapped in about 6% of (token, layer) (12% in the last four layers):
    roughly the R3 paper's picture (about 10% router-level, over 90% token-level
    mismatch). Idempotent: a fixed compare id, stored once.
    """
    existing = _stored_compare(store)
    if existing is not None:
        return existing
    rng = np.random.default_rng(seed)
    ids, positions, rows = [], [], []
    for i in range(4):
        request_id = f"clean-{i:02d}"
        route = store.read_route(DEMO_RUN, request_id)
        experts = route.experts_3d().copy()
        n, num_layers, top_k = experts.shape
        rate = np.full(num_layers, 0.06)
        rate[-4:] = 0.12
        change = rng.random((n, num_layers)) < rate
        t, layer = np.nonzero(change)
        # a replacement id not already in the row: the first of 16 random candidates that is not
        candidates = rng.integers(0, DEMO_SHAPE.num_experts, (len(t), 16)).astype(experts.dtype)
        taken = (candidates[:, :, None] == experts[t, layer][:, None, :]).any(axis=-1)
        pick = candidates[np.arange(len(t)), np.argmax(~taken, axis=1)]
        experts[t, layer, rng.integers(0, top_k, len(t))] = pick
        ids += [request_id] * n
        positions.append(route.positions)
        rows.append(experts)
    # the body a trainer posts (replay_client.trainer.compare_body builds the same one)
    body = build_compare_body(DEMO_SHAPE, ids, np.concatenate(positions), np.concatenate(rows), run_id=DEMO_RUN)
    doc, per_request = run_compare(store, DEMO_RUN, body, "demo: trainer without replay", compare_id=DEMO_COMPARE)
    store.compares.save(doc, per_request)
    return doc
