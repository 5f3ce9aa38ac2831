"""What runs in the inference worker (torch): the rows' sharding, its restore, the PCP router mask, the recorder.

Engine-neutral; the public names are re-exported lazily by `capture` (see its docstring).
"""
