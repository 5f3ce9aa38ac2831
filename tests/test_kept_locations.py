"""Where a request's rows lie, kept between trainer reads (store/requests/kept.py), never serving what changed.

A trainer slice keeps each whole request's location in its worker, and the next plain read of the request reuses it:
no index query for its spans, no span walked again. It is reused only while the run, the request's record and its
segments are the ones it was made from. Here: in one process, a second read of every rank's slice reuses every
location and answers the same bytes as a store that kept none; through a real server of one worker (whose first read
kept every location it made), a later read answers what changed since: a request's further rows (it open, or finished
before its last rows), a run deleted and created again under the same id by the same writer (the same segment paths,
other ids), and a segment closed, damaged and opened again is refused. Ranks asking for a request at once locate it
once.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from replay_client import ReplayClient
from replay_client.trainer import megatron_query
from replay_format import RunShape
from replay_format.rows import Rows, RowsMeta
from replay_format.weight_versions import WeightVersions
from replay_service.api.trainer import MegatronQueryBody
from replay_service.app import open_store
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.trainer.plans import SliceLimits
from replay_service.trainer.reads import read_slice
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess

SHAPE = RunShape(num_moe_layers=4, top_k=2, num_experts=16)
RUN = "kept"
REQUESTS = [f"q{i}" for i in range(6)]
ROWS = 40  # rows per request: each sent in 4 batches of 10 positions, the requests interleaved (many spans each)


def _sent(seed: int = 3) -> np.ndarray:
    return routes(np.random.default_rng(seed), len(REQUESTS) * ROWS, SHAPE).reshape(len(REQUESTS), ROWS, -1)


def _parts(sent: np.ndarray, upto: int = ROWS):
    """The requests' rows `[0, upto)` as batches of 10 positions of every request: (seq, names, positions, ids)."""
    for seq, lo in enumerate(range(0, upto, 10)):
        hi = min(lo + 10, upto)
        yield (seq, [r for r in REQUESTS for _ in range(lo, hi)], np.tile(np.arange(lo, hi, dtype=np.int32),
               len(REQUESTS)), sent[:, lo:hi].reshape(-1, SHAPE.row_width))


def _batches(sent: np.ndarray, upto: int = ROWS) -> list[bytes]:
    """`_parts` as the bodies a writer posts."""
    return [batch_bytes(RUN, "w", seq, names, positions, ids, shape=SHAPE)
            for seq, names, positions, ids in _parts(sent, upto)]


def _queries(cp: int = 2) -> list:
    """Every CP rank's megatron THD query over all the requests (the bodies the API parses)."""
    seqs = [(RUN, r) for r in REQUESTS]
    return [MegatronQueryBody.model_validate(
        megatron_query(seqs, "thd", cp_size=cp, cp_rank=rank).to_json()).query() for rank in range(cp)]


def _answer(store, query) -> bytes:
    return b"".join(bytes(p) for p in read_slice(store, query, SliceLimits.of(store.settings)).parts)


def _stored(tmp_path: Path, sent: np.ndarray):
    """A store in this process holding `sent`, every request finished."""
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    pipeline = IngestPipeline.over(store)
    for seq, _names, positions, ids in _parts(sent):
        index = np.repeat(np.arange(len(REQUESTS), dtype=np.int32), len(positions) // len(REQUESTS))
        pipeline.ingest(Rows(RowsMeta(RUN, "w", seq, SHAPE), list(REQUESTS), index, positions, positions, ids,
                             np.zeros(len(positions), np.uint16), WeightVersions.unknown(len(positions))))
    for r in REQUESTS:
        store.finish(RUN, r, ROWS + 1, "finished")
    return store


def test_a_second_read_reuses_every_location_and_answers_the_same_bytes(tmp_path, monkeypatch):
    sent = _sent()
    store = _stored(tmp_path / "a", sent)
    fresh = _stored(tmp_path / "b", sent)
    try:
        first = [_answer(store, q) for q in _queries()]
        asked: list[list[str]] = []
        spans_of_requests = store.index.spans_of_requests

        def spans_asked(run_id, request_ids):
            asked.append(list(request_ids))
            return spans_of_requests(run_id, request_ids)

        monkeypatch.setattr(store.index, "spans_of_requests", spans_asked)
        monkeypatch.setattr(store.index, "spans", lambda *a: pytest.fail("a kept request's spans were read"))
        again = [_answer(store, q) for q in _queries()]
        assert asked == [[], []]  # every request's location reused: no span read, for either rank
        assert again == first == [_answer(fresh, q) for q in _queries()]
    finally:
        store.close()
        fresh.close()


def _reads_what_was_sent(client: ReplayClient, sent: np.ndarray, upto: int) -> None:
    """One rank's slice of every request (THD, no CP, rows not stored read as filler): each real token holds the
    ids sent at its (sequence, position), and the real tokens are positions `[0, upto)` of each."""
    got = client.megatron_batch([(RUN, r) for r in REQUESTS], packing="thd", missing="filler")
    real = got.valid.astype(bool)
    assert np.array_equal(got.position[real], np.tile(np.arange(upto), len(REQUESTS)))
    assert got.experts[real].tobytes() == sent[got.sequence[real], got.position[real]].tobytes()


@pytest.fixture
def one_worker(tmp_path):
    with ServiceProcess(tmp_path / "data", workers=1, env={"REPLAY_FSYNC": "false"}) as service:
        yield service


@pytest.mark.parametrize("finished", [False, True], ids=["open", "finished before its last rows"])
def test_rows_that_arrive_after_a_request_s_location_was_kept_are_read(one_worker, finished):
    sent = _sent()
    with ReplayClient(one_worker.url) as client:
        for body in _batches(sent, upto=20):
            assert client.ingest(body).stored
        if finished:  # 40 rows expected, 20 stored: the same length before and after the rest arrives
            for r in REQUESTS:
                client.finish(RUN, r, ROWS + 1)
        _reads_what_was_sent(client, sent, 20)  # every request located and kept: positions 0..19
        for body in _batches(sent)[2:]:
            assert client.ingest(body).stored
        for r in REQUESTS:
            client.finish(RUN, r, ROWS + 1)
        _reads_what_was_sent(client, sent, ROWS)


def test_a_run_deleted_and_created_again_by_the_same_writer_reads_its_new_rows(one_worker):
    first, second = _sent(3), _sent(4)
    with ReplayClient(one_worker.url) as client:
        for sent in (first, second):
            for body in _batches(sent):  # the same writer and seqs: the same segment paths
                assert client.ingest(body).stored
            for r in REQUESTS:
                client.finish(RUN, r, ROWS + 1)
            _reads_what_was_sent(client, sent, ROWS)
            assert httpx.delete(f"{one_worker.url}/v1/runs/{RUN}", timeout=30).status_code == 200


def test_a_segment_closed_and_damaged_after_its_request_was_kept_is_refused(tmp_path):
    env = {"REPLAY_FSYNC": "false", "REPLAY_OPEN_SEGMENT_CACHE": "1"}  # every read opens its segments again
    sent = _sent()
    with ServiceProcess(tmp_path / "data", workers=1, env=env) as service, ReplayClient(service.url) as client:
        for body in _batches(sent):
            assert client.ingest(body).stored
        for r in REQUESTS:
            client.finish(RUN, r, ROWS + 1)
        _reads_what_was_sent(client, sent, ROWS)
        segment = next(p for p in (tmp_path / "data" / "runs" / RUN).rglob("*.arrow")
                       if sent[0, 0].tobytes() in p.read_bytes())
        blob = bytearray(segment.read_bytes())
        blob[blob.find(sent[0, 0].tobytes())] ^= 0x01
        segment.write_bytes(bytes(blob))
        answer = httpx.post(f"{service.url}/v1/trainer/megatron", timeout=30, json=megatron_query(
            [(RUN, r) for r in REQUESTS], "thd").to_json())
        assert answer.status_code == 503, answer.text[:300]
        assert answer.json()["segment"] == segment.relative_to(tmp_path / "data" / "runs").as_posix()


def test_ranks_asking_for_a_request_at_once_locate_it_once(tmp_path, monkeypatch):
    import threading

    from replay_service.store.requests import rows

    store = _stored(tmp_path, _sent())
    located: list[str] = []
    locate = rows._locate

    def counted(request_id, *args):
        located.append(request_id)
        return locate(request_id, *args)

    monkeypatch.setattr(rows, "_locate", counted)
    queries = _queries() * 4  # each CP rank's slice, asked by its TP ranks and again
    start = threading.Barrier(len(queries))
    answers: list[bytes] = [b""] * len(queries)

    def rank(i: int) -> None:
        start.wait()
        answers[i] = _answer(store, queries[i])

    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(located) == sorted(REQUESTS)  # each located once, for every rank
        assert answers[::2] == [answers[0]] * 4 and answers[1::2] == [answers[1]] * 4
    finally:
        store.close()
