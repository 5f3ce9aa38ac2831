"""What the vLLM plugin runs in each vLLM worker process (torch, vLLM internals).

`runner.py` / `runner_v2.py` (the V1 and V2 model-runner hooks), `worker_capture.py` (one `WorkerCapture`
per worker: starts the capture at load_model), `step_hooks.py` (`StepHooks`: what each hook does every
step), `startup_checks.py` (the settings refused at start-up), `recorder_choice.py` (the capture mode's
recorder), `binder.py` (router capture slots), `forward_sharding.py` (vLLM forward context ->
`capture.RowSharding`), `graph_capture.py` (the graph-safe router callback), `frame_buffer.py` (the
step frame built in place), `step_profile.py` (per-part timings, on request). Steps go to the sink
through its client, `capture.vllm.sink.handoff`.
"""
