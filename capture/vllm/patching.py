"""How the plugin patches vLLM's classes (in whichever vLLM process registers it).

Every wrapper it installs is marked, so a second `register()` in the same process (vLLM
calls plugins once per process, tests call them again) finds the mark and patches nothing, and carries what
it wraps as `__wrapped__`, so `inspect.signature` (the hook-point check) reads vLLM's parameters through it.
"""

from __future__ import annotations

from typing import Any

MARK = "_routing_replay"


def is_patched(fn: Any) -> bool:
    """True when `fn` is one of the plugin's wrappers."""
    return bool(getattr(fn, MARK, False))


def patch(owner: Any, name: str, wrapper: Any) -> None:
    """Install `wrapper` as `owner.<name>`, marked as the plugin's, over what `owner.<name>` was."""
    setattr(wrapper, MARK, True)
    wrapped = getattr(owner, name, None)
    if wrapped is not None:
        wrapper.__wrapped__ = wrapped
    setattr(owner, name, wrapper)
