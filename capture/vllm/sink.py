"""The sink process: turns a worker's captured steps into rows for the service.

One per sending worker, started by `handoff.StepHandoff` as `python -m capture.vllm.sink FD`
on the CPUs its worker is not bound to.
It reads frames (`frames.py`) from the pipe FD, in order: a config (SenderConfig
fields; the token comes in the environment), then steps and finish events, then
close (or end of input),
and does what used to run on the worker's forward thread: map rows to the user's
request ids (`StepBook`), drop rejected spec-decode rows, and hand rows and finish
events to a `RouteSender` (batching, Arrow encoding, HTTP, spill). Being another
process, none of it takes the worker's GIL or its cores. End of input (the worker
exited, even by kill -9) closes the sender like a "close" frame: what is queued is
sent, or spilled for the next start.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import numpy as np

from capture.vllm import frames
from capture.vllm.step import StepBook, StepRowsMeta

log = logging.getLogger("routing_replay.vllm")

ENV_SINK_TOKEN = "ROUTING_REPLAY_SINK_TOKEN"


def read_body(stream) -> bytes | None:
    """The next frame's body, or None at end of input (also for a frame cut short by the writer's death)."""
    header = stream.read(frames.LENGTH.size)
    if len(header) < frames.LENGTH.size:
        return None
    (size,) = frames.LENGTH.unpack(header)
    body = stream.read(size)
    return body if len(body) == size else None


class Sink:
    def __init__(self, sender) -> None:
        self.sender = sender
        self.book = StepBook()

    def step(self, frame: frames.StepFrame) -> None:
        meta = StepRowsMeta(frame.req_ids, frame.query_start_loc, frame.positions, frame.token_ids)
        keep = self.book.keep_mask(meta, frame.sampled, frame.spec)
        names, index, keep = self.book.row_ids(meta, keep)
        if not index.size:
            return
        sel = np.flatnonzero(keep)
        token_ids = None if frame.token_ids is None else frame.token_ids[sel]
        self.sender.submit((names, index), frame.positions[sel], frame.experts[sel], token_ids=token_ids,
                           flags=frame.flags[sel])

    def finish(self, ended: list[tuple]) -> None:
        for internal_id, num_tokens, status in ended:
            done = self.book.finish(internal_id, num_tokens, status)
            if done is not None:
                self.sender.finish(*done)


def main(fd: int) -> int:
    from capture.sender import RouteSender, SenderConfig
    from replay_schema import RunShape

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's end of the pipe decides when to stop
    stream = os.fdopen(fd, "rb", buffering=1 << 20)
    first = read_body(stream)
    if first is None or first[:1] != b"P":
        log.error("routing-replay sink: no configuration frame; exiting")
        return 2
    kind, fields = frames.unpack(first, None, None)
    if kind != "config":
        log.error("routing-replay sink: the first frame is %r, not the configuration; exiting", kind)
        return 2
    fields = dict(fields)
    shape = RunShape(**fields.pop("shape"))
    sender = RouteSender(SenderConfig(shape=shape, token=os.environ.get(ENV_SINK_TOKEN) or None, **fields))
    sink = Sink(sender)
    close_timeout = 30.0
    while (body := read_body(stream)) is not None:
        kind = "frame"
        try:
            kind, value = frames.unpack(body, shape.dtype, (shape.num_layers, shape.top_k))
            if kind == "step":
                sink.step(value)
            elif kind == "finish":
                sink.finish(value)
            elif kind == "close":
                close_timeout = float(value)
                break
        except Exception:  # noqa: BLE001 - one bad step must not stop the others
            log.exception("routing-replay sink: failed to handle a %s", kind)
    sender.close(close_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
