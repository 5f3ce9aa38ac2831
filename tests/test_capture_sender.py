"""The background sender against a real service process: nothing lost, nothing twice, never blocking.

Also its spill items (replay_format/spill.md: versioned, the previous unversioned files still
read) and the settings it takes from another process (`SenderConfig.to_dict` / `from_dict`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from capture.sender import RouteSender, SenderConfig
from capture.sender.items import Item
from capture.sender.spill import SpillFolder
from capture.vllm.sink import spill_root
from replay_client.client import ReplayClient
from replay_format import FormatError, FormatVersion
from replay_format.spill import ItemKind, SpillHeader, created_ns, decode_item, encode_item, item_name
from tests.support.data import QWEN3_SHAPE, batch_bytes, many_routes
from tests.support.service import ServiceProcess, calls, free_port
from tests.support.stand_ins import record_fsyncs

STEP_ROWS = 512


def _steps(num_steps: int, requests: int = 8, seed: int = 0):
    """Scheduler-like steps: each request advances by a chunk per step."""
    rng = np.random.default_rng(seed)
    per_request = STEP_ROWS // requests
    for step in range(num_steps):
        ids = [f"req-{r}" for r in range(requests) for _ in range(per_request)]
        positions = np.tile(np.arange(step * per_request, (step + 1) * per_request), requests)
        yield ids, positions, many_routes(rng, STEP_ROWS), rng.integers(0, 50000, STEP_ROWS)


def _expected(num_steps: int, requests: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    out: dict[str, list] = {}
    for ids, _positions, experts, _ in _steps(num_steps, requests, seed):
        for r in range(requests):
            sel = np.array(ids) == f"req-{r}"
            out.setdefault(f"req-{r}", []).append(experts[sel])
    return {k: np.concatenate(v) for k, v in out.items()}


def _config(url, spill, **kw) -> SenderConfig:
    kw.setdefault("batch_rows", 2048)
    kw.setdefault("flush_interval_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    return SenderConfig(url=url, run_id="cap", shape=QWEN3_SHAPE, spill_dir=spill, **kw)


def _assert_all_arrived(url, expected, num_tokens=None):
    client = ReplayClient(url)
    run = client.run("cap")
    assert run.rows == sum(len(v) for v in expected.values())
    assert run.flagged["CONFLICT"] == 0 and run.flagged["STALE"] == 0
    for request_id, rows in expected.items():
        route = client.get_route("cap", request_id, strict=True)
        assert route.experts.tobytes() == rows.tobytes()


def test_kill_mid_stream_then_every_row_arrives_once(tmp_path):
    port = free_port()
    data = tmp_path / "data"
    service = ServiceProcess(data, port=port).start()
    sender = RouteSender(_config(service.url, tmp_path / "spill"))
    steps = list(_steps(60))
    for i, (ids, pos, ex, tok) in enumerate(steps):
        sender.submit(ids, pos, ex, token_ids=tok)
        if i == 20:
            sender.flush(30)
            service.kill9()
        if i == 40:
            service = ServiceProcess(data, port=port, log_path=tmp_path / "back.log").start()
    for r in range(8):
        sender.finish(f"req-{r}", 60 * STEP_ROWS // 8 + 1)
    assert sender.close(60)
    try:
        assert sender.stats.retried > 0 and sender.stats.spilled_batches > 0
        assert sender.stats.drained_batches == sender.stats.spilled_batches
        assert sender.stats.sent_rows == 60 * STEP_ROWS and sender.stats.dropped_rows == 0
        _assert_all_arrived(service.url, _expected(60))
        assert ReplayClient(service.url).request("cap", "req-3").status == "finished"
        assert not list((tmp_path / "spill").iterdir())
    finally:
        service.stop()


def test_full_queue_spills_instead_of_blocking(tmp_path):
    port = free_port()  # nothing listens yet
    sender = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill", max_queue_bytes=1 << 20))
    for ids, pos, ex, tok in _steps(40):
        sender.submit(ids, pos, ex, token_ids=tok)
    # Everything submitted went to disk or memory; submit never waited for the network.
    deadline = time.monotonic() + 30
    while sender.stats.spilled_batches < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.stats.spilled_batches >= 5
    assert sender.stats.sent_batches == 0
    with ServiceProcess(tmp_path / "data", port=port):
        assert sender.flush(60)
        assert sender.stats.drained_batches == sender.stats.spilled_batches
        _assert_all_arrived(f"http://127.0.0.1:{port}", _expected(40))
        sender.close(10)


def test_close_flushes_and_leftovers_drain_at_next_start(tmp_path):
    with ServiceProcess(tmp_path / "data") as service:
        sender = RouteSender(_config(service.url, tmp_path / "spill", flush_interval_s=5.0))
        for ids, pos, ex, tok in _steps(5):
            sender.submit(ids, pos, ex, token_ids=tok)
        assert sender.close(30)  # a partial batch still waiting on flush_interval goes out now
        _assert_all_arrived(service.url, _expected(5))

    port = free_port()
    down = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill2"))
    for ids, pos, ex, tok in _steps(6, seed=1):
        down.submit(ids, pos, ex, token_ids=tok)
    assert not down.close(1.0)  # service down: left on disk, not lost
    assert list((tmp_path / "spill2").glob("*.item"))
    with ServiceProcess(tmp_path / "data2", port=port) as service:
        later = RouteSender(_config(service.url, tmp_path / "spill2"))  # a new writer id, same spill dir
        assert later.flush(60)
        later.close(5)
        _assert_all_arrived(service.url, _expected(6, seed=1))


def test_spilled_batches_keep_each_rows_weight_version_and_drain_with_it(tmp_path):
    """Every batch carries the `weight_version` column (null where the writer did not say); a spill item is a row
    batch, so it keeps it, and the rows drained later read back with their versions."""
    port = free_port()
    down = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill", batch_rows=1 << 20))
    versions = ["default", "default", "rl-step-1", None]
    for (ids, pos, ex, tok), version in zip(_steps(4, requests=2), versions):
        down.submit(ids, pos, ex, token_ids=tok, weight_version=version)
    with pytest.raises(FormatError, match="not a valid label"):
        down.submit(["x"], [0], np.zeros((1, QWEN3_SHAPE.row_width)), weight_version="not a label")
    assert not down.close(1.0)  # service down: left on disk
    (item,) = [p for p in (tmp_path / "spill").glob("*.item") if decode_item(p.read_bytes())[0].kind == ItemKind.BATCH]
    table = pa.ipc.open_stream(decode_item(item.read_bytes())[1]).read_all()  # the four steps in one batch
    per_step = STEP_ROWS
    assert table.column("weight_version").to_pylist() == [v for v in versions for _ in range(per_step)]
    with ServiceProcess(tmp_path / "data", port=port) as service:
        later = RouteSender(_config(service.url, tmp_path / "spill"))
        assert later.flush(60)
        later.close(5)
        _assert_all_arrived(service.url, _expected(4, requests=2))
        for r in range(2):
            answer = calls.get(f"{service.url}/v1/runs/cap/requests/req-{r}/routes", params={"format": "json"})
            assert [row.get("weight_version") for row in answer.json()["rows"]] == [
                v for v in versions for _ in range(per_step // 2)]


def test_drops_only_past_the_disk_budget_and_says_so(tmp_path, caplog):
    port = free_port()
    sender = RouteSender(_config(f"http://127.0.0.1:{port}", tmp_path / "spill", max_queue_bytes=1 << 16,
                                 max_spill_bytes=1 << 20, batch_rows=512))
    with caplog.at_level(logging.ERROR, logger="routing_replay.sender"):
        for ids, pos, ex, tok in _steps(20):
            sender.submit(ids, pos, ex, token_ids=tok)
        deadline = time.monotonic() + 30
        while sender.stats.dropped_rows == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sender.stats.dropped_rows > 0
    assert any("DROPPED" in r.message for r in caplog.records)
    sender.close(0.5)


def test_refused_batches_are_counted_not_retried(tmp_path):
    with ServiceProcess(tmp_path / "data") as service:
        sender = RouteSender(_config(service.url, tmp_path / "spill"))
        bad = np.zeros((4, 48, 8), np.uint8)
        sender.submit(["ok"] * 4, np.arange(4), bad)
        sender.submit(["../x"] * 4, np.arange(4), bad)  # an id the service refuses: 422
        assert sender.close(30)
        assert sender.stats.refused >= 1


# ---- spill items (replay_format/spill.md) and the config another process sends ----------

def test_request_note_bodies_are_the_ones_posted_before_and_what_the_api_reads():
    """The finish and references bodies (replay_format/request_notes.md), byte for byte as the sender wrote them by
    hand before that module, and read back by the service's API models under the same field names."""
    from dataclasses import fields

    from replay_format.request_notes import Finish, FinishStatus, Reference, references_body, references_path
    from replay_service.api.ingest import FinishBody
    from replay_service.api.models import PrefixReference, ReferenceBatch

    end = Finish("req-1", 17, FinishStatus.ABORTED)
    assert end.body() == json.dumps({"num_tokens": 17, "status": "aborted"}).encode()
    assert end.path("r") == "/v1/runs/r/requests/req-1/finish" and references_path("r") == "/v1/runs/r/references"
    hits = [Reference("b", 0, 64, "a"), Reference("1_c", 32, 48, "c")]
    assert references_body(hits) == json.dumps({"references": [
        {"request_id": r, "start": s, "end": e, "source_request_id": src} for r, s, e, src in
        (("b", 0, 64, "a"), ("1_c", 32, 48, "c"))]}).encode()
    read = FinishBody.model_validate_json(end.body())
    assert (read.num_tokens, read.status) == (17, "aborted")
    batch = ReferenceBatch.model_validate_json(references_body(hits))
    assert [Reference(**r.model_dump()) for r in batch.references] == hits
    assert set(FinishBody.model_fields) == {f.name for f in fields(Finish)} - {"request_id"}  # it is in the path
    assert set(PrefixReference.model_fields) == {f.name for f in fields(Reference)}


def _old_item(header: dict, payload: bytes) -> bytes:
    """An item as the sender wrote it before spill.md: u32 header length, a JSON header without a version."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(4, "little") + text + payload


def test_spill_items_round_trip_and_unversioned_ones_are_read():
    header = SpillHeader(ItemKind.FINISH, 7, path="/v1/runs/r/requests/a/finish")
    got, payload = decode_item(encode_item(header, b'{"num_tokens": 3}'))
    assert got == header and payload == b'{"num_tokens": 3}' and got.version == FormatVersion(1, 1)
    refs = SpillHeader(ItemKind.REFERENCES, 8, path="/v1/runs/r/references")
    assert decode_item(encode_item(refs, b"{}")) == (refs, b"{}")
    with pytest.raises(FormatError, match="a references item without its path"):
        decode_item(encode_item(SpillHeader(ItemKind.REFERENCES, 9), b"{}"))
    old = _old_item({"kind": "batch", "seq": 4, "rows": 12, "path": ""}, b"arrow bytes")
    got, payload = decode_item(old)
    assert (got.kind, got.seq, got.rows, got.version, payload) == (ItemKind.BATCH, 4, 12, FormatVersion(1, 0),
                                                                    b"arrow bytes")
    newer = _old_item({"format": "routing-replay.spill", "format_version": "2.0", "kind": "batch", "seq": 1}, b"")
    with pytest.raises(FormatError, match="format_version 2.0 is newer"):
        decode_item(newer)
    for damaged in (old[:3], old[:10], _old_item({"kind": "sideways", "seq": 1}, b"")):
        with pytest.raises(FormatError):
            decode_item(damaged)
    assert created_ns(item_name(123, "vllm-dp0-9-ab", 5)) == 123


def test_spill_of_the_previous_code_drains_and_a_newer_one_is_kept_aside(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    rng = np.random.default_rng(9)
    experts = many_routes(rng, 4)
    batch = batch_bytes("cap", "old-writer", 0, ["old-0"] * 4, np.arange(4), experts)
    (spill / item_name(1, "old-writer", 0)).write_bytes(_old_item({"kind": "batch", "seq": 0, "rows": 4, "path": ""},
                                                                  batch))
    finish = {"kind": "finish", "seq": 1, "rows": 0, "path": "/v1/runs/cap/requests/old-0/finish"}
    (spill / item_name(2, "old-writer", 1)).write_bytes(_old_item(finish, b'{"num_tokens": 5, "status": "finished"}'))
    newer = {"format": "routing-replay.spill", "format_version": "9.0", "kind": "batch", "seq": 2, "rows": 4}
    (spill / item_name(3, "old-writer", 2)).write_bytes(_old_item(newer, batch))
    with ServiceProcess(tmp_path / "data") as service:
        sender = RouteSender(_config(service.url, spill))
        assert sender.flush(60)
        sender.close(10)
        _assert_all_arrived(service.url, {"old-0": experts})
        assert ReplayClient(service.url).request("cap", "old-0").status == "finished"
    assert sender.stats.drained_batches == 1
    assert [p.name for p in spill.iterdir()] == [item_name(3, "old-writer", 2) + ".bad"]  # kept, not lost


def test_sender_config_crosses_as_a_checked_dict(tmp_path):
    config = _config("http://127.0.0.1:1", tmp_path / "spill", token="secret", source="trainer")
    data = config.to_dict()
    assert "token" not in data and "shape" not in data and json.loads(json.dumps(data)) == data
    assert SenderConfig.from_dict(data, QWEN3_SHAPE, token="secret") == config
    with pytest.raises(FormatError, match="unknown keys"):
        SenderConfig.from_dict({**data, "retries": 3}, QWEN3_SHAPE)
    with pytest.raises(FormatError, match="batch_rows"):
        SenderConfig.from_dict({**data, "batch_rows": "many"}, QWEN3_SHAPE)
    with pytest.raises(FormatError, match="run_id"):
        SenderConfig.from_dict({**data, "run_id": "../x"}, QWEN3_SHAPE)


def test_two_spills_of_one_item_at_once_leave_one_file(tmp_path):
    """close() spills the in-flight item while the network thread may be spilling it too (its delivery failed):
    the item lands as one file, counted once. Both once wrote the same .tmp file, and the second rename found it
    gone (FileNotFoundError out of close(), seen in a whole-suite run)."""
    spill = tmp_path / "spill"
    sender = RouteSender(_config(f"http://127.0.0.1:{free_port()}", spill))
    errors: list[BaseException] = []
    try:
        for seq in range(40):
            item = Item(SpillHeader(ItemKind.BATCH, seq, rows=1), b"x" * (1 << 18))
            both = threading.Barrier(2)

            def spill_it(item=item, both=both):
                both.wait()
                try:
                    sender._spill(item)
                except BaseException as exc:  # noqa: BLE001 - the race's error, reported below
                    errors.append(exc)

            threads = [threading.Thread(target=spill_it) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert errors == []
        assert len(list(spill.glob("*.item"))) == 40 and not list(spill.glob("*.tmp"))
        assert sender.stats.spilled_batches == 40
    finally:
        sender.close(0.1)


def test_a_spilled_item_is_fsynced_and_so_is_its_rename(tmp_path, monkeypatch):
    """The spill is durable across a crash of the machine: the item's bytes are fsynced, and after the rename
    that puts it in place, the folder too (before, only the bytes: the new name could be lost with the machine)."""
    synced = record_fsyncs(monkeypatch)
    folder = SpillFolder(tmp_path / "spill", 1 << 20, threading.Condition())
    assert folder.write(Item(SpillHeader(ItemKind.BATCH, 0, rows=1), b"x" * 100), "w0")
    assert synced == ["file", str(tmp_path / "spill")]
    assert len(folder) == 1 and SpillFolder(tmp_path / "spill", 1 << 20, threading.Condition()).oldest() is not None


def test_items_adopted_from_a_stopped_writer_are_moved_durably(tmp_path, monkeypatch):
    """`spill_root.adopt` renames a stopped writer's items into the new writer's folder, fsyncs that folder, and
    only then removes the old one (before, no fsync: a crash of the machine could lose the moves)."""
    root = tmp_path / "root"
    os.close(spill_root.claim(root, "dead"))  # its lock is free again: the writer has stopped
    SpillFolder(root / "dead", 1 << 20, threading.Condition()).write(
        Item(SpillHeader(ItemKind.BATCH, 0, rows=1), b"x" * 100), "dead")
    live = spill_root.claim(root, "live")
    synced = record_fsyncs(monkeypatch)
    try:
        assert spill_root.adopt(root, root / "live") == 1
    finally:
        os.close(live)
    assert synced == [str(root / "live")] and not (root / "dead").exists()
    assert len(SpillFolder(root / "live", 1 << 20, threading.Condition())) == 1
