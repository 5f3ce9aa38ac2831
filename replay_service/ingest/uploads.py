"""Decoded route uploads stored through the ingest pipeline: one request's route (or a turn), or an engine's answer.

An upload that cannot land is refused before anything is stored (`RouteStore.check_upload`: a start past the
request's end, a finish that disagrees); an answer of many items checks every item first, so a refusal stores none
of them. Each upload is then stored as one batch of rows and its request's end moved (`RouteStore.end_upload`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from replay_service.ingest.decode import Upload
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.ingest.responses import ResponseItem
from replay_service.ingest.result import IngestResult


def store_upload(pipeline: IngestPipeline, run_id: str, request_id: str, upload: Upload,
                 finish: bool) -> IngestResult:
    """Store one request's upload (checked first); its batch's answer."""
    pipeline.store.check_upload(run_id, request_id, upload.start, upload.num_tokens, finish)
    return _store(pipeline, run_id, request_id, upload, finish)


def store_items(pipeline: IngestPipeline, run_id: str, items: Sequence[ResponseItem],
                finish: bool) -> list[IngestResult]:
    """Store every item of an engine's answer, each checked before the first is stored; their answers in order."""
    for item in items:
        pipeline.store.check_upload(run_id, item.request_id, item.upload.start, item.upload.num_tokens, finish)
    return [_store(pipeline, run_id, item.request_id, item.upload, finish) for item in items]


def _store(pipeline: IngestPipeline, run_id: str, request_id: str, upload: Upload, finish: bool) -> IngestResult:
    result = pipeline.ingest(upload.rows)
    pipeline.store.end_upload(run_id, request_id, upload.start, upload.num_tokens, finish)
    # the engine's padding cut before the rows were made is answered with the padding rows the ingest dropped
    return dataclasses.replace(result, padding_dropped=result.padding_dropped + upload.padding_rows_cut,
                               padding_slots_dropped=upload.padding_slots_cut)
