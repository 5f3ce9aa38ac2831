"""What the vLLM plugin runs in vLLM's engine-core process.

`scheduler.py` (finish notes and prefix-cache hits for the workers, as `capture/vllm/scheduler_notes.py`;
the finish notes kept in the finish journal `capture/vllm/finish_notes.py` until delivered),
`prefix_hits.py` (which request computed each prefix-cache block a request reuses),
`weight_version.py` (the engine core's weight version, noted on its scheduler for the workers and the tee),
`routed_experts_tee.py` (with vLLM's own `enable_return_routed_experts` on: the rows its aux-output
connector commits, teed to a sink instead of a second capture).
"""
