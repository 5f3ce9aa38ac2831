"""What the vLLM plugin runs in its sink process, one per sending worker (no torch, no vLLM).

Started by `capture.vllm.worker.sink_process.SinkProcess`, outside vLLM's process tree, as
`process.main(FD, STATUS_FD)`: `process.py` (read frames, hand rows to a `capture.sender.RouteSender`),
`book.py` (`StepBook`: request ids, spec-decode drops, prefix-cache references, finish lengths),
`spill_root.py` (its spill directory's lock, sending what stopped sinks left, `drain`).
"""
