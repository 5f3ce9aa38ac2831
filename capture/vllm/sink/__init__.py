"""What the vLLM plugin runs in its sink process, one per sending worker (no torch, no vLLM).

Started by `capture.vllm.worker.handoff` as `python -m capture.vllm.sink FD`: `process.py`
(read frames, hand rows to a `capture.sender.RouteSender`), `book.py` (`StepBook`: request
ids, spec-decode drops, finish lengths).
"""
