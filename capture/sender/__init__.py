"""The sender: routing rows, finish events and references to the replay service, in order (no torch).

Engine-neutral (numpy, pyarrow, httpx): the vLLM plugin runs it in its sink process, another engine may run it in
its worker. Its modules, top floor first: `route_sender` (`RouteSender` and its two threads), `spill` (the spill
folder), `items` (what is posted, one call each), `row_chunk` (rows on their way) and `config` (`SenderConfig`,
`SenderStats`).

    from capture.sender import RouteSender, SenderConfig

The names are imported on first use (PEP 562): a `SenderConfig` crosses to the sink without the threads or httpx.
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
