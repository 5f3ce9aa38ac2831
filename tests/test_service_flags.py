"""One planted row per flag kind, each reported by a real server; strict reads refuse."""

from __future__ import annotations

import numpy as np
import pytest

from replay_client.client import ReplayClient, StrictReadError
from replay_format import Flag
from tests.support.data import batch_bytes, routes

N = 200


@pytest.fixture(scope="module")
def planted(shared_service):
    rng = np.random.default_rng(11)
    client = ReplayClient(shared_service.url)
    base = {name: routes(rng, N) for name in ("clean", "zero", "dup", "oor", "stale-writer", "stale-copy",
                                               "shared-prefix", "conflict", "gap", "padding")}
    tokens = {name: rng.integers(0, 150000, N) for name in base}
    base["zero"][17] = 0
    base["dup"][33, 7, 2] = base["dup"][33, 7, 5]
    base["oor"][44, 0, 0] = 255  # -1 cast to uint8
    base["stale-copy"][60] = base["clean"][5]  # another request's row at another position
    # A prompt shared with 'clean' (same tokens at positions 0..9): identical rows, legitimately.
    base["shared-prefix"][:10] = base["clean"][:10]
    tokens["shared-prefix"][:10] = tokens["clean"][:10]
    flags = {name: np.zeros(N, np.uint16) for name in base}
    flags["stale-writer"][70] = Flag.STALE
    order = ["clean", "zero", "dup", "oor", "stale-writer", "stale-copy", "shared-prefix", "conflict", "padding"]
    ids, pos, ex, tok, fl = [], [], [], [], []
    for name in order:
        ids += [name] * N
        pos.append(np.arange(N))
        ex.append(base[name])
        tok.append(tokens[name])
        fl.append(flags[name])
    # 'padding' gets 3 extra rows flagged PADDING holding -1 cast to 255: never served.
    ids += ["padding"] * 3
    pos.append(np.array([N, N + 1, N + 2]))
    ex.append(np.full((3, 48, 8), 255, np.uint8))
    tok.append(np.zeros(3, np.int64))
    fl.append(np.full(3, Flag.PADDING, np.uint16))
    # 'gap': positions 90..99 never sent.
    keep = np.r_[0:90, 100:N]
    ids += ["gap"] * len(keep)
    pos.append(keep)
    ex.append(base["gap"][keep])
    tok.append(tokens["gap"][keep])
    fl.append(flags["gap"][keep])
    answer = client.ingest(batch_bytes("flags", "w", 0, ids, np.concatenate(pos), np.concatenate(ex),
                                       token_ids=np.concatenate(tok), flags=np.concatenate(fl)))
    assert answer.padding_dropped == 3
    # 'conflict': position 120 arrives again from a recompute with other ids; 121 again identical.
    redo = base["conflict"][[120, 121]].copy()
    redo[0] = routes(rng, 1)[0]
    client.ingest(batch_bytes("flags", "w", 1, ["conflict"] * 2, np.array([120, 121]), redo,
                              token_ids=tokens["conflict"][[120, 121]]))
    for name in base:
        client.finish("flags", name, N + 1)
    return client, base


EXPECTED = {
    "zero": (17, Flag.ZERO),
    "dup": (33, Flag.DUPLICATE),
    "oor": (44, Flag.OUT_OF_RANGE),
    "stale-writer": (70, Flag.STALE),
    "stale-copy": (60, Flag.STALE),
    "conflict": (120, Flag.CONFLICT),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_planted_row_is_flagged_alone(planted, name):
    client, _ = planted
    position, flag = EXPECTED[name]
    route = client.get_route("flags", name)
    assert route.flagged_rows() == [(position, [flag.name])]
    summary = client.request("flags", name)
    assert summary.flagged[flag.name] == 1 and summary.first_flagged_position == position
    with pytest.raises(StrictReadError) as refused:
        client.get_route("flags", name, strict=True)
    assert refused.value.status == 409
    assert refused.value.bad_rows[0]["position"] == position
    assert flag.name in refused.value.bad_rows[0]["flags"]
    assert str(position) in refused.value.detail


def test_gap_reported_on_read(planted):
    client, _ = planted
    route = client.get_route("flags", "gap")
    assert len(route.positions) == N
    gap_rows = [p for p, names in route.flagged_rows() if names == ["GAP"]]
    assert gap_rows == list(range(90, 100))
    assert client.request("flags", "gap").flagged["GAP"] == 10
    with pytest.raises(StrictReadError):
        client.get_route("flags", "gap", strict=True)
    # A clean range of a flagged request is served strictly.
    assert client.get_route("flags", "gap", start=0, end=90, strict=True).clean


def test_padding_never_served(planted):
    client, base = planted
    route = client.get_route("flags", "padding", strict=True)
    assert len(route.positions) == N and route.experts.tobytes() == base["padding"].tobytes()
    assert client.request("flags", "padding").flagged["PADDING"] == 3


def test_conflict_serves_first_stored_and_identical_resend_is_quiet(planted):
    client, base = planted
    route = client.get_route("flags", "conflict")
    assert route.experts[120].tobytes() == base["conflict"][120].tobytes()
    assert route.flagged_rows() == [(120, ["CONFLICT"])]
    assert client.request("flags", "conflict").rows == N


def test_shared_prefix_is_not_stale_and_clean_stays_clean(planted):
    client, base = planted
    for name in ("clean", "shared-prefix"):
        route = client.get_route("flags", name, strict=True)
        assert route.experts.tobytes() == base[name].tobytes()


def test_listing_filters_by_flag_with_cursor(planted):
    client, _ = planted
    assert {r.request_id for r in client.requests("flags", "STALE", page_size=1)} == {"stale-writer", "stale-copy"}
    assert [r.request_id for r in client.requests("flags", Flag.GAP)] == ["gap"]
    assert [r.request_id for r in client.requests("flags", "padding")] == ["padding"]
    assert len(list(client.requests("flags", page_size=3))) == 10
    run = client.run("flags")
    assert run.flagged["STALE"] == 2 and run.flagged["GAP"] == 10 and run.flagged["CONFLICT"] == 1


def test_batch_strict_refuses_naming_the_request(planted):
    client, _ = planted
    with pytest.raises(StrictReadError) as refused:
        client.get_routes("flags", ["clean", "oor"], strict=True)
    assert refused.value.bad_rows[0]["request_id"] == "oor"
    assert len(client.get_routes("flags", ["clean", "shared-prefix"], strict=True)) == 2
