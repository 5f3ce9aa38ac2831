"""Trainer slices carry each token's weight version; `versions="single"` refuses a sequence that mixes them.

Rows are ingested as a writer sends them, with the row batch's `weight_version` column: a weight update in
the middle of a generation (`w-mixed`: positions 0..8 by version 3, 9..18 by version 4), one near its end
(`w-late`), rows of one version, rows written before versions existed (no column) and rows of a writer that
knew only some (nulls). Version 3's rows pick experts 0..7 and version 4's 8..15, so a token's version can be
checked against the ids it replays. Through a real server; megatron-core's and verl's own code consume these
slices in tests/test_trainer_megatron.py and tests/test_trainer_verl_megatron.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_client import ReplayClient, ReplayError
from replay_format import Flag, RunShape
from replay_format.rows import RowsMeta, build_rows, encode_stream
from replay_format.weight_versions import WeightVersions
from tests.support.data import routes

SHAPE = RunShape(num_moe_layers=4, top_k=2, num_experts=16)
HALF = RunShape(num_moe_layers=4, top_k=2, num_experts=8)  # ids of one version: 0..7, shifted by 8 for version 4
RUN = "tw"
# request: (tokens, version of each row, or None for a batch without the column)
REQUESTS: dict[str, tuple[int, list[str | None] | None]] = {
    "w-one": (12, ["3"] * 11),
    "w-mixed": (20, ["3"] * 9 + ["4"] * 10),  # weights updated after position 8
    "w-late": (20, ["3"] * 17 + ["4"] * 2),
    "w-old": (9, None),  # written before versions: unknown
    "w-partial": (10, ["4"] * 5 + [None] * 4),  # a writer that knew the version of some rows only
}
FLAGGED = ("w-flag", 8, 3)  # request, tokens, the position of a ZERO row (version 3)


def version_rows(rng: np.random.Generator, versions: list[str | None]) -> np.ndarray:
    """Rows whose ids say their version: 0..7 for "3" (and unknown), 8..15 for "4"."""
    rows = routes(rng, len(versions), HALF).astype(SHAPE.dtype)
    rows[[v == "4" for v in versions]] += 8
    return rows


def ingest(client: ReplayClient, seq: int, request: str, rows: np.ndarray, versions: list[str | None] | None,
           flags: np.ndarray | None = None) -> None:
    n = len(rows)
    batch = build_rows(RowsMeta(RUN, "w", seq, SHAPE), [request] * n, np.arange(n, dtype=np.int32), rows,
                       flags=flags, weight_versions=None if versions is None else WeightVersions.of_labels(versions))
    assert client.ingest(encode_stream(batch)).stored
    client.finish(RUN, request, n + 1)


@pytest.fixture(scope="module")
def stored(shared_service):
    client = ReplayClient(shared_service.url)
    rng = np.random.default_rng(23)
    full = {}
    for seq, (request, (tokens, versions)) in enumerate(REQUESTS.items()):
        full[request] = version_rows(rng, versions or [None] * (tokens - 1))
        ingest(client, seq, request, full[request], versions)
    request, tokens, at = FLAGGED
    rows = version_rows(rng, ["3"] * (tokens - 1))
    rows[at] = 0
    ingest(client, len(REQUESTS), request, rows, ["3"] * (tokens - 1))
    return client, full


def expected_versions(request: str) -> list[str | None]:
    """Each token's version as a slice gives it: its row's, and None for the last token (no row)."""
    tokens, versions = REQUESTS[request]
    return [*(versions or [None] * (tokens - 1)), None]


def test_every_token_carries_its_rows_version_and_filler_none(stored):
    client, full = stored
    order = ["w-one", "w-mixed", "w-old", "w-partial"]
    batch = client.megatron_batch([(RUN, r) for r in order])
    assert batch.versions() == [v for r in order for v in expected_versions(r)]
    assert sorted(batch.weight_versions) == ["3", "4"] and batch.weight_version.dtype == np.int16
    # the ids a token replays are the ones its version computed (version 4's pick experts 8..15)
    labels = batch.versions()
    four = np.array([v == "4" for v in labels])
    three = np.array([v == "3" for v in labels])
    assert (batch.experts[four] >= 8).all() and (batch.experts[three] < 8).all()
    assert four.sum() == 15 and three.sum() == 20


def test_staleness_counts_replayed_rows_per_version_for_the_trainers_logger(stored):
    client, _ = stored
    batch = client.megatron_batch([(RUN, r) for r in ("w-one", "w-mixed", "w-old", "w-partial")])
    stale = batch.staleness(current="5")
    assert stale.rows == {"3": 20, "4": 15} and stale.unknown == 8 + 4 and stale.total == 47
    assert stale.stale_rows == 35 and stale.lags == {"3": 2, "4": 1}
    assert stale.metrics() == {"replay/rows/3": 20.0, "replay/rows/4": 15.0, "replay/rows_unknown": 12.0,
                               "replay/versions": 2.0, "replay/stale_rows": 35.0, "replay/stale_fraction": 1.0,
                               "replay/max_lag": 2.0, "replay/mean_lag": (20 * 2 + 15 * 1) / 35}
    now = batch.staleness(current="4").metrics(prefix="r3/")
    assert now["r3/stale_rows"] == 20.0 and now["r3/stale_fraction"] == 20 / 35 and now["r3/max_lag"] == 1.0
    plain = batch.staleness().metrics()  # no current version: counts only, labels need not be numbers
    assert set(plain) == {"replay/rows/3", "replay/rows/4", "replay/rows_unknown", "replay/versions"}


@pytest.mark.parametrize("cp,tp,split", [(2, 2, "zigzag"), (2, 1, "contiguous"), (1, 4, "zigzag")])
def test_every_rank_of_a_split_batch_gets_the_versions_of_its_own_tokens(stored, cp, tp, split):
    client, _ = stored
    order = ["w-mixed", "w-one", "w-late"]
    seen: dict[tuple[int, int], str | None] = {}
    for c in range(cp):
        for t in range(tp):
            batch = client.megatron_batch([(RUN, r) for r in order], cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t,
                                          cp_split=split)
            for s, p, v in zip(batch.sequence.tolist(), batch.position.tolist(), batch.versions()):
                if s >= 0:
                    seen[(s, p)] = v
                else:
                    assert v is None  # padding
    assert seen == {(s, p): v for s, r in enumerate(order) for p, v in enumerate(expected_versions(r))}


def test_single_refuses_the_sequences_that_mix_versions_naming_each(stored):
    client, _ = stored
    seqs = [(RUN, r) for r in ("w-one", "w-mixed", "w-late")]
    assert client.megatron_batch(seqs).num_tokens == 52  # `any` (the default) serves them
    with pytest.raises(ReplayError) as err:
        client.megatron_batch(seqs, versions="single")
    assert err.value.status == 409
    assert ("versions=single refused: 2 sequences mix weight versions: sequence 1 (tw/w-mixed: 3 at [0, 9), 4 at "
            "[9, 19)); sequence 2 (tw/w-late: 3 at [0, 17), 4 at [17, 19))") in err.value.detail
    # the whole sequence decides, not this rank's part: rank 0 of a contiguous CP split holds w-late's tokens
    # 0..9 only (all version 3) and is refused as rank 1 is, so no rank of the micro-batch trains alone
    for rank in (0, 1):
        with pytest.raises(ReplayError, match="sequence 0 \\(tw/w-late"):
            client.megatron_batch([(RUN, "w-late")], cp_size=2, cp_rank=rank, cp_split="contiguous",
                                  versions="single")
    # unknown rows are no version: they mix with nothing; a sequence fed from a later turn's start is its rows only
    fine = client.megatron_batch([(RUN, "w-one"), (RUN, "w-old"), (RUN, "w-partial"),
                                  {"run": RUN, "request": "w-mixed", "start": 9}], versions="single")
    assert fine.versions()[-11:] == ["4"] * 10 + [None]
    with pytest.raises(ValueError, match="'one' is not a valid VersionPolicy"):
        client.megatron_batch(seqs, versions="one")  # refused before it is sent; the service says 422 as well
    answer = client.http.post("/v1/trainer/megatron", json={"sequences": [{"run": RUN, "request": "w-one"}],
                                                             "versions": "one"})
    assert answer.status_code == 422 and "versions" in answer.text


def test_verl_dense_versions_follow_its_padding_and_single_refuses_there_too(stored):
    client, _ = stored
    order, prompts, pw, rw = ["w-one", "w-mixed"], [4, 6], 6, 16
    batch = client.verl_batch([(RUN, r) for r in order], prompt_lengths=prompts, prompt_width=pw, response_width=rw)
    dense = batch.dense_versions().numpy()
    assert dense.shape == (2, pw + rw) and dense.dtype == np.int16
    table = [*batch.weight_versions, None]
    for b, r in enumerate(order):
        first = pw - prompts[b]  # the prompt is left-padded
        want = [None] * first + expected_versions(r)
        want += [None] * (pw + rw - len(want))
        assert [table[i] for i in dense[b].tolist()] == want
    assert batch.staleness().rows == {"3": 20, "4": 10}
    with pytest.raises(ReplayError) as err:
        client.verl_batch([(RUN, r) for r in order], prompt_lengths=prompts, prompt_width=pw, response_width=rw,
                          versions="single")
    assert err.value.status == 409 and "sequence 1 (tw/w-mixed: 3 at [0, 9), 4 at [9, 19))" in err.value.detail


def test_a_flagged_row_replays_no_version_whatever_the_policy(stored):
    client, _ = stored
    request, tokens, at = FLAGGED
    routed = client.megatron_batch([(RUN, request)], missing="router")
    assert routed.fallback[at] == 1 and routed.versions()[at] is None
    assert routed.versions() == ["3"] * at + [None] + ["3"] * (tokens - 2 - at) + [None]
    assert client.request(RUN, request).flagged[Flag.ZERO.name] == 1
    # single looks at the rows replayed: one version, served
    assert client.megatron_batch([(RUN, request)], missing="filler", versions="single").staleness().rows == {"3": 6}



def test_single_answers_a_sequence_whose_rows_are_all_flagged(stored):
    """versions=single reads each sequence's rows whole; a sequence whose every row is flagged gets filler (or the
    router), as under any policy. It failed with a 500: copying no rows at all raised."""
    client, _ = stored
    ingest(client, 100, "w-zeros", np.zeros((3, SHAPE.row_width), SHAPE.dtype), ["3"] * 3)  # ZERO rows only
    for missing in ("filler", "router"):
        answer = client.megatron_batch([(RUN, "w-zeros")], missing=missing, versions="single")
        assert answer.valid.tolist() == [0] * 4 and answer.versions() == [None] * 4
        assert answer.fallback.tolist() == ([1, 1, 1, 0] if missing == "router" else [0] * 4)
