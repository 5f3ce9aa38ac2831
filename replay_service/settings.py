"""Service configuration (environment variables `REPLAY_*`, or CLI flags)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from replay_format.segment import IdLayout, SegmentCompression

DEFAULT_PORT = 8470
ENV_PREFIX = "REPLAY_"


class StaleTableScope(enum.StrEnum):
    """Which processes of `serve` share one STALE table (`stale_table_scope`)."""

    HOST = "host"
    WORKER = "worker"


class ReadPlace(enum.Enum):
    """Where a route GET is read: on the event loop that received it, or in a worker thread (placement/on_loop.py)."""

    EVENT_LOOP = "event_loop"
    THREAD = "thread"


class ServiceSettings(BaseSettings):
    """Every setting of the service; each is also the environment variable `REPLAY_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # Defaults are passed as `default=`: type checkers read a positional one as "required".
    data_dir: Path = Field(default=Path("replay-data"), description="directory of the Arrow store")
    tokens_file: Path | None = Field(
        default=None, description="bearer tokens, one `token role [run-prefix]` per line (roles read, write, "
        "admin); without it nothing is authenticated and `serve` listens on loopback only (api/auth.py)")
    max_body_bytes: int = Field(default=512 * 2**20, description="largest accepted request body; larger answers 413")
    max_concurrent_ingests: int = Field(
        default=4, ge=1, description="ingests decoded, checked and written at once (taken once the body has arrived)")
    max_body_bytes_in_flight: int = Field(
        default=2 * 2**30, description="bytes of ingest bodies being received or processed at once, the whole "
        "service's (each worker process gets its share, at least max_body_bytes; each body counts its "
        "content-length, or max_body_bytes without one); a body that does not fit waits")
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="a request body must start within this many seconds and may then lag the "
        "minimum rate by as much; slower answers 408 and the connection is closed")
    body_min_bytes_per_s: int = Field(default=1 << 20, gt=0, description="minimum rate of a request body's arrival")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="a request head must be complete within this many seconds of its first byte "
        "(a new connection's, or the next request's on a kept-alive one); slower answers 408 and the connection is "
        "closed (ops/connections.py)")
    keep_alive_timeout_s: int = Field(
        default=5, ge=1, description="an idle connection (none sent yet, or between requests) is closed after this")
    max_connections: int = Field(
        default=1024, ge=1, description="open connections per worker process; past it a new connection is closed "
        "at once, and requests past it answer 503 (uvicorn's limit_concurrency)")
    workers: int = Field(
        default=0, ge=0, description="worker processes `serve` runs over one index and one segment store, sharing "
        "its listening socket (ops/workers.py); 0: one per core this process may run on")
    max_layout_tokens: int = Field(
        default=1 << 23, description="largest trainer layout planned (every rank of a micro-batch, padding "
        "included); larger answers 413 before anything is allocated")
    open_segment_cache: int = Field(default=256, description="segment files kept memory-mapped for reads")
    open_segment_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="of those, bytes held decompressed in memory at most (compressed segments, "
        "REPLAY_SEGMENT_COMPRESSION; an uncompressed one is a map of the page cache and counts nothing)")
    slice_builds_per_worker: int | None = Field(
        default=None, ge=1, description="trainer slices a worker builds at once, the others waiting their turn; "
        "unset: 1 over local segments (a build holds the GIL most of the time: builds side by side in threads cost "
        "more CPU than they overlap), 8 over a bucket (builds wait on its ranged reads)")
    kept_locations_bytes: int = Field(
        default=64 * 2**20, ge=0, description="per worker: where whole requests' rows lie, kept for the trainer "
        "reads that follow (reused while a request and its segments are unchanged; 0: none kept)")
    stale_table_rows: int = Field(
        default=1 << 21, ge=1, description="rows the STALE content check remembers, one table per host shared by every "
        "worker (32 B a row, rounded up to a power of two: 64 MiB by default)")
    stale_table_scope: StaleTableScope = Field(
        default=StaleTableScope.HOST, description="host: one STALE table shared by every worker of `serve`, so a "
        "copy is found whichever worker stored its original; worker: a table per worker process (copies across "
        "workers are missed; bench/ingest.py's baseline)")
    stale_feed: bool = Field(
        default=True, description="with a PostgreSQL index (replicas), share each host's recently stored rows "
        "through it, so a copy is flagged whichever replica stored its original (ingest/stale_feed.py)")
    stale_feed_interval_s: float = Field(
        default=0.25, gt=0, description="how often each process publishes the rows it stored and learns other "
        "replicas' (a copy reaching another replica within about two intervals of its original is not seen)")
    stale_feed_window_s: float = Field(
        default=900.0, gt=0, description="how long the feed keeps a host's rows in the index (a replica that "
        "starts learns this window's)")
    stale_table_file: Path | None = Field(
        default=None, description="set by `serve` for its workers: the table file they share (checks/recent.py); "
        "unset, a process keeps its own table in memory")
    stale_min_entropy_bits: float = Field(
        default=48.0,
        description="the content STALE check runs only for runs whose rows can take more than 2**bits values")
    max_read_rows: int = Field(
        default=1 << 20, description="most rows one route read returns; page longer ones with start/end")
    max_json_rows: int = Field(
        default=4096, description="largest route range served as JSON; use Arrow or .npy beyond")
    max_batch_requests: int = Field(default=4096, description="most requests in one batch read")
    page_limit_max: int = Field(default=1000, description="largest page of a request listing")
    strict_report_rows: int = Field(default=16, description="bad rows named in a strict-read refusal")
    health_bucket_s: float = Field(
        default=60.0, gt=0, description="width of a run's ingest-time health bucket (flag rates, expert load over "
        "time), seconds; fixed per data directory in practice: buckets of other widths are not merged")
    health_window_s: float = Field(
        default=3600.0, gt=0, description="the recent window /metrics judges each run's health over: requests "
        "written in the last this many seconds")
    health_where: int = Field(default=20, ge=1, le=1000,
                              description="requests a health finding names (each with its first position)")
    metrics_max_runs: int = Field(
        default=100, ge=0, description="runs /metrics exports per-run health series for (the most recently "
        "written); every run is still counted in replay_runs{verdict}")
    segment_compression: SegmentCompression = Field(
        default=SegmentCompression.NONE, description="Arrow IPC buffer compression of new segment files: none "
        "(reads are zero-copy views of the page cache), lz4 or zstd (fewer bytes per id on disk; a segment is "
        "decompressed into memory when opened for reading); segments of any codec are read alike")
    segment_id_layout: IdLayout = Field(
        default=IdLayout.LAYERS, description="where a zstd segment keeps its expert ids: layers (a column per MoE "
        "layer: zstd sees each layer's skew, ~21% fewer bytes per id on skewed routes; segment 3.0) or rows (a row's "
        "ids together, segment 2.6); segments of other codecs are always rows; either layout is read alike")
    segments_url: str | None = Field(
        default=None, description="where segments are stored: unset for <data_dir>/runs (local files), or "
        "s3://bucket/prefix for an S3-compatible bucket (endpoint, region and credentials from AWS_ENDPOINT_URL, "
        "AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); store/segments/places.py")
    orphan_grace_s: float = Field(
        default=3600.0, gt=0, description="a bucket object no index row names is deleted once older than this "
        "(retention passes, `replay-service gc --orphans`); longer than any ingest, which may still commit it")
    index_url: str | None = Field(
        default=None, description="the index: unset for <data_dir>/index.sqlite (SQLite, one service's workers), or "
        "postgresql://user:password@host:port/database for a PostgreSQL database that any number of replicas share "
        "(store/index/backends/); a replica that cannot reach it refuses to start (after REPLAY_START_WAIT_S)")
    start_wait_s: float = Field(
        default=0.0, ge=0, le=3600, description="seconds `serve` keeps trying, once a second, to reach an index or "
        "bucket it cannot reach at start before it refuses to start (0: refuses at once); for replicas started "
        "beside their database and bucket (compose, Kubernetes)")
    hot_reads: ReadPlace = Field(
        default=ReadPlace.EVENT_LOOP, description="where a hot route GET is read: event_loop (an Arrow or .npy "
        "answer of a local store's opened segments, when nothing there would wait: placement/on_loop.py) or thread "
        "(every read handed to a worker thread, as before)")
    direct_io: bool = Field(
        default=True,
        description="write segments with O_DIRECT (skips filling fresh page cache; falls back where unsupported)")
    retention_max_bytes: int = Field(
        default=0, ge=0,
        description="segment bytes kept at most; past it the oldest unpinned runs are deleted (0: off)")
    retention_max_age_s: float = Field(
        default=0, ge=0, description="an unpinned run not written for this many seconds is deleted (0: off)")
    retention_interval_s: float = Field(
        default=60.0, gt=0, description="seconds between two retention passes (when a limit is set)")
    fsync: bool = Field(
        default=True, description="fsync data and index before acknowledging (turn off only for throwaway data)")

    def slice_builds(self) -> int:
        """Trainer slices a worker builds at once: `slice_builds_per_worker`, or its default for the segment store."""
        if self.slice_builds_per_worker is not None:
            return self.slice_builds_per_worker
        return 1 if self.segments_url is None else 8

    @field_validator("index_url")
    @classmethod
    def _a_postgresql_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("the index is a PostgreSQL database: postgresql://user:password@host:port/database "
                             "(or leave it unset for <data_dir>/index.sqlite)")
        return value

    @field_validator("data_dir")
    @classmethod
    def _a_directory(cls, value: Path) -> Path:
        if value.exists() and not value.is_dir():
            raise ValueError("it names a file: the store needs a directory (made if missing)")
        return value


class BadSetting(ValueError):
    """Settings that cannot be used; the message names each one, its value and what it needs, in one line."""


def load_settings(options: dict[str, str] | None = None, **given: Any) -> ServiceSettings:
    """The settings from the environment (`REPLAY_*`) and `given` (what the command line set: None is not set);
    BadSetting naming each bad value, as the command-line option where `options` ({field: "--option"}) names one
    that was given, else as its variable."""
    given = {k: v for k, v in given.items() if v is not None}
    try:
        return ServiceSettings(**given)
    except ValidationError as exc:
        raise BadSetting("; ".join(_bad(error, given, options or {}) for error in exc.errors())) from None


SHOWN_CHARS = 200  # of a refused value in its one line (a path of a few folders is whole; a pasted blob is not)


def _bad(error: Any, given: dict[str, Any], options: dict[str, str]) -> str:
    field = str(error["loc"][0]) if error.get("loc") else "?"
    name = options.get(field, field) if field in given else ENV_PREFIX + field.upper()
    what = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    value = str(error.get("input"))
    shown = value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS] + "..."  # cut inside the quotes
    return f"{name}={shown!r}: {what}"

