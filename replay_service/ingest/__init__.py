"""Ingest: one batch of rows through a visible pipeline, one module per stage (runs in the service).

    decode.py    body -> Rows                       (engine_outputs.py: .npy and SGLang JSON routes)
    checks/      Rows -> CheckedRows                (`replay_service.checks`: check.py, kernels.py)
    segment.py   CheckedRows -> Segment             (a durable Arrow IPC file)
    commit.py    Segment -> IngestResult            (one index transaction; result.py the answer)
    pipeline.py  `IngestPipeline`: check -> segment -> commit over one store, wired by the app

CONFLICT (the same position twice with different ids) is decided in `checks/check.py` only.
"""
