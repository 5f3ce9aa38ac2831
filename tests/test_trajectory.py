"""A trajectory is one route: the turns of a conversation, or a rollout resubmitted mid-way, read back as one.

Each turn is its own request (turn k's prompt = turn k-1's whole sequence + new text; a resubmitted partial
rollout's prompt = prompt + partial output). `POST /v1/runs/{run}/routes/trajectory` composes them at read
time: under `first` every position comes from the first turn that holds a row there (earlier turns as they
sampled, never overwritten by a later turn's recompute), under `latest` from the last. Every test goes
through a real server with rows ingested as a writer sends them (weight versions in the row batch's
`weight_version` column).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from replay_client import NotFoundError, ReplayClient, ReplayError, StrictReadError
from replay_format import RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.trajectory import TrajectoryInfo, TurnSpan
from replay_format.weight_versions import RecomputeRule, WeightVersions
from tests.support.data import routes
from tests.support.service import calls

SHAPE = RunShape(num_moe_layers=3, top_k=2, num_experts=16, moe_layers=(1, 2, 3), num_hidden_layers=4)
L, K = SHAPE.num_moe_layers, SHAPE.top_k


@pytest.fixture(scope="module")
def client(shared_service):
    with ReplayClient(shared_service.url) as c:
        yield c


class Writer:
    """One writer of one run: each turn a row batch of its own (positions, ids, tokens, a version per row)."""

    def __init__(self, client: ReplayClient, run: str) -> None:
        self.client, self.run, self.seq = client, run, 0

    def turn(self, request: str, positions, experts: np.ndarray, tokens: np.ndarray | None,
             versions: list[str | None] | None, num_tokens: int | None = None, status: str = "finished") -> None:
        """Ingest the rows of one turn and end the request at `num_tokens` (default: its last row + 2)."""
        positions = np.asarray(positions, np.int32)
        meta = RowsMeta(self.run, "w", self.seq, SHAPE)
        self.seq += 1
        batch = build_rows(meta, [request] * len(positions), positions, experts,
                           token_ids=None if tokens is None else tokens[positions],
                           weight_versions=None if versions is None else WeightVersions.of_labels(versions))
        assert self.client.ingest(encode_stream(batch)).stored
        self.client.finish(self.run, request, num_tokens or int(positions[-1]) + 2, status)


def conversation(client: ReplayClient, run: str, lengths: list[int], seed: int, recompute: bool = True):
    """Turns of `lengths[k]` tokens, turn k recomputing the whole prefix under version v{k+1} (other ids than the
    turn before: new weights, the prefix cache reset). Returns each turn's rows `(T_k - 1, L, K)` and the tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150_000, lengths[-1]).astype(np.int32)
    writer = Writer(client, run)
    turns = []
    for k, t in enumerate(lengths):
        rows = routes(rng, t - 1, SHAPE)
        if not recompute and turns:
            rows[: len(turns[-1])] = turns[-1]  # the same ids: the prefix served from the cache
        writer.turn(f"turn-{k}", np.arange(t - 1), rows, tokens, [f"v{k + 1}"] * (t - 1))
        turns.append(rows)
    return turns, tokens


def test_first_keeps_every_turn_as_it_sampled_and_latest_serves_the_newest_computation(client):
    lengths = [12, 20, 31]  # turn 2's prompt is turn 1's 12 tokens + 3 new; turn 3's is turn 2's 20 + 4 new
    turns, tokens = conversation(client, "traj-chat", lengths, seed=1)
    names = ["turn-0", "turn-1", "turn-2"]
    route = client.get_trajectory("traj-chat", names)
    assert route.request_id == "turn-2" and route.positions.tolist() == list(range(30)) and route.clean
    # each position from the first turn that holds it: turn 1's 11 rows, turn 2's next 8, turn 3's last 11
    want = np.concatenate([turns[0], turns[1][11:19], turns[2][19:]])
    assert np.array_equal(route.experts, want)
    spans = (TurnSpan(0, "turn-0", 0, 11), TurnSpan(1, "turn-1", 11, 19), TurnSpan(2, "turn-2", 19, 30))
    # differing: turns 2 and 3 recomputed positions 0..18 with other ids
    assert route.trajectory == TrajectoryInfo(tuple(names), spans, RecomputeRule.FIRST, differing=19)
    assert route.turn.tolist() == [0] * 11 + [1] * 8 + [2] * 11
    assert route.token_ids.tolist() == tokens[:30].tolist()
    assert route.versions().per_row() == ["v1"] * 11 + ["v2"] * 8 + ["v3"] * 11  # each row carries its turn's version
    # latest: the last turn holds every position: its recompute everywhere
    latest = client.get_trajectory("traj-chat", names, recompute="latest")
    assert np.array_equal(latest.experts, turns[2]) and latest.turn.tolist() == [2] * 30
    assert latest.trajectory.rule is RecomputeRule.LATEST is latest.recompute
    assert latest.versions().per_row() == ["v3"] * 30
    # one turn is that request's own route
    alone = client.get_trajectory("traj-chat", ["turn-1"])
    assert np.array_equal(alone.experts, turns[1]) and alone.trajectory.spans == (TurnSpan(0, "turn-1", 0, 19),)


def test_a_partial_rollout_resubmitted_under_new_weights_reads_as_one_route(client):
    """Aborted after 6 of its tokens (prompt 9: rows 0..13), resubmitted as a new request whose prompt is the 15
    tokens so far, generating 10 more under v2 (rows 0..23, the prefix recomputed under v2)."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 150_000, 25).astype(np.int32)
    first, resumed = routes(rng, 14, SHAPE), routes(rng, 24, SHAPE)
    writer = Writer(client, "traj-partial")
    writer.turn("ro-0", np.arange(14), first, tokens, ["step-100"] * 14, num_tokens=15, status="aborted")
    writer.turn("ro-0-resume", np.arange(24), resumed, tokens, ["step-101"] * 24)
    route = client.get_trajectory("traj-partial", ["ro-0", "ro-0-resume"])
    assert np.array_equal(route.experts, np.concatenate([first, resumed[14:]]))
    assert route.versions().per_row() == ["step-100"] * 14 + ["step-101"] * 10
    assert [(s.request_id, s.start, s.end) for s in route.trajectory.spans] == [("ro-0", 0, 14),
                                                                                ("ro-0-resume", 14, 24)]
    assert np.array_equal(client.get_trajectory("traj-partial", ["ro-0", "ro-0-resume"], recompute="latest").experts,
                          resumed)


def test_a_turn_that_holds_only_its_new_rows_takes_the_prefix_from_the_turn_before(client):
    """With the prefix cache (or an upload from `routed_experts_prompt_start`), turn 2 stores no row of the prefix:
    both rules take those positions from turn 1, whose rows are the only computation there."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 150_000, 18).astype(np.int32)
    one, two = routes(rng, 9, SHAPE), routes(rng, 8, SHAPE)
    writer = Writer(client, "traj-cached")
    writer.turn("c-0", np.arange(9), one, tokens, ["a"] * 9)
    writer.turn("c-1", np.arange(9, 17), two, tokens, ["b"] * 8)
    for rule in RecomputeRule:
        route = client.get_trajectory("traj-cached", ["c-0", "c-1"], recompute=rule)
        assert np.array_equal(route.experts, np.concatenate([one, two])) and route.clean, rule
        assert route.trajectory.differing == 0 and route.turn.tolist() == [0] * 9 + [1] * 8
        assert route.versions().per_row() == ["a"] * 9 + ["b"] * 8


def test_turns_that_do_not_continue_each_other_are_refused_naming_the_turn_and_position(client):
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 150_000, 16).astype(np.int32)
    other = tokens.copy()
    other[5] += 1  # turn 2 says position 5 held another token: another conversation
    writer = Writer(client, "traj-bad")
    writer.turn("b-0", np.arange(8), routes(rng, 8, SHAPE), tokens, None)
    writer.turn("b-1", np.arange(15), routes(rng, 15, SHAPE), other, None)
    writer.turn("b-short", np.arange(5), routes(rng, 5, SHAPE), tokens, None)
    writer.turn("b-unknown-tokens", np.arange(15), routes(rng, 15, SHAPE), None, None)
    with pytest.raises(ReplayError) as err:
        client.get_trajectory("traj-bad", ["b-0", "b-1"])
    assert err.value.status == 409
    assert "turn 1 ('b-1') does not continue turn 0 ('b-0'): at position 5" in err.value.detail
    with pytest.raises(ReplayError) as err:
        client.get_trajectory("traj-bad", ["b-0", "b-short"])
    assert err.value.status == 409 and "turn 1 ('b-short') has 5 rows, fewer than turn 0 ('b-0')" in err.value.detail
    # where a turn knows no token, nothing can disagree: composed as asked
    mixed = client.get_trajectory("traj-bad", ["b-0", "b-unknown-tokens"])
    assert [(s.turn, s.start, s.end) for s in mixed.trajectory.spans] == [(0, 0, 8), (1, 8, 15)]
    with pytest.raises(NotFoundError):
        client.get_trajectory("traj-bad", ["b-0", "no-such-turn"])
    for turns, words in ((["b-0", "b-0"], "names request 'b-0' again (turn 0)"), (["b-0", "bad id!"], "turn 1"),
                         ([], "turns")):
        with pytest.raises(ReplayError) as err:
            client.get_trajectory("traj-bad", turns)
        assert err.value.status == 422 and words in err.value.detail, turns


def test_a_position_no_turn_holds_is_a_gap_row_and_strict_refuses_it(client):
    rng = np.random.default_rng(5)
    writer = Writer(client, "traj-gap")
    one = routes(rng, 6, SHAPE)
    writer.turn("g-0", np.arange(6), one, None, ["x"] * 6)
    writer.turn("g-1", np.arange(8, 12), routes(rng, 4, SHAPE), None, ["y"] * 4)  # 6 and 7: nobody's row
    route = client.get_trajectory("traj-gap", ["g-0", "g-1"])
    assert [p for p, _ in route.flagged_rows()] == [6, 7] and route.turn.tolist() == [0] * 6 + [-1] * 2 + [1] * 4
    assert route.versions().per_row()[5:9] == ["x", None, None, "y"]
    with pytest.raises(StrictReadError) as err:
        client.get_trajectory("traj-gap", ["g-0", "g-1"], strict=True)
    assert [r["position"] for r in err.value.bad_rows] == [6, 7]


def test_json_and_npy_answers_say_which_turn_each_row_came_from(client, shared_service):
    turns, _ = conversation(client, "traj-formats", [5, 9], seed=6, recompute=False)
    url = f"{shared_service.url}/v1/runs/traj-formats/routes/trajectory"
    doc = calls.post(url, json={"turns": ["turn-0", "turn-1"], "format": "json", "layer_axis": "model"}).json()
    assert doc["request_id"] == "turn-1" and doc["turns"] == ["turn-0", "turn-1"] and doc["recompute"] == "first"
    assert doc["spans"] == [{"turn": 0, "request_id": "turn-0", "start": 0, "end": 4},
                            {"turn": 1, "request_id": "turn-1", "start": 4, "end": 8}]
    assert [r["turn"] for r in doc["rows"]] == [0] * 4 + [1] * 4 and doc["differing"] == 0
    assert doc["rows"][4]["experts"] == SHAPE.to_model_axis(turns[1][4:5])[0].tolist()
    npy = calls.post(url, json={"turns": ["turn-0", "turn-1"], "format": "npy", "recompute": "latest"})
    assert npy.status_code == 200 and npy.headers["x-replay-recompute"] == "latest"
    assert npy.headers["x-trajectory-spans"] == '[{"turn":1,"request_id":"turn-1","start":0,"end":8}]'
    body = np.load(io.BytesIO(npy.content))
    assert np.array_equal(body, turns[1])
    bad = calls.post(url, json={"turns": ["turn-0"], "recompute": "newest"})
    assert bad.status_code == 422 and "recompute" in bad.text
    assert calls.post(url, json={"turns": ["turn-0"], "rule": "first"}).status_code == 422  # unknown field


def test_within_a_turn_the_same_rule_picks_among_its_own_computations(client):
    """One request computed twice under other weights (a preemption after an update: the same positions again, other
    ids, version b): a recompute the request keeps. The client's reads choose it as the trajectory does."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 150_000, 14).astype(np.int32)
    old, new, more = routes(rng, 6, SHAPE), routes(rng, 6, SHAPE), routes(rng, 7, SHAPE)
    writer = Writer(client, "traj-recompute")
    writer.turn("r-0", np.arange(6), old, tokens, ["a"] * 6, num_tokens=7)
    writer.turn("r-0", np.arange(6), new, tokens, ["b"] * 6, num_tokens=7)  # recomputed under b
    writer.turn("r-1", np.arange(6, 13), more, tokens, ["b"] * 7)
    summary = client.request("traj-recompute", "r-0")
    assert summary.recomputed == 6 and summary.clean
    assert np.array_equal(client.get_route("traj-recompute", "r-0").experts, old)
    latest = client.get_route("traj-recompute", "r-0", recompute="latest")
    assert np.array_equal(latest.experts, new) and latest.versions().per_row() == ["b"] * 6
    assert latest.recompute is RecomputeRule.LATEST
    only = client.get_routes("traj-recompute", ["r-0"], weight_version="a")[0]
    assert np.array_equal(only.experts, old) and only.versions().per_row() == ["a"] * 6
    first = client.get_trajectory("traj-recompute", ["r-0", "r-1"])
    assert np.array_equal(first.experts, np.concatenate([old, more])) and first.trajectory.differing == 0
    last = client.get_trajectory("traj-recompute", ["r-0", "r-1"], recompute="latest")
    assert np.array_equal(last.experts, np.concatenate([new, more])) and last.versions().per_row() == ["b"] * 13
