"""Row checks: the service's verdict on every row, shared by ingest, reference resolution and reindex.

    check.py     Rows -> CheckedRows   (padding dropped, sorted, flagged; the one CONFLICT / recompute rule,
                                        `judge_repeats`)
    kernels.py   the compiled row checks `check.py` runs, and the STALE check's table of recent rows

Below the store: these modules read rows and nothing else (no index, no files). The ingest pipeline runs them as
its stage 2 (`replay_service.ingest`); the store's reference resolution (store/requests/references.py) and
`replay-service reindex` (ops/reindex.py) apply the same rules.
"""
