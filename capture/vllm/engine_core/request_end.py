"""Runs in vLLM's engine core: how a vLLM request ended, as the plugin records it (`finish_status`)."""

from __future__ import annotations

from replay_format.request_notes import FinishStatus


def finish_status(status) -> FinishStatus:
    """vLLM's `RequestStatus` (any FINISHED_ABORTED... is an abort) as a FinishStatus."""
    return FinishStatus.ABORTED if "ABORTED" in str(getattr(status, "name", status)) else FinishStatus.FINISHED
