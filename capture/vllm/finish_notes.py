"""Finish notes not yet delivered to a worker, kept in a file: the engine core writes them, a sink reads them.

Runs in two processes: the engine core (`FinishJournal`, from `engine_core/scheduler.py`) and the sink
(`read_notes`, `live_writers`, from `sink/process.py`). No vLLM, numpy or network import. File:
`<spill root>/.finish-notes/<engine core pid>.jsonl`, a format header line, then one
`{"id", "status": "finished" | "aborted", "num_tokens"}` per line; a note is written when the scheduler frees the
request and leaves once the step that carried it has run. Rewritten in place, so a reader skips lines it cannot
parse; a clean exit with nothing undelivered removes the file, and files of engine cores gone `STALE_S` are removed.

Design: docs/design/vllm_plugin.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from capture.vllm.log import log

DIRNAME = ".finish-notes"
SUFFIX = ".jsonl"
FORMAT = "routing-replay.finish-notes"
MAJOR = 1
_HEADER = json.dumps({"format": FORMAT, "format_version": f"{MAJOR}.0"}).encode() + b"\n"
_refused: set[Path] = set()  # journals a reader has already said it cannot read
STALE_S = 600.0  # a dead engine core's journal is kept this long (its sink sends or spills in 30 s)


def journal_dir(spill_root: Path | str) -> Path:
    """Where the engine cores sharing `spill_root` keep their journals."""
    return Path(spill_root) / DIRNAME


def pid_alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: as far as kill() can tell, it runs


class FinishJournal:
    """One engine core's undelivered finish notes, mirrored in its journal file (module docstring).

    Never raises: the first error is logged, and the journal turns itself off (the notes still go to
    the workers with the next step; only a stop before that step would lose them).
    """

    def __init__(self, spill_root: Path | str) -> None:
        self.dir = journal_dir(spill_root)
        self.path = self.dir / f"{os.getpid()}{SUFFIX}"
        self.pending: dict[str, bytes] = {}  # request id -> its line, in the order freed
        self._fd = -1
        self._size = 0
        self._broken = False

    def _open(self) -> bool:
        if self._fd < 0 and not self._broken:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                remove_stale(self.dir)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._size = os.write(self._fd, _HEADER)
            except OSError as exc:
                self._fail(exc)
        return self._fd >= 0

    def add(self, request_id: str, status: str, num_tokens: int) -> None:
        """The scheduler freed `request_id`: note how it ended until a worker has received it."""
        line = json.dumps({"id": request_id, "status": status, "num_tokens": num_tokens}).encode() + b"\n"
        self.pending[request_id] = line
        if self._open():
            try:  # appended at our own offset (pwrite: O_APPEND would ignore the rewrite's offset 0)
                self._size += os.pwrite(self._fd, line, self._size)
            except OSError as exc:
                self._fail(exc)

    def delivered(self, request_ids) -> None:
        """The step carrying these notes has run in the workers: they leave the file."""
        removed = [rid for rid in request_ids if self.pending.pop(rid, None) is not None]
        if not removed or self._fd < 0:
            return
        data = _HEADER + b"".join(self.pending.values())
        try:  # new contents first, then cut: a stop in between leaves stale lines, never loses a note
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            self._size = len(data)
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        """The engine core stops: the file goes if every note was delivered, else it stays for the sinks."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if not self.pending:
            try:
                self.path.unlink()
            except OSError:
                pass

    def _fail(self, exc: OSError) -> None:
        if not self._broken:
            log.error("routing-replay: finish journal %s failed (%s); finish notes only travel with the next step",
                      self.path, exc)
        self._broken = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_stale(directory: Path, stale_s: float = STALE_S) -> None:
    """Remove the journals of engine cores that are gone and wrote nothing for `stale_s` seconds."""
    now = time.time()
    for path in directory.glob("*" + SUFFIX):
        try:
            pid = int(path.stem)
            if pid != os.getpid() and not pid_alive(pid) and now - path.stat().st_mtime > stale_s:
                path.unlink()
        except (ValueError, OSError):
            continue


def read_notes(spill_root: Path | str) -> dict[str, tuple[str, int]]:
    """Every journal's notes under `spill_root`: {engine-internal request id: (status, num_tokens)}."""
    notes: dict[str, tuple[str, int]] = {}
    for path in sorted(journal_dir(spill_root).glob("*" + SUFFIX)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        lines = data.splitlines()
        if lines and not _readable(lines[0]):
            if path not in _refused:  # once: a sink reads again and again while it waits
                _refused.add(path)
                log.error("routing-replay: %s is not a finish journal this version reads; skipped", path)
            continue
        for line in lines[1:]:
            try:
                note = json.loads(line)
                notes[str(note["id"])] = (str(note["status"]), int(note["num_tokens"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a rewrite or a kill
    return notes


def _readable(header: bytes) -> bool:
    """True for a journal header of this format with a major version this module knows."""
    try:
        md = json.loads(header)
        return md["format"] == FORMAT and int(str(md["format_version"]).split(".")[0]) == MAJOR
    except (ValueError, KeyError, TypeError):
        return False


def live_writers(spill_root: Path | str) -> list[int]:
    """Pids of the engine cores with a journal under `spill_root` that still run."""
    pids = []
    for path in journal_dir(spill_root).glob("*" + SUFFIX):
        try:
            pid = int(path.stem)
        except ValueError:
            continue
        if pid != os.getpid() and pid_alive(pid):
            pids.append(pid)
    return pids
