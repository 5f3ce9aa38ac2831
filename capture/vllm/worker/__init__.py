"""What the vLLM plugin runs in each vLLM worker process (torch, vLLM internals).

`runner.py` (the V1 model-runner hooks: one `WorkerCapture` per worker), `binder.py` (router
capture slots), `sharding.py` (vLLM forward context -> `capture.RowSharding`), `handoff.py`
(captured steps to the sink process as `replay_format.step_frame` frames), `sink_process.py` (starts the
sink outside vLLM's process tree; its Popen-like handle).
"""
