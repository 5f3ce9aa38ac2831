"""What the vLLM plugin runs in vLLM's engine-core process.

`scheduler.py` (finish notes for the workers, kept in the finish journal `capture/vllm/finish_notes.py`
until delivered), `prefix_hits.py` (which request computed each prefix-cache block a request reuses).
"""
