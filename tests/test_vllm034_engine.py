"""vLLM 0.34's own engine on this CPU machine, its routed-experts output on, the plugin teeing it to a real service.

The driver (`tests/support/vllm034_engine_driver.py`, run in `.venv-vllm` with vLLM 0.34) starts vLLM's
`LLMEngine` with `enable_return_routed_experts` and prefix caching; only the worker is the test's
(`tests/support/toy_moe_worker.py`: a small torch MoE whose routers vLLM's own `bind_routed_experts_capturer`
binds). Engine core, scheduler, executor and both sides of the aux-output connector are vLLM's; the plugin is loaded
by vLLM through its entry point with `ROUTING_REPLAY_URL` pointing at a service started here. Run twice: the engine
core in its own process (vLLM's default; on the CPU platform vLLM spawns it, so the plugin loads inside
`EngineCore.__init__`) and in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

Every request the driver ran, under the id the user gave it, must be stored exactly as vLLM returned it in
`routed_experts`: byte-equal on the MoE layers (the default read) and on every model layer (dense ones zero), at
positions 0.. with the request's token ids, finished with vLLM's token count. Three of the requests share the first
request's prompt blocks: vLLM served them from its prefix cache (`num_cached_tokens`), their rows from its block store.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from replay_client.client import ReplayClient
from tests.support import vllm034_engine_driver as driver
from tests.support.service import ServiceProcess
from tests.support.vllm_releases import ROOT, release_env, require_release, run_script

pytestmark = pytest.mark.slow

VERSION = "0.34.0"
MOE_LAYERS = [i for i in range(driver.LAYERS) if i not in driver.DENSE]
HITS = {"shares-prefix", "repeats", "extends"}  # requests whose prompt starts with the first request's two blocks
TEE_LINE = "teeing the rows its aux-output connector commits"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("svc034") / "data") as proc:
        yield proc


def _run_engine(where: str, url: str, run_id: str, tmp_path) -> tuple[dict, str]:
    """Run the driver with the plugin on; what vLLM returned (the driver's JSON) and the processes' log."""
    require_release(VERSION)
    extra = {"VLLM_TARGET_DEVICE": "cpu", "ROUTING_REPLAY_URL": url, "ROUTING_REPLAY_RUN_ID": run_id,
             "ROUTING_REPLAY_SPILL_DIR": str(tmp_path / "spill")}
    if where == "in-process":
        extra["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out = tmp_path / "returned.json"
    # returns once every process holding its output has exited: the engine core's sink too, after its last send
    proc = run_script(VERSION, ROOT / "tests" / "support" / "vllm034_engine_driver.py", str(out),
                      env=release_env(VERSION, **extra), timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def _wait_stored(client: ReplayClient, run_id: str, returned: dict, log: str, timeout: float = 60.0) -> dict:
    """Each request's summary once it is finished with every row vLLM returned (a wait, not a timed assertion)."""
    deadline, pending, summaries = time.monotonic() + timeout, dict(returned), {}
    while pending and time.monotonic() < deadline:
        for rid, r in list(pending.items()):
            try:
                s = client.request(run_id, rid)
            except Exception:  # any error (404): not stored yet
                continue
            if s.status != "open" and s.rows >= len(r["routed_experts"]):
                summaries[rid] = s
                del pending[rid]
        time.sleep(0.2)
    tee_lines = [line for line in log.splitlines() if TEE_LINE in line]
    assert not pending, (f"routes never stored for {sorted(pending)} of run {run_id!r}; the plugin's tee log lines: "
                         f"{tee_lines or 'none'}")
    return summaries


@pytest.mark.parametrize("where", ["spawned", "in-process"])
def test_every_stored_route_is_what_vllm_returned(where, service, tmp_path):
    run_id = f"vllm034-{where}"
    result, log = _run_engine(where, service.url, run_id, tmp_path)
    assert result["client"] == ("SyncMPClient" if where == "spawned" else "InprocClient")  # where the core ran
    returned = result["requests"]
    assert set(returned) == {rid for rid, _ in driver.REQUESTS + driver.LATER}
    assert {rid for rid, r in returned.items() if r["num_cached_tokens"]} == HITS  # vLLM's prefix-cache hits
    with ReplayClient(service.url) as client:
        summaries = _wait_stored(client, run_id, returned, log)
        run = client.run(run_id)  # created by the engine core's tee, on the MoE layers its workers reported
        assert run.source == "vllm-output"
        assert (run.moe_layers, run.num_hidden_layers) == (tuple(MOE_LAYERS), driver.LAYERS)
        for rid, r in returned.items():
            rows = np.asarray(r["routed_experts"], dtype=r["dtype"])  # vLLM's CompletionOutput.routed_experts
            tokens = r["prompt"] + r["output"]
            assert rows.shape == (len(tokens) - 1, driver.LAYERS, driver.TOP_K), rid
            stored = client.get_route(run_id, rid, strict=True)  # the MoE layers
            assert stored.experts.dtype == rows.dtype and stored.experts.shape == rows[:, MOE_LAYERS].shape, rid
            assert stored.experts.tobytes() == np.ascontiguousarray(rows[:, MOE_LAYERS]).tobytes(), rid
            whole = client.get_route(run_id, rid, strict=True, layer_axis="model")
            assert whole.experts.tobytes() == rows.tobytes(), rid  # dense layer 0 included, zero as vLLM's
            assert stored.positions.tolist() == list(range(len(rows))), rid
            assert stored.token_ids.tolist() == tokens[: len(rows)], rid
            assert summaries[rid].status == "finished" and summaries[rid].num_tokens == len(tokens), rid
    # the rows a hit request returned for its cached blocks are the first request's (vLLM's block store)
    first = np.asarray(returned["first"]["routed_experts"])
    for rid in HITS:
        cached = returned[rid]["num_cached_tokens"]
        np.testing.assert_array_equal(np.asarray(returned[rid]["routed_experts"])[:cached], first[:cached])
