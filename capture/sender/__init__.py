"""The sender: routing rows, finish events and references to the replay service, in order (no torch).

Engine-neutral (numpy, pyarrow, httpx): the vLLM plugin runs it in its sink process, another engine may run it in
its worker. Its modules, top floor first:
- `route_sender`: `RouteSender`, `submit()` and its two threads (batching, HTTP with backoff, spill, drain);
- `spill`: the spill folder (`SpillFolder`), items the service has not taken yet, one fsynced file each;
- `items`: what the sender posts, one call each (`Item`), and how the batcher makes them (`ItemMaker`);
- `row_chunk`: rows on their way, copied and typed (`RowChunk`, `RequestIndex`);
- `config`: the settings (`SenderConfig`, which crosses processes as a checked dict) and counters (`SenderStats`).

    from capture.sender import RouteSender, SenderConfig

The names below are imported on first use (PEP 562): the worker hands a `SenderConfig` to its sink
(`capture.vllm.sink.handoff`) without importing the sender's threads or httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what mypy reads; at run time `__getattr__` imports each on first use
    from capture.sender.config import SenderConfig, SenderStats
    from capture.sender.route_sender import RouteSender
    from capture.sender.row_chunk import RequestIndex

_HOME = {
    "RouteSender": "capture.sender.route_sender",
    "SenderConfig": "capture.sender.config", "SenderStats": "capture.sender.config",
    "RequestIndex": "capture.sender.row_chunk",
}

__all__ = ["RequestIndex", "RouteSender", "SenderConfig", "SenderStats"]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'capture.sender' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
