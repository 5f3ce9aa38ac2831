"""The plugin's log, in every process it runs in (engine core, workers, sinks): one logger, `info` and `warn`.

No vLLM, numpy or network import: the sink and the finish journal use it too.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("routing_replay.vllm")


def info(msg: str, *args) -> None:
    """Log one line at INFO; vLLM's logging config may not propagate our logger, so stderr gets it too then."""
    text = msg % args if args else msg
    log.info(text)
    if not log.isEnabledFor(logging.INFO) or not logging.getLogger().handlers:
        print(text, file=sys.stderr, flush=True)


def warn(msg: str, *args) -> None:
    """Log one line at WARNING; to stderr too where vLLM's logging config does not propagate our logger."""
    text = msg % args if args else msg
    log.warning(text)
    if not log.isEnabledFor(logging.WARNING) or not logging.getLogger().handlers:
        print(text, file=sys.stderr, flush=True)
