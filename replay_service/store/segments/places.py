"""Where segments live: a local directory (default) or an S3-compatible bucket, behind one interface (`SegmentStore`).

Contract: a segment is named `<run_id>/<uuid>.arrow` whatever the store, and is visible only whole (a local write,
write.py, or `put`); `sync` makes written names durable before any index row names them. `LocalSegments`
(`<data>/runs`) reads memory-mapped; `S3Segments` (`REPLAY_SEGMENTS_URL=s3://bucket/prefix`, endpoint and
credentials from the AWS variables) fetches whole objects or, by `read_rows`, only the checked blocks of some rows.
The store's failures are `SegmentStoreUnreachable` (503); a missing object is FileNotFoundError.
Design: docs/design/store.md ("Where segments live").
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from replay_format.durable import fsync_dir
from replay_service.errors import DamagedSegment, SegmentStoreUnreachable
from replay_service.store.segments.ranges import BufferOffsets, covering_rows, read_blocks, read_offsets

log = logging.getLogger("replay_service")

SEGMENT_SUFFIX = ".arrow"
OFFSETS_KEPT = 8192  # segments' buffer offsets an S3 store keeps (a few hundred bytes and an object handle each)
ROWS_KEPT_BYTES = 256 << 20  # checked blocks an S3 store keeps in memory, least recently used out first


@dataclass(frozen=True)
class StoredObject:
    """One complete segment in the store: its relative path, size and last modification (Unix seconds)."""

    path: str
    size: int
    mtime: float


class FileStamp(NamedTuple):
    """A segment's last modification (ns) and size: a changed file is a new one (cache.py)."""

    mtime_ns: int
    size: int


@dataclass(frozen=True)
class Freed:
    """What removing a run's objects or files freed: their bytes and how many."""

    bytes: int = 0
    files: int = 0

    def __add__(self, other: Freed) -> Freed:
        return Freed(self.bytes + other.bytes, self.files + other.files)

    @classmethod
    def of(cls, objects: list[StoredObject]) -> Freed:
        """What the listed objects held."""
        return cls(sum(o.size for o in objects), len(objects))


class SegmentStore(ABC):
    """Segments by relative path: write whole, open for reading, list, delete."""

    #: True when an opened segment is held in process memory (fetched), False when it is a map of a local file
    in_memory: bool = False
    #: True when reading a segment (or its rows) may wait on the network
    remote: bool = False
    #: what settings name it (start-up refusals and logs say it)
    url: str

    def new_path(self, run_id: str) -> str:
        """A fresh segment's path: `<run_id>/<uuid>.arrow`."""
        return f"{run_id}/{uuid.uuid4().hex}{SEGMENT_SUFFIX}"

    @abstractmethod
    def open_batch(self, rel: str) -> pa.RecordBatch:
        """The segment's one record batch, unchecked (integrity.open_segment checks it); FileNotFoundError if none."""

    def read_rows(self, rel: str, lo: int, hi: int) -> pa.RecordBatch | None:
        """Rows `[lo, hi)` of a segment read by themselves and checked, or None where the store reads segments whole
        (a local map costs nothing per row; a segment without block checksums): `open_batch` then."""
        return None

    @abstractmethod
    def stat(self, rel: str) -> FileStamp | None:
        """A segment's stamp, None when it does not exist: a changed file is a new one (cache.py)."""

    @abstractmethod
    def objects(self, run_id: str | None = None) -> list[StoredObject]:
        """Every complete segment (of one run when given), sorted by path."""

    @abstractmethod
    def delete(self, rel: str) -> None:
        """Delete one segment (missing is fine)."""

    def sync(self, paths: list[str]) -> dict[str, BaseException]:
        """Make written segments' names durable before an index row names them; failures by path.

        Nothing to do where a finished write is durable by itself (an object store).
        """
        return {}

    def delete_run(self, run_id: str) -> Freed:
        """Delete a run's segments where they are not in its local run folder; what that freed.

        A local store's segments are in that folder, which retention.py moves to the trash whole (journal too).
        """
        return Freed()

    def check(self) -> None:
        """SegmentStoreUnreachable when the store cannot be listed and written (start-up)."""
        return None  # a local directory: made by the store, its errors are the disk's own

    def ping(self) -> None:
        """SegmentStoreUnreachable when the store does not answer now (the health check: one cheap call)."""
        return None

    def paths(self, run_id: str | None = None) -> list[str]:
        """The relative paths of `objects`."""
        return [o.path for o in self.objects(run_id)]


class LocalSegments(SegmentStore):
    """Segments as files under a directory (`<data>/runs`): memory-mapped reads, O_DIRECT writes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def open_batch(self, rel: str) -> pa.RecordBatch:
        return pa.ipc.open_file(pa.memory_map(str(self.root / rel), "r")).get_batch(0)

    def stat(self, rel: str) -> FileStamp | None:
        try:
            st = os.stat(self.root / rel)
        except FileNotFoundError:
            return None
        return FileStamp(st.st_mtime_ns, st.st_size)

    def objects(self, run_id: str | None = None) -> list[StoredObject]:
        base = self.root / run_id if run_id is not None else self.root
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*" + SEGMENT_SUFFIX):
            if p.is_file():
                st = p.stat()
                out.append(StoredObject(p.relative_to(self.root).as_posix(), st.st_size, st.st_mtime))
        return sorted(out, key=lambda o: o.path)

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def sync(self, paths: list[str]) -> dict[str, BaseException]:
        """One fsync per run folder of `paths` (their renames); a folder gone (its run deleted) fails its paths."""
        folders: dict[Path, list[str]] = {}
        for rel in paths:
            folders.setdefault((self.root / rel).parent, []).append(rel)
        failed: dict[str, BaseException] = {}
        for folder, here in sorted(folders.items()):
            try:
                fsync_dir(folder)
            except FileNotFoundError as exc:
                failed.update(dict.fromkeys(here, exc))
        return failed


class S3Segments(SegmentStore):
    """Segments as objects under `bucket/prefix` of an S3-compatible store (`pyarrow.fs.S3FileSystem`)."""

    in_memory = True
    remote = True

    def __init__(self, fs: pafs.FileSystem, base: str, url: str) -> None:
        self.fs = fs
        self.base = base.rstrip("/")
        self.url = url
        self.bytes_fetched = 0  # by reads, since start (tests and benchmarks measure a read's cost with it)
        self._count = threading.Lock()
        # path -> its buffer offsets for ranged reads (None: read whole) and open object
        self._offsets: OrderedDict[str, tuple[BufferOffsets | None, pa.NativeFile]] = OrderedDict()
        self._damaged: set[str] = set()  # segments a ranged read found damaged (logged once)
        # (path, first row, end row) -> checked blocks fetched by a ranged read, kept: a segment never changes
        self._kept: OrderedDict[tuple[str, int, int], pa.RecordBatch] = OrderedDict()
        self._kept_bytes = 0

    def _key(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    @contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """Turn the store's failures (pyarrow's OSError: refused connection, timeout, 5xx, denied) into
        `SegmentStoreUnreachable` naming the store: the API answers 503, never a 500 or a damaged segment.

        FileNotFoundError is a store that answered (no such object) and passes through.
        """
        try:
            yield
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise SegmentStoreUnreachable(
                f"the segment store {self.url} did not answer ({what}: {exc}); nothing was stored or served; "
                "the same request succeeds once the store answers again", self.url) from None

    def put(self, rel: str, image: pa.Buffer | memoryview | bytes) -> None:
        """Write a whole segment image as one object: complete when this returns, invisible before.

        A failed upload leaves no object (a PUT or a multipart completion is all or nothing); a partial one the
        SDK might still have completed is named by no index row and collected as an orphan (retention.py).
        """
        with self._reaching(f"uploading {rel}"):
            try:
                with self.fs.open_output_stream(self._key(rel)) as out:
                    out.write(image)
            except BaseException:
                self._forget(rel)
                raise

    def _forget(self, rel: str) -> None:
        """Best-effort delete of a failed upload's key (the store may be the reason it failed)."""
        try:
            self.fs.delete_file(self._key(rel))
        except (OSError, pa.ArrowException):
            pass  # the orphan collector deletes it after its grace period

    def open_batch(self, rel: str) -> pa.RecordBatch:
        with self._reaching(f"reading {rel}"):
            try:
                with self.fs.open_input_stream(self._key(rel)) as source:  # one GET for the whole object
                    data = source.read()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if self.stat(rel) is None:  # the store answers, the object is not there
                    raise FileNotFoundError(rel) from exc
                raise
        with self._count:
            self.bytes_fetched += len(data)
        return pa.ipc.open_file(pa.BufferReader(data)).get_batch(0)

    def read_rows(self, rel: str, lo: int, hi: int) -> pa.RecordBatch | None:
        """Rows `[lo, hi)` by ranged GETs of the blocks holding them, each checked against its CRC32C
        (DamagedSegment when one fails: nothing of it is served); None when the segment has no block checksums.

        The buffer offsets (footer: one ranged GET) are kept per segment, and the checked blocks a read fetched, up to
        `ROWS_KEPT_BYTES` (as the segment cache keeps whole segments: checked when fetched, served from memory after).
        """
        where = f"{self.url.rstrip('/')}/{rel}"
        with self._reaching(f"reading {rel}"):
            try:
                offsets, source = self._offsets_of(rel, where)
                if offsets is None:
                    return None
                r0, r1 = covering_rows(offsets, lo, hi, rel, where)
                with self._count:
                    blocks = self._kept.get((rel, r0, r1))
                    if blocks is not None:
                        self._kept.move_to_end((rel, r0, r1))
                if blocks is None:
                    blocks = read_blocks(offsets, self._counted(source), r0, r1, rel, where)
                    self._keep((rel, r0, r1), blocks)
                return blocks.slice(lo - r0, hi - lo)
            except DamagedSegment as exc:
                with self._count:  # metrics count a damaged segment once, refused reads each time (as cache.py)
                    self._offsets.pop(rel, None)  # a restored object is read afresh, footer included
                    exc.newly_found = rel not in self._damaged
                    self._damaged.add(rel)
                if exc.newly_found:
                    log.error("%s", exc.message)
                raise
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) or self.stat(rel) is None:  # the store answers: no object
                    with self._count:
                        self._offsets.pop(rel, None)
                    raise FileNotFoundError(rel) from exc
                raise

    def _keep(self, key: tuple[str, int, int], blocks: pa.RecordBatch) -> None:
        with self._count:
            if key in self._kept:
                return
            self._kept[key] = blocks
            self._kept_bytes += blocks.nbytes
            while self._kept_bytes > ROWS_KEPT_BYTES and len(self._kept) > 1:
                self._kept_bytes -= self._kept.popitem(last=False)[1].nbytes

    def _forget_rows(self, prefix: str) -> None:
        """Drop what is kept of the segments under `prefix` (a path, or a run and "/"): deleted."""
        with self._count:
            for key in [k for k in self._kept if k[0].startswith(prefix)]:
                self._kept_bytes -= self._kept.pop(key).nbytes
            for rel in [r for r in self._offsets if r.startswith(prefix)]:
                del self._offsets[rel]

    def _counted(self, source: pa.NativeFile) -> Callable[[int, int], pa.Buffer]:
        def read_at(offset: int, length: int) -> pa.Buffer:
            data = pa.py_buffer(source.read_at(length, offset))  # one ranged GET
            with self._count:
                self.bytes_fetched += data.size
            return data
        return read_at

    def _offsets_of(self, rel: str, where: str) -> tuple[BufferOffsets | None, pa.NativeFile]:
        """The segment's buffer offsets, read from its footer once, and its open object (a HEAD, once): both kept,
        a segment never changes (one replaced by a restore fails its checks, and is read afresh)."""
        with self._count:
            if rel in self._offsets:
                self._offsets.move_to_end(rel)
                return self._offsets[rel]
        source = self.fs.open_input_file(self._key(rel))  # FileNotFoundError when absent (the caller's)
        try:
            offsets = read_offsets(self._counted(source), source.size())
        except (pa.ArrowException, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise DamagedSegment(f"segment {where} cannot be read ({exc}): restore it from a backup; "
                                 "`replay-service verify` lists every damaged segment", rel) from None
        with self._count:
            self._offsets[rel] = offsets, source
            while len(self._offsets) > OFFSETS_KEPT:
                self._offsets.popitem(last=False)
        return offsets, source

    def stat(self, rel: str) -> FileStamp | None:
        with self._reaching(f"looking up {rel}"):
            info = self.fs.get_file_info(self._key(rel))
        if info.type != pafs.FileType.File:
            return None
        return FileStamp(info.mtime_ns or 0, info.size)

    def objects(self, run_id: str | None = None) -> list[StoredObject]:
        base = self.base if run_id is None else self._key(run_id)
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        out = []
        with self._reaching("listing " + (run_id or "every run")):
            infos = self.fs.get_file_info(selector)
        for info in infos:
            if info.type == pafs.FileType.File and info.path.endswith(SEGMENT_SUFFIX):
                rel = info.path[len(self.base) + 1:]
                out.append(StoredObject(rel, info.size, (info.mtime_ns or 0) / 1e9))
        return sorted(out, key=lambda o: o.path)

    def delete(self, rel: str) -> None:
        try:
            with self._reaching(f"deleting {rel}"):
                self.fs.delete_file(self._key(rel))
        except FileNotFoundError:
            pass

    def other_objects(self, prefix: str, suffix: str) -> list[StoredObject]:
        """Objects under `<base>/<prefix>` whose names end with `suffix`, sorted by path (run journals: journal.py)."""
        selector = pafs.FileSelector(self._key(prefix), recursive=True, allow_not_found=True)
        with self._reaching(f"listing {prefix}"):
            infos = self.fs.get_file_info(selector)
        return sorted((StoredObject(i.path[len(self.base) + 1:], i.size, (i.mtime_ns or 0) / 1e9) for i in infos
                       if i.type == pafs.FileType.File and i.path.endswith(suffix)), key=lambda o: o.path)

    def read_bytes(self, rel: str) -> bytes:
        """One whole object's bytes (FileNotFoundError when there is none)."""
        with self._reaching(f"reading {rel}"), self.fs.open_input_stream(self._key(rel)) as source:
            return source.read()

    def delete_run(self, run_id: str) -> Freed:
        objects = self.objects(run_id)
        self._forget_rows(run_id + "/")  # (a single discarded segment was never read: nothing kept of it)
        for obj in objects:
            self.delete(obj.path)
        return Freed.of(objects)

    def ping(self) -> None:
        with self._reaching("a health check"):
            self.fs.get_file_info(self.base)

    def check(self) -> None:
        """List the prefix, then write and delete a probe object: reachable, bucket present, credentials allowed."""
        probe = f"{self.base}/.probe-{uuid.uuid4().hex}"
        try:
            self.fs.get_file_info(pafs.FileSelector(self.base, recursive=False, allow_not_found=True))
            with self.fs.open_output_stream(probe) as out:
                out.write(b"probe")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise SegmentStoreUnreachable(
                f"the segment store REPLAY_SEGMENTS_URL={self.url} cannot be used (listing its prefix and writing a "
                f"probe object failed: {exc}); check the bucket exists and AWS_ENDPOINT_URL, AWS_REGION, "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", self.url) from None


def s3_filesystem(env: dict[str, str] | None = None) -> pafs.S3FileSystem:
    """An S3FileSystem configured from the usual AWS variables (endpoint, region; credentials by the AWS chain)."""
    env = dict(os.environ if env is None else env)
    options: dict = {"region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
                     "connect_timeout": 5.0, "request_timeout": 30.0,
                     # a few attempts, not the SDK's default ten: an unreachable store is refused at start-up soon
                     "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["endpoint_override"] = parts.netloc
        options["scheme"] = parts.scheme
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        options.update(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                       session_token=env.get("AWS_SESSION_TOKEN"))
    return pafs.S3FileSystem(**options)


def open_segment_store(data_dir: Path, segments_url: str | None) -> SegmentStore:
    """The store settings name: `s3://bucket/prefix`, or `<data>/runs` when unset.

    Local segments live under the data directory only: a run's deletion renames its folder into `<data>/trash`
    (one filesystem), journal and segments together.
    """
    if not segments_url:
        return LocalSegments(Path(data_dir) / "runs")
    parts = urlsplit(segments_url)
    if parts.scheme != "s3" or not parts.netloc:
        raise SegmentStoreUnreachable(
            f"REPLAY_SEGMENTS_URL={segments_url!r} is not a segment store URL: use s3://bucket/prefix "
            "(or leave it unset for <data>/runs)")
    base = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    return S3Segments(s3_filesystem(), base, segments_url)
