"""The vLLM plugin's sink: a process per sending worker (and per engine core's tee), and its client (no torch/vLLM).

The client, in the capturing process (worker or engine core, which both stand on it): `handoff.py`
(`start_sink`, and `StepHandoff`, the pipe its steps go over as `replay_format.step_frame` frames) and
`launch.py` (`SinkProcess`: starts the sink outside vLLM's process tree, as `process.main(FD, STATUS_FD)`).
The sink process: `process.py` (read frames, hand rows to a `capture.sender.RouteSender`), `book.py`
(`StepBook`: request ids, spec-decode drops, prefix-cache references, finish lengths), `spill_root.py`
(its spill directory's lock, sending what stopped sinks left, `drain`).
"""
