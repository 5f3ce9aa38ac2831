"""Operations: the service's top floor, what an operator runs (`replay-service ...`), above the app factory.

    cli.py          `replay-service`: serve, reindex, verify, delete, gc, export (typer)
    connections.py  the HTTP protocol `serve` runs uvicorn with (bounded connections, no body copy)
    demo.py         a synthetic run with every kind of flagged row (`serve --demo`; benchmarks' rows)
    export.py       `export`: a run's rows to Parquet, read-only
    reindex.py      `reindex`: rebuild the index from segments and run journals
    verify.py       `verify`: check every segment against its checksum, read-only

The tools that open a store open it as the app does (`replay_service.app.open_store`).
"""
