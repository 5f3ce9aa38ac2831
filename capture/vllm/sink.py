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
import time

import numpy as np

from capture.vllm import frames
from capture.vllm.step import StepBook, StepRowsMeta

log = logging.getLogger("routing_replay.vllm")

ENV_SINK_TOKEN = "ROUTING_REPLAY_SINK_TOKEN"


def read_frames(fd: int, pause_s: float = 0.02):
    """Frame bodies from the pipe, in order, until end of input; None after each read's frames.

    Read in bursts: after draining the pipe the sink sleeps `pause_s` before reading
    again, so it wakes ~50 times a second rather than once per step. Woken per step,
    it preempted vLLM's engine-core process on the shared core each time, and the
    engine's steps waited on that (bench/vllm_overhead.py: on/off 0.87 vs 0.98 without
    sending). A frame cut short by the writer's death is dropped.
    """
    pending = bytearray()
    while chunk := os.read(fd, _READ_SIZE):
        pending += chunk
        at = 0
        while len(pending) - at >= frames.LENGTH.size:
            (size,) = frames.LENGTH.unpack_from(pending, at)
            end = at + frames.LENGTH.size + size
            if end > len(pending):
                break
            yield bytes(pending[at + frames.LENGTH.size : end])
            at = end
        del pending[:at]
        yield None  # end of what this read brought
        if len(chunk) < _READ_SIZE:  # drained: let the next frames gather
            time.sleep(pause_s)


_READ_SIZE = 1 << 20
# Below the engine's processes: the sink needs a few percent of a core on average and has
# seconds of slack (the pipe, then the worker's backlog); vLLM's engine core is on every
# step's critical path. At the same priority, its bursts delayed the engine's steps.
_NICE = 10


class Sink:
    """Steps and finish events to rows and finish calls, in order.

    Plain steps that arrive together are merged and handed to the sender as one: the
    bookkeeping and the copies then run once per read rather than once per step.
    """

    def __init__(self, sender) -> None:
        self.sender = sender
        self.book = StepBook()
        self._plain: list[frames.StepFrame] = []

    def step(self, frame: frames.StepFrame) -> None:
        if frame.spec is None and frame.sampled is None:
            self._plain.append(frame)
            return
        self.flush()
        self._rows(frame)

    def finish(self, ended: list[tuple]) -> None:
        self.flush()  # a request's rows go before its end
        for internal_id, num_tokens, status in ended:
            done = self.book.finish(internal_id, num_tokens, status)
            if done is not None:
                self.sender.finish(*done)

    def flush(self) -> None:
        group, self._plain = self._plain, []
        if len(group) > 1 and len({f.token_ids is None for f in group}) == 1:
            group = [_merged(group)]
        for frame in group:
            self._rows(frame)

    def _rows(self, frame: frames.StepFrame) -> None:
        meta = StepRowsMeta(frame.req_ids, frame.query_start_loc, frame.positions, frame.token_ids)
        keep = self.book.keep_mask(meta, frame.sampled, frame.spec)
        names, index, keep = self.book.row_ids(meta, keep)
        if not index.size:
            return
        sel = np.flatnonzero(keep)
        token_ids = None if frame.token_ids is None else frame.token_ids[sel]
        self.sender.submit((names, index), frame.positions[sel], frame.experts[sel], token_ids=token_ids,
                           flags=frame.flags[sel])


def _merged(group: list[frames.StepFrame]) -> frames.StepFrame:
    """Consecutive steps as one (a request appears once per step it ran in)."""
    offsets = np.cumsum([0] + [len(f.positions) for f in group])
    query_start_loc = np.concatenate([f.query_start_loc[:-1] + off for f, off in zip(group, offsets)] + [offsets[-1:]])
    token_ids = None if group[0].token_ids is None else np.concatenate([f.token_ids for f in group])
    return frames.StepFrame(
        [rid for f in group for rid in f.req_ids], query_start_loc, np.concatenate([f.positions for f in group]),
        token_ids, np.concatenate([f.experts for f in group]), np.concatenate([f.flags for f in group]),
    )


def main(fd: int) -> int:
    from capture.sender import RouteSender, SenderConfig
    from replay_format import RunShape

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.nice(_NICE)
    for stop in (signal.SIGINT, signal.SIGTERM):  # the worker's end of the pipe decides when to stop
        signal.signal(stop, signal.SIG_IGN)
    bodies = read_frames(fd)
    first = next((body for body in bodies if body is not None), None)
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
    for body in bodies:
        kind = "frame"
        try:
            if body is None:
                sink.flush()
                continue
            kind, value = frames.unpack(body, shape.dtype, (shape.num_moe_layers, shape.top_k))
            if kind == "step":
                sink.step(value)
            elif kind == "finish":
                sink.finish(value)
            elif kind == "close":
                close_timeout = float(value)
                break
        except Exception:  # noqa: BLE001 - one bad step must not stop the others
            log.exception("routing-replay sink: failed to handle a %s", kind)
    try:
        sink.flush()
    except Exception:  # noqa: BLE001
        log.exception("routing-replay sink: failed to hand over the last steps")
    sender.close(close_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
