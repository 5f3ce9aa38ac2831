"""The plugin's engine-core half and vLLM's R3 tee against the real engine core of each vLLM GPU release (0.33, 0.34).

In the release's environment (`.venv-vllm`, `scripts/vllm_env.sh`) `tests/support/engine_core_driver.py` runs
vLLM's own `EngineCoreProc` loop, scheduler (`AsyncScheduler`: both releases schedule asynchronously by default),
`KVCacheManager`, `BlockPool`, `AuxOutputSchedulerConnector` and KV connectors, with a stand-in worker whose routes
are known (`tests/support/engine_core_stand_in.py`), once per capture route: the plugin's own (its worker hooks and
the engine core's `SchedulerNotes`) and vLLM's R3 teed by the engine core. Scenarios: prefix-cache hits, `n > 1`, a
stop token and an abort, preemption and resume, weight updates under `pause_generation(mode="keep")` (the cache
cleared, and kept), a prompt loaded back from an offload tier, a P/D prefill-only request. The driver checks the
notes against the scheduler itself; this module reads the real service it streamed to: every row byte-equal to
what was fed (R3: to what vLLM returned to the user), under the user's request ids, with its finish, weight
versions and prefix references.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from replay_client.client import ReplayClient
from tests.support.vllm_releases import GPU_WHEELS, release_env, run_script

DRIVER = Path(__file__).parent / "support" / "engine_core_driver.py"
ROUTES = ("plugin", "tee")
NEW_WEIGHTS = ("rl-step-1", "rl-step-2")  # the labels of the driver's two weight updates (cache cleared, KV kept)
# Which weights computed the rows of each request of the weight updates (every other request: `default`'s).
LABELS = {"wv-a": {"default", NEW_WEIGHTS[0]}, "wv-b": {"default", NEW_WEIGHTS[0]}, "kv-a": set(NEW_WEIGHTS),
          "kv-b": set(NEW_WEIGHTS)}


@dataclass
class Driven:
    """One release's driver run: what the service must hold per route, and a client on that service."""

    version: str
    result: dict
    rows: dict[str, np.ndarray]
    client: ReplayClient

    def run(self, route: str) -> str:
        return self.result["routes"][route]["run"]

    def requests(self, route: str) -> dict[str, dict]:
        """Per user request id: what the driver expects (`engine_core_driver.expected_rows`)."""
        return self.result["routes"][route]["requests"]

    def expected(self, route: str, user: str, which: str = "first") -> np.ndarray:
        return self.rows[f"{route}/{user}/{which}"]


@pytest.fixture(scope="module", params=GPU_WHEELS)
def driven(request, shared_service, tmp_path_factory):
    """The driver run on vLLM `request.param` against the session's service (skips where the release is absent)."""
    version = request.param
    env = release_env(version, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = tmp_path_factory.mktemp(f"engine-core-{version}")
    proc = run_script(version, DRIVER, shared_service.url, str(out), env=env, timeout=600)
    assert proc.returncode == 0, f"the driver failed on vLLM {version}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    result = json.loads((out / "result.json").read_text())
    assert result["vllm"] == version
    with np.load(out / "rows.npz") as npz:
        rows = {key: npz[key] for key in npz.files}
    with ReplayClient(shared_service.url) as client:
        yield Driven(version, result, rows, client)


def past_the_end(entry: dict, stored_rows: int) -> bool:
    """The request has rows past the tokens vLLM kept: its next step was running when it stopped or was aborted
    (asynchronous scheduling), and the worker computed it."""
    return stored_rows > entry["ends_at"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_row_is_stored_as_fed_under_the_users_id(driven, route):
    """Byte-equal rows on the model-layer axis (vLLM's `routed_experts` layout, the dense layer zero) and token ids,
    for every request, read by the id the user gave vLLM; nothing under vLLM's internal ids."""
    run = driven.run(route)
    requests = driven.requests(route)
    assert {s.request_id for s in driven.client.requests(run)} == set(requests)
    shape = driven.client.run(run)
    assert (shape.moe_layers, shape.num_hidden_layers, shape.top_k, shape.num_experts) == ((1, 2), 3, 2, 8)
    assert shape.source == ("vllm-plugin" if route == "plugin" else "vllm-output")
    for user, entry in requests.items():
        expected = driven.expected(route, user)
        stored = driven.client.get_route(run, user, strict=True, layer_axis="model")
        assert stored.positions.tolist() == list(range(len(expected))), user
        assert stored.experts.dtype == expected.dtype and stored.experts.tobytes() == expected.tobytes(), user
        assert stored.token_ids.tolist() == entry["tokens"][: len(expected)], user


@pytest.mark.parametrize("route", ROUTES)
def test_requests_end_as_vllm_ended_them(driven, route):
    """Finished or aborted with vLLM's token count, for each request that ended on this engine with no step past it."""
    run = driven.run(route)
    checked = 0
    for user, entry in driven.requests(route).items():
        if entry["prefill_only"] or past_the_end(entry, len(driven.expected(route, user))):
            continue
        summary = driven.client.request(run, user)
        assert (summary.status, summary.num_tokens) == (entry["status"], entry["num_tokens"]), user
        assert summary.clean and summary.rows == entry["num_tokens"] - 1, user
        checked += 1
    assert checked >= 10


def test_a_request_that_ends_while_its_next_step_runs_keeps_its_rows_and_its_finish(driven):
    """Asynchronous scheduling: vLLM schedules a request's next step before it has seen the token that stops it (or
    the user's abort); the worker computes that step. Its row stays stored (rows are never cut) and the finish still
    lands: with vLLM's status, its count raised to cover the rows (the sink's rule for aborts, `sink/book.py`)."""
    run = driven.run("plugin")
    cases = {user: entry for user, entry in driven.requests("plugin").items()
             if past_the_end(entry, len(driven.expected("plugin", user)))}
    assert {"stp", "abt"} <= set(cases), "no request ended with its next step running: is scheduling asynchronous?"
    for user, entry in cases.items():
        rows = len(driven.expected("plugin", user))
        summary = driven.client.request(run, user)
        assert (summary.status, summary.num_tokens) == (entry["status"], max(entry["num_tokens"], rows + 1)), \
            (user, summary)


@pytest.mark.parametrize("route", ROUTES)
def test_a_prefill_only_request_is_left_to_the_decode_engine(driven, route):
    """P/D: the prefill engine stores the prompt's rows and no finish (the decode engine writes the rest under the
    same id, and the finish). Plugin route: NixlConnector, vLLM's `do_remote_decode`; R3 route: ExampleConnector as
    `kv_producer` (vLLM refuses its R3 with the connectors of the `do_remote_decode` protocol)."""
    run = driven.run(route)
    prefill = {user: entry for user, entry in driven.requests(route).items() if entry["prefill_only"]}
    assert set(prefill) == {"pd-pre"}
    for user, entry in prefill.items():
        summary = driven.client.request(run, user)
        assert (summary.status, summary.num_tokens, summary.rows) == ("open", None, entry["ends_at"]), \
            (route, summary)


@pytest.mark.parametrize("route", ROUTES)
def test_prefix_cache_hits(driven, route):
    """Both routes: each hit, on the device or loaded back by a KV connector (an offload tier), is a reference to the
    request that computed the blocks (the rows read through it are the source's, checked above); on the R3 route the
    tee sends the engine core's reference in place of the rows vLLM reads back from its block store."""
    run = driven.run(route)
    requests = driven.requests(route)
    referenced = {user: sum(b - a for a, b, _ in entry["references"]) for user, entry in requests.items()}
    assert {u for u, n in referenced.items() if n} == {"sys-b", "1_grp", "2_grp", "kv-b", "off-b"}
    for user in requests:
        assert driven.client.request(run, user).referenced_rows == referenced[user], user
    assert driven.client.run(run).references == 5


@pytest.mark.parametrize("route", ROUTES)
def test_each_row_carries_the_weights_that_computed_it(driven, route):
    """Two updates under `pause_generation(mode="keep")`. Cache cleared: vLLM recomputes the requests in flight; the
    plugin route stores both computations (the default read serves the first, `recompute="latest"` the new weights'
    everywhere), vLLM's R3 returns the new positions' rows only. KV kept: the request in flight goes on from its KV,
    and a request after the update that reuses blocks the old weights computed holds their rows, which are the old
    weights' (on both routes a reference to the request that computed them)."""
    run = driven.run(route)
    for user, entry in driven.requests(route).items():
        assert set(entry["versions"]) == LABELS.get(user, {"default"}), user
        stored = driven.client.get_route(run, user, strict=True, layer_axis="model")
        assert stored.versions().per_row() == entry["versions"], user
        summary = driven.client.request(run, user)
        assert summary.recomputed == entry.get("recomputed", 0), user
    kv_b = driven.requests(route)["kv-b"]
    assert kv_b["versions"][:8] == [NEW_WEIGHTS[0]] * 8 and kv_b["versions"][-1] == NEW_WEIGHTS[1]
    if route == "plugin":
        for user in ("wv-a", "wv-b"):
            assert driven.requests(route)[user]["recomputed"] > 0
            latest = driven.client.get_route(run, user, strict=True, layer_axis="model", recompute="latest")
            assert latest.experts.tobytes() == driven.expected(route, user, "latest").tobytes(), user
            assert set(latest.versions().per_row()) == {NEW_WEIGHTS[0]}, user
