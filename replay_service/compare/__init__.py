"""Rollout-vs-training comparison: a trainer's own routing against the recorded one (`POST .../compare`).

    comparison.py   a compare body against the run's recorded rows: the answer, and the per-token bits to store
    agreement.py    the figures (pure numpy): router- and token-level mismatch, Jaccard, worst tokens and layers

The feature's other rooms are on their own floors: the body's format in `replay_format/compare.py`, the stored
comparisons in `store/tables/compares.py`, the HTTP routes in `api/compares.py`.
"""
