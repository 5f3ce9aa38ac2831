"""The ingest pipeline in process (no HTTP): repeats and CONFLICT, decided once, and what reads serve.

The rule (rows.md, "Flags"): the same position twice is a resend when identical (stored once,
served once) and CONFLICT when different; the first stored row is served. Reads only pick that
row; they decide no CONFLICT themselves.
"""

from __future__ import annotations

import sqlite3

import numpy as np
import pyarrow as pa
import pytest

from replay_format import NO_TOKEN, Flag, FormatError
from replay_format.rows import Rows, RowsMeta, build_rows, encode_stream
from replay_service.app import open_store
from replay_service.errors import Conflict, UnsupportedMediaType
from replay_service.ingest.decode import decode_route
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.store import RouteStore
from replay_service.store.requests.rows import assemble_route
from tests.support.data import QWEN3_SHAPE, routes

SHAPE = QWEN3_SHAPE


@pytest.fixture
def store(tmp_path):
    store = open_store(ServiceSettings(data_dir=tmp_path / "data", fsync=False))
    yield store
    store.close()


@pytest.fixture
def ingest(store):
    """The ingest pipeline over `store` (as the app wires it): its `ingest`."""
    pipeline = IngestPipeline.over(store)
    yield pipeline.ingest
    pipeline.close()


def _rows(seq: int, positions, experts: np.ndarray, request: str = "a", run: str = "run") -> Rows:
    n = len(positions)
    return Rows(RowsMeta(run, "w", seq, SHAPE), [request], np.zeros(n, np.int32), np.asarray(positions, np.int32),
                np.arange(n, dtype=np.int32), experts.reshape(n, -1), np.zeros(n, np.uint16))


def _conflicts(store: RouteStore, request: str = "a") -> int:
    return store.request_summary("run", request).flagged[Flag.CONFLICT]


def test_identical_repeat_in_one_batch_is_stored_once_and_quiet(store, ingest):
    ex = routes(np.random.default_rng(1), 6)
    answer = ingest(_rows(0, [0, 1, 2, 2, 3, 4, 5], ex[[0, 1, 2, 2, 3, 4, 5]]))
    assert answer.stored and answer.flagged == {}
    route = store.read_route("run", "a")
    assert route.positions.tolist() == list(range(6)) and not route.flags.any()
    assert route.experts.tobytes() == ex.reshape(6, -1).tobytes()
    assert store.request_summary("run", "a").rows == 6 and _conflicts(store) == 0


@pytest.mark.parametrize("order", [[0, 1], [0, 0, 1], [0, 1, 1], [0, 1, 0]])
def test_differing_repeat_in_one_batch_flags_the_served_first_row(store, order, ingest):
    # `order`: which version each repeat of position 2 carries (0 first); any difference is one CONFLICT.
    rng = np.random.default_rng(2)
    ex = routes(rng, 4)
    versions = [ex[2], routes(rng, 1)[0]]
    rows = np.concatenate([ex[:2], [versions[v] for v in order], ex[3:]])
    answer = ingest(_rows(0, [0, 1, *[2] * len(order), 3], rows))
    route = store.read_route("run", "a")
    assert route.experts[2].tobytes() == ex[2].tobytes()  # the first sent is served
    assert route.flags.tolist() == [0, 0, int(Flag.CONFLICT), 0]
    assert answer.flagged == {"CONFLICT": 1} and _conflicts(store) == 1
    assert store.request_summary("run", "a").first_flagged_position == 2


def test_repeat_of_a_stored_row_resend_or_conflict(store, ingest):
    rng = np.random.default_rng(3)
    ex = routes(rng, 8)
    ingest(_rows(0, np.arange(8), ex))
    resend = ingest(_rows(1, [6, 7], ex[6:8]))  # a new seq resending stored rows: quiet
    assert resend.stored and resend.flagged == {} and _conflicts(store) == 0
    other = routes(rng, 2)
    answer = ingest(_rows(2, [3, 7, 8], np.concatenate([other, routes(rng, 1)])))  # 3 and 7 differ, 8 is new
    assert answer.flagged == {"CONFLICT": 2}
    route = store.read_route("run", "a")
    assert route.experts[:8].tobytes() == ex.reshape(8, -1).tobytes()
    assert np.flatnonzero(route.flags).tolist() == [3, 7] and set(route.flags[[3, 7]]) == {int(Flag.CONFLICT)}
    summary = store.request_summary("run", "a")
    assert summary.rows == 9 and summary.flagged[Flag.CONFLICT] == 2
    ingest(_rows(3, [3], other[:1]))  # the same disagreement again: still one CONFLICT at 3
    assert _conflicts(store) == 2
    shape, load = store.expert_load("run")
    assert load.sum() == 9 * SHAPE.num_moe_layers * SHAPE.top_k  # served rows only


def test_reads_pick_the_first_stored_row_and_decide_no_conflict():
    ex = routes(np.random.default_rng(4), 3).reshape(3, -1)
    first = build_rows(SHAPE, ["a"] * 2, np.array([0, 1]), ex[:2])
    later = build_rows(SHAPE, ["a"] * 2, np.array([1, 2]), ex[1:][::-1])  # position 1 differs, unflagged
    route = assemble_route("a", SHAPE, [first, later], 0, 3, {})
    assert route.experts[:2].tobytes() == ex[:2].tobytes()
    assert not route.flags.any()  # whether 1 conflicts was decided at ingest; this read was told nothing
    assert route.token_ids.tolist() == [NO_TOKEN] * 3


def test_finish_status_and_its_conflicts(store, ingest):
    ingest(_rows(0, np.arange(4), routes(np.random.default_rng(5), 4)))
    assert store.finish("run", "a", 5, "aborted").status == "aborted"
    assert store.finish("run", "a", 5, "aborted").num_tokens == 5  # the same end again is fine
    with pytest.raises(Conflict, match="already aborted with 5 tokens"):
        store.finish("run", "a", 5, "finished")


def test_arrow_route_upload_takes_the_run_shape_when_the_body_names_none(store, ingest):
    ex = routes(np.random.default_rng(6), 5)
    ingest(_rows(0, [0], ex[:1], request="first"))
    batch = build_rows(SHAPE, ["ignored"] * 5, np.arange(5), ex).replace_schema_metadata({})
    upload = decode_route("application/vnd.apache.arrow.stream", encode_stream(batch), "run", "up",
                          store.run_shape("run"))
    rows = upload.rows
    assert rows.meta.shape == SHAPE and rows.meta.writer_id == "upload/up@0" and rows.request_ids == ["up"]
    assert (upload.start, upload.num_tokens, rows.meta.seq) == (0, 6, 5)
    assert ingest(rows).stored
    assert store.read_route("run", "up").experts.tobytes() == ex.reshape(5, -1).tobytes()
    with pytest.raises(FormatError, match="lacks num_layers"):  # a new run: the body must name its shape
        decode_route("application/vnd.apache.arrow.stream", encode_stream(batch), "fresh", "up", None)
    with pytest.raises(UnsupportedMediaType):
        decode_route("text/csv", b"", "run", "up", None)


def test_an_index_written_before_the_rename_is_migrated(tmp_path):
    data = tmp_path / "data"
    store = open_store(ServiceSettings(data_dir=data, fsync=False))
    ex = routes(np.random.default_rng(7), 4)
    IngestPipeline.over(store).ingest(_rows(0, np.arange(4), ex))
    store.close()
    with sqlite3.connect(data / "index.sqlite") as conn:  # as the previous release left it
        conn.execute("ALTER TABLE runs RENAME COLUMN num_moe_layers TO num_layers")
        conn.execute("PRAGMA user_version = 0")
    again = open_store(ServiceSettings(data_dir=data, fsync=False))
    assert again.run_summary("run").shape.num_moe_layers == SHAPE.num_moe_layers
    assert IngestPipeline.over(again).ingest(_rows(1, np.arange(4, 8), ex)).stored
    assert again.read_route("run", "a").num_rows == 8
    again.close()


def test_all_padding_request_is_counted_not_stored(store, ingest):
    ex = routes(np.random.default_rng(8), 3)
    rows = _rows(0, [0, 1, 2], ex)
    rows.request_ids, rows.request_index = ["a", "pad"], np.array([0, 1, 1], np.int32)
    rows.flags[1:] = Flag.PADDING
    answer = ingest(rows)
    assert answer.rows == 1 and answer.padding_dropped == 2
    assert store.request_summary("run", "pad").flagged[Flag.PADDING] == 2
    assert store.request_summary("run", "pad").rows == 0


def test_batch_of_padding_only_is_stored_empty(store, ingest):
    rows = _rows(0, [0, 1], routes(np.random.default_rng(10), 2))
    rows.flags[:] = Flag.PADDING
    answer = ingest(rows)
    assert answer.stored and answer.rows == 0 and answer.padding_dropped == 2
    assert store.request_summary("run", "a").flagged[Flag.PADDING] == 2
    assert ingest(rows).outcome == "duplicate"


def test_segment_has_the_batch_rows_in_request_position_order(store, ingest):
    ex = routes(np.random.default_rng(9), 4)
    rows = _rows(0, [3, 1, 2, 0], ex)
    ingest(rows)
    (path,) = (store.segments_root / "run").glob("*.arrow")
    with pa.memory_map(str(path)) as source:
        segment = pa.ipc.open_file(source).get_batch(0)
    assert segment.column("position").to_pylist() == [0, 1, 2, 3]
    assert segment.schema.metadata[b"format"] == b"routing-replay.rows"
