"""Run health: is a run's routing good enough to train on? Verdicts over a run, a window of it, or a training batch.

    rules.py     the checks (rules), their limits and defaults, a run's overrides
    verdict.py   levels (ok / warn / fail) and how a figure is judged against a limit
    report.py    the answer: figures per check, findings naming requests and first positions, flat metrics
    gather.py    the figures of a scope, read from the store (store/tables/health.py sums, routes for first positions)
    series.py    flag rates and expert-load imbalance over ingest time and per weight version; agreement by step
    recent.py    every run's verdict over the recent window, for /metrics (exporter.py)
"""
