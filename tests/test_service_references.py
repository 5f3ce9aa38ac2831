"""Prefix-cache references through a real server: a request's cached positions read as the rows another
request stored there, in either arrival order, under retries and kill -9, and stored once.

A reference (`POST /v1/runs/{run}/references`) says "request R's positions [start, end) are the rows
request S stored at the same positions" (vLLM served them from S's KV blocks). The service mirrors
S's rows into R's spans (replay_service/store/requests/references.py): no row is copied.
"""

from __future__ import annotations

import sqlite3

import httpx
import numpy as np
import pytest

from replay_client.client import ReplayClient, StrictReadError
from replay_format import Flag, RunShape
from replay_format.request_notes import Reference
from replay_format.rows import Rows, RowsMeta
from replay_service.app import open_store
from replay_service.ingest.pipeline import IngestPipeline
from replay_service.settings import ServiceSettings
from replay_service.store.index import SCHEMA_VERSION
from tests.support.data import batch_bytes, routes
from tests.support.service import ServiceProcess, calls

# 8 MoE layers x top-4 of 64: enough entropy that the STALE content check runs, as on a real model.
SHAPE = RunShape(num_moe_layers=8, top_k=4, num_experts=64)
PROMPT, DECODE = 64, 16  # a shared prompt of 64 positions (two 32-token blocks), then each request's own rows


class Run:
    """One run on a service: rows, finishes, references and reads by plain HTTP and the client."""

    def __init__(self, url: str, run: str, seed: int = 0) -> None:
        self.url, self.run = url, run
        self.client = ReplayClient(url)
        self.rng = np.random.default_rng(seed)
        self.seq = 0

    def rows(self, request: str, positions, experts: np.ndarray, tokens=None, seq: int | None = None,
             writer: str = "w") -> dict:
        positions = np.asarray(positions, np.int32)
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        tokens = np.asarray(tokens if tokens is not None else 1000 + positions, np.int32)
        body = batch_bytes(self.run, writer, seq, [request] * len(positions), positions,
                           experts.reshape(len(positions), -1), shape=SHAPE, token_ids=tokens)
        return self.client.ingest(body)

    def refs(self, *references: tuple[str, int, int, str]) -> httpx.Response:
        body = {"references": [{"request_id": r, "start": a, "end": b, "source_request_id": s}
                               for r, a, b, s in references]}
        # 120 s: 10,000 references on PostgreSQL took more than 30 s once on a loaded machine
        return calls.post(f"{self.url}/v1/runs/{self.run}/references", json=body, timeout=120)

    def resolved(self, *references: tuple[str, int, int, str]) -> dict:
        answer = self.refs(*references)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def route(self, request: str, **kw):
        return self.client.get_route(self.run, request, **kw)

    def summary(self, request: str) -> dict:
        return self.client.request(self.run, request)

    def new_routes(self, n: int) -> np.ndarray:
        return routes(self.rng, n, SHAPE)

    def create(self) -> None:
        """A run exists from its first batch (which brings its shape); references alone do not create one."""
        self.rows("opener", [0], routes(np.random.default_rng(99), 1, SHAPE))


def _same(route, expected: np.ndarray, start: int = 0) -> None:
    assert route.positions.tolist() == list(range(start, start + len(expected)))
    assert not route.flags.any(), route.flagged_rows()[:5]
    assert route.experts.tobytes() == expected.tobytes()


@pytest.fixture(scope="module")
def url(shared_service) -> str:
    return shared_service.url


def test_reference_after_the_source_rows_reads_them_and_counts_once(url):
    run = Run(url, "ref-after", 1)
    src, own = run.new_routes(PROMPT + DECODE), run.new_routes(DECODE)
    run.rows("s", np.arange(PROMPT + DECODE), src)
    run.client.finish(run.run, "s", PROMPT + DECODE + 1)
    assert run.resolved(("r", 0, PROMPT, "s")) == {"received": 1, "new": 1, "rows_resolved": PROMPT}
    run.rows("r", np.arange(PROMPT, PROMPT + DECODE), own, tokens=np.arange(5000, 5000 + DECODE))
    run.client.finish(run.run, "r", PROMPT + DECODE + 1)

    route = run.route("r", strict=True)
    _same(route, np.concatenate([src[:PROMPT], own]))
    assert route.token_ids[:PROMPT].tolist() == list(range(1000, 1000 + PROMPT))  # the source's token ids
    summary = run.summary("r")
    assert (summary.rows, summary.referenced_rows, summary.expected_rows) == (PROMPT + DECODE, PROMPT,
                                                                                       PROMPT + DECODE)
    assert summary.clean and summary.flagged["GAP"] == 0
    assert run.summary("s").referenced_rows == 0
    info = run.client.run(run.run)
    assert (info.rows, info.referenced_rows, info.references) == (2 * (PROMPT + DECODE), PROMPT, 1)
    # The expert load counts rows as computed: the referenced rows once (by the source), not twice.
    load = run.client.expert_load(run.run)
    assert load.rows == PROMPT + DECODE + DECODE


def test_reference_before_the_source_rows_resolves_when_they_come(url):
    run = Run(url, "ref-before", 2)
    src, own = run.new_routes(PROMPT + 4), run.new_routes(DECODE)
    run.create()
    assert run.resolved(("r", 0, PROMPT, "s")) == {"received": 1, "new": 1, "rows_resolved": 0}
    waiting = run.summary("r")  # the reference says r has these positions: until resolved they are GAP
    assert (waiting.rows, waiting.expected_rows, waiting.flagged["GAP"]) == (0, PROMPT, PROMPT)
    assert (run.route("r").flags == Flag.GAP).all()
    run.rows("r", np.arange(PROMPT, PROMPT + DECODE), own)
    run.rows("s", np.arange(PROMPT + 4), src)  # the source's rows: r's reference resolves in this commit
    run.client.finish(run.run, "r", PROMPT + DECODE + 1)
    _same(run.route("r", strict=True), np.concatenate([src[:PROMPT], own]))
    assert run.summary("r").referenced_rows == PROMPT and run.summary("r").clean


def test_source_rows_in_two_batches_around_the_reference(url):
    run = Run(url, "ref-split", 3)
    src = run.new_routes(PROMPT + 8)
    run.rows("s", np.arange(40), src[:40])
    assert run.resolved(("r", 0, PROMPT, "s"))["rows_resolved"] == 40
    assert run.summary("r").flagged["GAP"] == PROMPT - 40
    run.rows("s", np.arange(40, PROMPT + 8), src[40:])
    run.client.finish(run.run, "r", PROMPT + 1)
    _same(run.route("r", strict=True), src[:PROMPT])
    assert run.summary("r").rows == PROMPT


def test_a_range_is_sliced_exactly_and_two_sources_compose(url):
    # r's first block was computed by a, its second by b (the other half of each source is theirs alone).
    run = Run(url, "ref-slice", 4)
    a, b, own = run.new_routes(PROMPT), run.new_routes(PROMPT + 10), run.new_routes(3)
    run.rows("a", np.arange(PROMPT), a)
    assert run.resolved(("r", 0, 32, "a"), ("r", 32, PROMPT, "b")) == {"received": 2, "new": 2, "rows_resolved": 32}
    run.rows("b", np.arange(PROMPT + 10), b)
    run.rows("r", np.arange(PROMPT, PROMPT + 3), own)
    run.client.finish(run.run, "r", PROMPT + 4)
    _same(run.route("r", strict=True), np.concatenate([a[:32], b[32:PROMPT], own]))
    _same(run.route("r", start=30, end=34), np.concatenate([a[30:32], b[32:34]]), start=30)
    assert run.summary("r").rows == PROMPT + 3 and run.summary("r").referenced_rows == PROMPT


def test_a_source_that_never_arrives_leaves_gap_never_other_rows(url):
    run = Run(url, "ref-ghost", 5)
    other, own = run.new_routes(PROMPT), run.new_routes(DECODE)
    run.rows("other", np.arange(PROMPT), other)  # the run exists; some other request's rows at the same positions
    run.resolved(("r", 0, PROMPT, "ghost"))
    run.rows("r", np.arange(PROMPT, PROMPT + DECODE), own)
    run.client.finish(run.run, "r", PROMPT + DECODE + 1)
    route = run.route("r")
    assert (route.flags[:PROMPT] == Flag.GAP).all() and not route.experts[:PROMPT].any()
    assert not route.flags[PROMPT:].any() and route.experts[PROMPT:].tobytes() == own.tobytes()
    summary = run.summary("r")
    assert (summary.rows, summary.flagged["GAP"], summary.clean) == (DECODE, PROMPT, False)
    with pytest.raises(StrictReadError):
        run.route("r", strict=True)


def test_the_same_reference_twice_and_a_retried_source_batch_count_once(url):
    run = Run(url, "ref-retry", 6)
    src = run.new_routes(PROMPT)
    ref = ("r", 0, PROMPT, "s")
    run.create()
    assert run.resolved(ref, ref) == {"received": 2, "new": 1, "rows_resolved": 0}  # a repeat within one body
    first = run.rows("s", np.arange(PROMPT), src, seq=7)
    again = run.rows("s", np.arange(PROMPT), src, seq=7)  # the sender retried: same writer and seq
    assert first.stored and again.duplicate
    assert run.resolved(ref) == {"received": 1, "new": 0, "rows_resolved": 0}  # a replayed spill
    run.client.finish(run.run, "r", PROMPT + 1)
    _same(run.route("r", strict=True), src)
    summary = run.summary("r")
    assert (summary.rows, summary.referenced_rows) == (PROMPT, PROMPT)
    assert run.client.run(run.run).references == 1


def test_kill_9_between_reference_and_source_rows_in_both_orders(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as proc:
        run = Run(proc.url, "ref-kill", 7)
        a, b = run.new_routes(PROMPT), run.new_routes(PROMPT)
        run.create()
        run.resolved(("ra", 0, PROMPT, "sa"))  # order 1: the reference, then the crash, then the rows
        run.rows("sb", np.arange(PROMPT), b)  # order 2: the rows, then the crash, then the reference
        proc.kill9()
        proc.start()
        run.rows("sa", np.arange(PROMPT), a)
        assert run.resolved(("rb", 0, PROMPT, "sb"))["rows_resolved"] == PROMPT
        for request, expected in (("ra", a), ("rb", b)):
            run.client.finish(run.run, request, PROMPT + 1)
            _same(run.route(request, strict=True), expected)
            assert run.summary(request).referenced_rows == PROMPT


def test_a_later_own_row_that_differs_is_a_conflict(url):
    # r resumes after preemption and recomputes a referenced position: the existing CONFLICT rule.
    run = Run(url, "ref-conflict-later", 8)
    src, other = run.new_routes(PROMPT), run.new_routes(2)
    run.rows("s", np.arange(PROMPT), src)
    run.resolved(("r", 0, PROMPT, "s"))
    run.rows("r", [10, 11], np.stack([src[10], other[1]]))  # 10 identical (a resend), 11 differs
    summary = run.summary("r")
    assert (summary.rows, summary.flagged["CONFLICT"], summary.first_flagged_position) == (PROMPT, 1, 11)
    route = run.route("r")
    assert route.experts[11].tobytes() == src[11].tobytes()  # the first held row is served, flagged
    assert route.flags[11] == Flag.CONFLICT and not np.delete(route.flags, 11).any()


def test_an_earlier_own_row_wins_and_a_differing_reference_row_flags_it(url):
    run = Run(url, "ref-conflict-earlier", 9)
    src, mine = run.new_routes(PROMPT), run.new_routes(2)
    # s's rows are in an older segment than r's own, but r held its own rows before the reference came.
    run.rows("s", np.arange(PROMPT), src)
    run.rows("r", [3, 4], np.stack([src[3], mine[1]]))
    assert run.resolved(("r", 0, PROMPT, "s"))["rows_resolved"] == PROMPT - 2  # r's own positions not counted again
    summary = run.summary("r")
    assert (summary.rows, summary.referenced_rows, summary.flagged["CONFLICT"]) == (PROMPT, PROMPT - 2, 1)
    route = run.route("r")
    assert route.experts[4].tobytes() == mine[1].tobytes() and route.flags[4] == Flag.CONFLICT
    assert route.experts[3].tobytes() == src[3].tobytes() and route.flags[3] == 0


def test_a_source_conflict_reaches_the_referencing_request(url):
    # s's position 5 got a differing later row (CONFLICT, a late flag): r reads s's row there with the flag.
    run = Run(url, "ref-conflict-source", 10)
    src, other = run.new_routes(PROMPT), run.new_routes(1)
    run.rows("s", np.arange(PROMPT), src)
    run.rows("s", [5], other)
    run.resolved(("r", 0, PROMPT, "s"), ("t", 0, PROMPT, "r"))
    for request in ("s", "r", "t"):
        route = run.route(request)
        assert route.flags[5] == Flag.CONFLICT and route.experts[5].tobytes() == src[5].tobytes(), request
        assert run.summary(request).flagged["CONFLICT"] == 1


@pytest.mark.parametrize("order", ["rows-first", "refs-first", "chain-reversed"])
def test_chains_resolve_in_any_order(url, order):
    # t reuses r's blocks, which r reused from s (vLLM names the computing request; a chain still resolves).
    run = Run(url, f"ref-chain-{order}", 11)
    src = run.new_routes(PROMPT)
    steps = {"rows": lambda: run.rows("s", np.arange(PROMPT), src),
             "r": lambda: run.resolved(("r", 0, PROMPT, "s")),
             "t": lambda: run.resolved(("t", 0, 32, "r"))}
    sequence = {"rows-first": ["rows", "r", "t"], "refs-first": ["r", "t", "rows"],
                "chain-reversed": ["t", "r", "rows"]}[order]
    run.create()
    for step in sequence:
        steps[step]()
    _same(run.route("r"), src)
    _same(run.route("t"), src[:32])
    assert run.summary("t").referenced_rows == 32


def test_a_reference_cycle_terminates(url):
    run = Run(url, "ref-cycle", 12)
    src = run.new_routes(PROMPT)
    run.create()
    run.resolved(("a", 0, PROMPT, "b"), ("b", 0, PROMPT, "a"))
    run.rows("a", np.arange(PROMPT), src)
    _same(run.route("a"), src)
    _same(run.route("b"), src)
    assert (run.summary("a").referenced_rows, run.summary("b").referenced_rows) == (0, PROMPT)


def test_the_trainer_and_batch_reads_serve_referenced_rows(url):
    run = Run(url, "ref-trainer", 13)
    src, own = run.new_routes(PROMPT + 2), run.new_routes(DECODE)
    run.rows("s", np.arange(PROMPT + 2), src)
    run.client.finish(run.run, "s", PROMPT + 3)
    run.resolved(("r", 0, PROMPT, "s"))
    run.rows("r", np.arange(PROMPT, PROMPT + DECODE), own)
    run.client.finish(run.run, "r", PROMPT + DECODE + 1)
    expected = np.concatenate([src[:PROMPT], own])
    batch = run.client.megatron_batch([(run.run, "r")])  # missing="strict" by default: a GAP would be a 409
    valid = batch.valid.astype(bool)
    assert valid.sum() == PROMPT + DECODE
    assert batch.experts[valid].tobytes() == expected[batch.position[valid]].tobytes()
    routes_ = run.client.get_routes(run.run, ["r", "s"])
    assert routes_[0].experts.tobytes() == expected.tobytes()


def test_a_group_of_samples_stores_the_prompt_once(url):
    # GRPO: n = 8 samples of one prompt of 4 blocks (128 positions). With the cache off every sample stores
    # the prompt's rows; with references only the sample that computed them does, and the references add no
    # byte: the run weighs what a run of the same segments without the other samples' prompts weighs.
    prompt, n, block = 128, 8, 32
    off, on, bare = Run(url, "ref-grpo-off", 14), Run(url, "ref-grpo-on", 14), Run(url, "ref-grpo-no", 14)
    rows = off.new_routes(prompt)
    decode = [off.new_routes(DECODE) for _ in range(n)]
    for i in range(n):
        off.rows(f"g{i}", np.arange(prompt + DECODE), np.concatenate([rows, decode[i]]))
    for run in (on, bare):
        run.rows("g0", np.arange(prompt + DECODE), np.concatenate([rows, decode[0]]))
    on.resolved(*[(f"g{i}", b * block, (b + 1) * block, "g0") for i in range(1, n) for b in range(prompt // block)])
    for run in (on, bare):
        for i in range(1, n):
            run.rows(f"g{i}", np.arange(prompt, prompt + DECODE), decode[i])
    for i in range(n):
        expected = np.concatenate([rows, decode[i]])
        _same(on.route(f"g{i}", strict=True), expected)
        _same(off.route(f"g{i}"), expected)
    off_info, on_info, bare_info = (r.client.run(r.run) for r in (off, on, bare))
    assert off_info.rows == on_info.rows == n * (prompt + DECODE)
    assert on_info.referenced_rows == (n - 1) * prompt and on_info.references == (n - 1) * (prompt // block)
    assert on_info.bytes == bare_info.bytes
    row_bytes = SHAPE.row_width + 10  # ids, position, token, flags: the prompt's rows, n times or once
    assert off_info.bytes - on_info.bytes >= (n - 1) * prompt * row_bytes
    print(f"GRPO group of {n} x {prompt}-position prompt: {off_info.bytes} B with every sample storing it, "
          f"{on_info.bytes} B with references")


@pytest.mark.parametrize(("reference", "problem"), [
    ({"request_id": "r/1", "start": 0, "end": 4, "source_request_id": "s"}, "not a valid id"),
    ({"request_id": "r", "start": 0, "end": 4, "source_request_id": ".s"}, "not a valid id"),
    ({"request_id": "r", "start": -1, "end": 4, "source_request_id": "s"}, "greater than or equal to 0"),
    ({"request_id": "r", "start": 4, "end": 4, "source_request_id": "s"}, "must be greater than start"),
    ({"request_id": "r", "start": 0, "end": 4, "source_request_id": "r"}, "cannot reference itself"),
    ({"request_id": "r", "start": 0, "end": 2**31, "source_request_id": "s"}, "less than or equal to"),
    ({"request_id": "r", "start": 0, "end": (1 << 20) + 1, "source_request_id": "s"}, "REPLAY_MAX_READ_ROWS"),
    ({"request_id": "r", "start": 0, "source_request_id": "s"}, "end: Field required"),
])
def test_bad_references_are_422_naming_the_problem_and_store_nothing(url, reference, problem):
    run = Run(url, "ref-bad", 15)
    run.rows("s", [0], run.new_routes(1))
    answer = calls.post(f"{url}/v1/runs/{run.run}/references", json={"references": [reference]})
    assert answer.status_code == 422 and problem in answer.json()["detail"], answer.text
    assert run.client.run(run.run).references == 0


def test_too_many_references_unknown_runs_and_bad_run_ids(url):
    run = Run(url, "ref-bad2", 16)
    run.rows("s", [0], run.new_routes(1))
    many = [("r", i, i + 1, "s") for i in range(10_001)]
    answer = run.refs(*many)
    assert answer.status_code == 422 and "at most 10000" in answer.json()["detail"]
    assert run.refs(*many[:10_000]).json() == {"received": 10_000, "new": 10_000, "rows_resolved": 1}
    missing = calls.post(f"{url}/v1/runs/no-such-run/references", json={"references": []})
    assert missing.status_code == 404 and "no-such-run" in missing.json()["detail"]
    bad = calls.post(f"{url}/v1/runs/.bad/references", json={"references": []})
    assert bad.status_code == 422 and "run id" in bad.json()["detail"]
    body = calls.post(f"{url}/v1/runs/{run.run}/references", json={"refs": []})
    assert body.status_code == 422 and "references" in body.json()["detail"]


def test_an_index_of_schema_2_is_migrated_keeping_which_row_is_served(tmp_path):
    data = tmp_path / "data"
    store = open_store(ServiceSettings(data_dir=data, fsync=False))
    pipeline = IngestPipeline.over(store)
    rng = np.random.default_rng(17)
    first, second = routes(rng, 4, SHAPE), routes(rng, 4, SHAPE)

    def rows(seq: int, request: str, experts: np.ndarray) -> Rows:
        return Rows(RowsMeta("old", "w", seq, SHAPE), [request], np.zeros(4, np.int32), np.arange(4, dtype=np.int32),
                    np.arange(4, dtype=np.int32), experts.reshape(4, -1), np.zeros(4, np.uint16))

    pipeline.ingest(rows(0, "a", first))
    pipeline.ingest(rows(1, "a", second))  # a later, differing copy: CONFLICT, never served
    store.close()
    # As the previous release left it; spans in reverse rowid order, so only segment order says which came first.
    with sqlite3.connect(data / "index.sqlite") as conn:
        conn.executescript("""
            CREATE TABLE spans_v2 (run_id TEXT NOT NULL, request_id TEXT NOT NULL, segment_id INTEGER NOT NULL,
                row_start INTEGER NOT NULL, row_count INTEGER NOT NULL, pos_min INTEGER NOT NULL,
                pos_max INTEGER NOT NULL);
            INSERT INTO spans_v2 SELECT run_id, request_id, segment_id, row_start, row_count, pos_min, pos_max
                FROM spans ORDER BY segment_id DESC;
            DROP TABLE spans;
            ALTER TABLE spans_v2 RENAME TO spans;
            CREATE INDEX spans_by_request ON spans (run_id, request_id, pos_min);
            DROP TABLE prefix_refs;
            ALTER TABLE requests DROP COLUMN referenced_rows;
            PRAGMA user_version = 2;
        """)
    again = open_store(ServiceSettings(data_dir=data, fsync=False))
    route = again.read_route("old", "a")
    assert route.experts.tobytes() == first.reshape(4, -1).tobytes()
    assert again.request_summary("old", "a").referenced_rows == 0
    assert again.add_references("old", [Reference("b", 0, 4, "a")]).rows_resolved == 4
    assert again.read_route("old", "b").experts.tobytes() == first.reshape(4, -1).tobytes()
    again.close()
    with sqlite3.connect(data / "index.sqlite") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
