"""Durable ingest throughput through a real server, against today's transport in the same run.

Ours: Arrow IPC record batches (48 x 8 uint8 rows) posted to /v1/ingest.
Baseline: what engines do today: each request's route as int32 ids, base64 inside
JSON (SGLang's `meta_info["routed_experts"]`), posted per request and decoded on
the server (the service's own SGLang upload endpoint, so both end in the same
durable store). Client-side encoding is counted for both. Prints tokens/s and the
ratio; asserts nothing (shared, noisy machines).

    python bench/ingest.py [--tokens 4194304] [--batch-tokens 32768] [--writers 2]

Both transports first send a few untimed batches to another run (the server's
buffers, connections and page cache warm up, as in a long-running service).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # `python bench/ingest.py` from anywhere: tests.support is not installed
    sys.path.insert(0, ROOT)

import httpx
import numpy as np

from replay_format import ARROW_STREAM_MEDIA_TYPE, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_service.demo import bulk_routes
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=48, top_k=8, num_experts=128)



def run_parallel(jobs: list, writers: int, send) -> float:
    """Run `send(http, job)` over jobs split across `writers` threads; seconds elapsed."""
    errors: list = []

    def worker(part):
        with httpx.Client(base_url=url, timeout=300) as http:
            for job in part:
                try:
                    send(http, job)
                except Exception as exc:  # surfaced after the run
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=worker, args=(jobs[w::writers],)) for w in range(writers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def main() -> None:
    global url
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 22)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--request-tokens", type=int, default=1024)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--baseline-tokens", type=int, default=1 << 18, help="the baseline is slow: fewer tokens")
    parser.add_argument("--warmup-batches", type=int, default=8, help="untimed batches (and requests) sent first")
    args = parser.parse_args()

    ids = bulk_routes(args.tokens, 0)
    per_request = args.request_tokens
    with tempfile.TemporaryDirectory() as tmp, ServiceProcess(Path(tmp) / "data") as proc:
        url = proc.url

        # Ours: one Arrow batch = batch_tokens rows of several requests (as a capture sender ships steps).
        batches = []
        for seq, lo in enumerate(range(0, args.tokens, args.batch_tokens)):
            n = min(args.batch_tokens, args.tokens - lo)
            request_ids = [f"r{(lo + i) // per_request}"
                           for i in range(0, n, per_request) for _ in range(per_request)][:n]
            positions = (np.arange(lo, lo + n) % per_request).astype(np.int32)
            batches.append((seq, request_ids, positions, ids[lo : lo + n]))

        def send_arrow(http, job, run_id="bench-arrow"):
            seq, request_ids, positions, experts = job
            meta = RowsMeta(run_id, f"w{seq % args.writers}", seq, SHAPE, source="vllm-plugin")
            body = encode_stream(build_rows(meta, request_ids, positions, experts))
            answer = http.post("/v1/ingest", content=body, headers={"content-type": ARROW_STREAM_MEDIA_TYPE})
            answer.raise_for_status()

        run_parallel(batches[: args.warmup_batches], args.writers, lambda http, job: send_arrow(http, job, "warmup"))
        arrow_s = run_parallel(batches, args.writers, send_arrow)
        arrow_tps = args.tokens / arrow_s

        # Baseline: per request, int32 ids as base64 in JSON, decoded and stored by the server.
        base_ids = ids[: args.baseline_tokens]
        requests = [(r, base_ids[lo : lo + per_request]) for r, lo in enumerate(range(0, len(base_ids), per_request))]

        def send_json(http, job, run_id="bench-json"):
            r, experts = job
            doc = {
                "routed_experts": base64.b64encode(experts.astype(np.int32).tobytes()).decode(),
                "num_layers": SHAPE.num_moe_layers, "top_k": SHAPE.top_k, "num_experts": SHAPE.num_experts,
            }
            answer = http.post(f"/v1/runs/{run_id}/requests/q{r}/routes", content=json.dumps(doc),
                               headers={"content-type": "application/json"})
            answer.raise_for_status()

        run_parallel(requests[: args.warmup_batches], args.writers,
                     lambda http, job: send_json(http, job, "warmup-json"))
        json_s = run_parallel(requests, args.writers, send_json)
        json_tps = len(base_ids) / json_s

        stored = httpx.get(f"{url}/v1/runs/bench-arrow").json()
        assert stored["rows"] == args.tokens, stored
    row_bytes = SHAPE.row_width
    print(f"ingest, {SHAPE.num_moe_layers} x top-{SHAPE.top_k} uint8 rows ({row_bytes} B/token), "
          f"{args.writers} writers, durable (fsync) store")
    print(f"  arrow ipc   {args.tokens:>9} tokens  {arrow_s:7.2f} s  {arrow_tps / 1e6:6.2f} M tokens/s  "
          f"({arrow_tps * row_bytes / 1e6:.0f} MB/s of ids), batches of {args.batch_tokens}")
    print(f"  base64 json {len(base_ids):>9} tokens  {json_s:7.2f} s  {json_tps / 1e6:6.2f} M tokens/s  "
          f"(requests of {per_request} tokens)")
    print(f"  ratio arrow/base64-json: {arrow_tps / json_tps:.1f}x")
    print(json.dumps({"arrow_tokens_per_s": round(arrow_tps), "json_tokens_per_s": round(json_tps),
                      "ratio": round(arrow_tps / json_tps, 2)}))


if __name__ == "__main__":
    main()
