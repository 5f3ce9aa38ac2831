"""`replay-service`: run the service (optionally with a demo run)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import uvicorn
from uvicorn.config import STARTUP_FAILURE

from replay_service import __version__
from replay_service.errors import ServiceError
from replay_service.settings import DEFAULT_PORT, BadSetting, ServiceSettings, load_settings

if TYPE_CHECKING:
    from replay_service.store import RouteStore

app = typer.Typer(help="routing-replay: record, check and serve MoE routing for R3.", no_args_is_help=True)


def _print_version(wanted: bool) -> None:
    """`--version`: the installed release (its distribution version), then exit."""
    if wanted:
        typer.echo(f"routing-replay {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print the installed routing-replay version and exit"),
) -> None:
    """routing-replay service commands."""


# The settings a command-line option sets, by field: a bad value is named as the option where it was given.
OPTIONS = {"data_dir": "--data", "keep_alive_timeout_s": "--keep-alive-timeout", "max_connections": "--max-connections",
           "tokens_file": "--tokens-file", "workers": "--workers"}


def _settings(**given: Any) -> ServiceSettings:
    """The settings of a command (`given`: its options, None where not given); exit 2 with one line naming each bad
    value, its variable or option, and what it needs."""
    try:
        return load_settings(OPTIONS, **given)
    except BadSetting as exc:
        typer.echo(f"replay-service: {exc}", err=True)
        raise typer.Exit(2) from None


def _open_to_serve(settings: ServiceSettings) -> RouteStore:
    """The store `settings` name, its start-up checks passed and sweep logged; exit 2 naming what refused it.

    An index or bucket it cannot reach is tried again once a second for REPLAY_START_WAIT_S, each miss logged.
    """
    from replay_service.app import open_store
    from replay_service.errors import IndexNeedsRebuild, IndexTooNew, IndexUnreachable, SegmentStoreUnreachable

    deadline = time.monotonic() + settings.start_wait_s
    while True:
        try:
            store = open_store(settings)
            break
        except (IndexUnreachable, SegmentStoreUnreachable) as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                typer.echo(f"replay-service: {exc.message}", err=True)
                raise typer.Exit(2) from None
            logging.getLogger("replay_service").warning("start-up: %s; trying again for %.0f s more (REPLAY_START_"
                                                        "WAIT_S)", exc.message, left)
            time.sleep(min(1.0, left))
        except (IndexNeedsRebuild, IndexTooNew) as exc:
            typer.echo(f"replay-service: {exc.message}", err=True)
            raise typer.Exit(2) from None
    if store.swept.removed or store.swept.quarantined:
        logging.getLogger("replay_service").warning(
            "start-up: deleted %d unfinished segment writes, quarantined %d unindexed segments (under %s)",
            len(store.swept.removed), len(store.swept.quarantined), Path(settings.data_dir) / "quarantine")
    return store


def _load_demo(store: RouteStore) -> None:
    """Store the demo run through an ingest pipeline over `store`, as an ingest would; say what it holds."""
    from replay_service.ingest.pipeline import IngestPipeline
    from replay_service.ops.demo import load_demo

    pipeline = IngestPipeline.over(store)
    try:
        summary = load_demo(pipeline)
    finally:
        pipeline.close()
    typer.echo(f"demo run {summary.run_id!r}: {summary.requests} requests, {summary.rows} rows")


@app.command()
def serve(
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="port to listen on"),
    demo: bool = typer.Option(False, "--demo", help="load a synthetic run with every kind of flagged row"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
    keep_alive_timeout: int | None = typer.Option(
        None, "--keep-alive-timeout", help="seconds an idle connection stays open (REPLAY_KEEP_ALIVE_TIMEOUT_S)"),
    max_connections: int | None = typer.Option(
        None, "--max-connections", help="open connections at most (REPLAY_MAX_CONNECTIONS)"),
    tokens_file: Path | None = typer.Option(
        None, "--tokens-file", help="bearer tokens, `token role [run-prefix]` per line (REPLAY_TOKENS_FILE)"),
    insecure: bool = typer.Option(
        False, "--insecure", help="without a tokens file, listen on a non-loopback address anyway: anyone who "
        "reaches the port can read, write and delete everything"),
    workers: int | None = typer.Option(
        None, "--workers", min=0, help="worker processes sharing the port, index and segments; 0: one per core "
        "(REPLAY_WORKERS, default 0)"),
) -> None:
    """Serve the store in DATA over HTTP, with one worker process per core unless told otherwise."""
    from replay_service.api.auth import Tokens, listen_refusal
    from replay_service.app import create_app

    settings = _settings(data_dir=data, keep_alive_timeout_s=keep_alive_timeout, max_connections=max_connections,
                         tokens_file=tokens_file, workers=workers)
    refusal = listen_refusal(host, settings.tokens_file, insecure)
    if refusal is not None:
        typer.echo(f"replay-service: {refusal}", err=True)
        raise typer.Exit(2)
    try:
        tokens = Tokens.load(settings.tokens_file)  # a bad tokens file stops the start, naming its line
    except (OSError, ValueError) as exc:
        typer.echo(f"replay-service: tokens file: {exc}", err=True)
        raise typer.Exit(2) from None
    store = _open_to_serve(settings)
    if demo:
        _load_demo(store)
    from replay_service.ops.workers import WorkerCannotStart, reload_tokens_on_sighup, run_workers, worker_count

    count = worker_count(settings.workers)
    typer.echo(f"routing-replay on http://{host}:{port}  (data: {data.resolve()}, {count} worker"
               f"{'s' if count > 1 else ''}, API docs: /docs)")
    if settings.tokens_file is None and insecure:
        logging.getLogger("replay_service").warning("--insecure: no tokens file, every caller may do anything")
    from replay_service.ops.connections import protocol

    # httptools + uvloop (uvicorn[standard]): no copy of a body part on its way to the socket, every connection
    # bounded (REPLAY_HEADER_TIMEOUT_S among them: connections.py)
    options: dict[str, Any] = dict(host=host, port=port, log_level=log_level, http=protocol(settings), loop="uvloop",
                   timeout_keep_alive=settings.keep_alive_timeout_s, limit_concurrency=settings.max_connections)
    if count == 1:
        from replay_service.ops.stacks import dump_stacks_on_signal

        dump_stacks_on_signal()  # `kill -USR1 PID`: every thread's stack to the log (each worker registers its own)
        reload_tokens_on_sighup(tokens)  # `kill -HUP PID`: read the tokens file again (the supervisor's own, else)
        uvicorn.run(create_app(settings, store, tokens=tokens), **options)
        return
    store.close()  # checked and swept alone; each worker opens its own (ops/workers.py)
    try:
        run_workers(settings, count, tokens, **options)
    except WorkerCannotStart as exc:  # the service stopped: exit as uvicorn does when its one process cannot start
        typer.echo(f"replay-service: stopped: {exc}", err=True)
        raise typer.Exit(STARTUP_FAILURE) from None


def _refusals() -> tuple[type[ServiceError], ...]:
    """What stops a command before it does anything, with a message naming the setting (index, bucket, state)."""
    from replay_service.errors import (
        Conflict,
        IndexNeedsRebuild,
        IndexTooNew,
        IndexUnreachable,
        SegmentStoreUnreachable,
    )

    return Conflict, IndexNeedsRebuild, IndexTooNew, IndexUnreachable, SegmentStoreUnreachable


def _progress():
    """A rich progress bar for long store work."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())


@app.command()
def reindex(
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
    restore_quarantine: bool = typer.Option(
        False, "--restore-quarantine", help="first move quarantined segments back under runs/"),
) -> None:
    """Rebuild DATA's index from its segments and run journals (with the service, every replica, stopped).

    Segments and journals are read where REPLAY_SEGMENTS_URL puts them (a bucket: every replica's). The index is
    <data>/index.sqlite, the old one kept as index.sqlite.before-reindex-<time>; or, with REPLAY_INDEX_URL, the
    PostgreSQL database it names, which must be empty (a new database after losing the old one): one holding
    runs is refused, exit status 2. Exit status 1 when a segment could not be indexed (damaged, or written
    before segment 2.2).
    """
    from replay_service.ops.reindex import reindex as rebuild
    from replay_service.store.segments.places import open_segment_store

    settings = _settings(data_dir=data)
    try:
        total = len(open_segment_store(data, settings.segments_url).paths())
        with _progress() as progress:
            scanned = progress.add_task("checking segments", total=total)
            committed = progress.add_task("indexing segments", total=total)
            seen: set[str] = set()

            def step(rel: str) -> None:
                progress.advance(committed if rel in seen else scanned)
                seen.add(rel)

            report = rebuild(data, settings, restore=restore_quarantine, progress=step)
    except _refusals() as exc:
        typer.echo(f"replay-service: {exc.message}", err=True)
        raise typer.Exit(2) from None
    into = "into the database REPLAY_INDEX_URL names" if settings.index_url else str(data)
    typer.echo(f"reindexed {into}: {report.runs} runs, {report.segments} segments, {report.rows} rows, "
               f"{report.events} journal events replayed")
    if report.restored:
        typer.echo(f"took back {len(report.restored)} quarantined segments")
    if report.old_index is not None:
        typer.echo(f"the previous index is kept as {report.old_index}")
    if report.duplicates:
        typer.echo(f"{len(report.duplicates)} segments repeat a stored batch (not indexed; the next start "
                   "quarantines them)")
    for rel, why in report.damaged + report.unusable:
        typer.echo(f"NOT INDEXED runs/{rel}: {why}", err=True)
    if report.damaged or report.unusable:
        raise typer.Exit(1)


@app.command()
def verify(
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
    run: str | None = typer.Option(None, "--run", help="only this run's segments"),
) -> None:
    """Check every segment's checksum and every run journal line; list what fails (exit status 1 when any).
    Safe while serving.

    Segments where REPLAY_SEGMENTS_URL puts them, and those the index (REPLAY_INDEX_URL, or <data>/index.sqlite)
    names: one it names that is not stored counts as damaged. A journal line reindex could not replay (a newer
    major, a damaged line) is named.
    """
    from replay_service.ops.verify import verify_store
    from replay_service.store.segments.places import open_segment_store

    settings = _settings(data_dir=data)
    try:
        segments = open_segment_store(data, settings.segments_url)
        with _progress() as progress:
            task = progress.add_task("verifying segments", total=None)
            found = verify_store(data, run, progress=lambda _: progress.advance(task), store=segments,
                                 index_url=settings.index_url)
            progress.update(task, total=found.segments, completed=found.segments)
    except _refusals() as exc:
        typer.echo(f"replay-service: {exc.message}", err=True)
        raise typer.Exit(2) from None
    for rel, why in found.damaged:
        typer.echo(f"DAMAGED runs/{rel}: {why}")
    for bad in found.unreadable:
        typer.echo(f"UNREADABLE runs/{bad.where}: {bad.why}")
    typer.echo(f"{found.segments} segments checked, {len(found.damaged)} damaged; {found.journal_lines} journal "
               f"lines read, {len(found.unreadable)} unreadable")
    if not found.clean:
        raise typer.Exit(1)


# delete, gc and export work on the store, not through the API: they need no token and no running service, and
# use the service's own code and settings (store/lifecycle/retention.py, ops/export.py): the index and segments are
# where REPLAY_INDEX_URL and REPLAY_SEGMENTS_URL put them, as for `serve`. delete and gc change the index: run them
# with the service stopped (on a running one: DELETE /v1/runs/{run}, and REPLAY_RETENTION_* settings); with a
# PostgreSQL index and a bucket, `gc --orphans` is safe beside running replicas.


@app.command()
def delete(
    run: str = typer.Argument(..., help="run id"),
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
) -> None:
    """Delete RUN's rows and files from DATA (with the service stopped; on a running one: DELETE /v1/runs/RUN)."""
    from replay_service.app import open_store
    from replay_service.errors import NotFound

    try:
        store = open_store(_settings(data_dir=data))
    except _refusals() as exc:
        typer.echo(f"replay-service: {exc.message}", err=True)
        raise typer.Exit(2) from None
    try:
        removed = store.delete_run(run)
    except NotFound as exc:
        typer.echo(f"replay-service: {exc.message}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    typer.echo(f"deleted run {run!r}: {removed.rows} index rows, {removed.files} files, {removed.bytes} bytes")


@app.command()
def gc(
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
    max_bytes: int | None = typer.Option(None, "--max-bytes", help="default: REPLAY_RETENTION_MAX_BYTES (0: off)"),
    max_age_s: float | None = typer.Option(None, "--max-age-s", help="default: REPLAY_RETENTION_MAX_AGE_S (0: off)"),
    orphans: bool = typer.Option(
        False, "--orphans", help="only delete bucket objects no index row names, older than REPLAY_ORPHAN_GRACE_S "
        "(safe beside running replicas)"),
) -> None:
    """Delete the least recently written unpinned runs of DATA until under the limits (with the service stopped)."""
    from replay_service.app import open_store
    from replay_service.store.lifecycle.retention import collect_orphans, due

    settings = _settings(data_dir=data)
    cap = settings.retention_max_bytes if max_bytes is None else max_bytes
    age = settings.retention_max_age_s if max_age_s is None else max_age_s
    if orphans:
        from replay_service.store import index_target
        from replay_service.store.index import Index
        from replay_service.store.segments.places import LocalSegments, open_segment_store

        try:
            segments = open_segment_store(data, settings.segments_url)
            if isinstance(segments, LocalSegments):
                typer.echo("segments are local files (REPLAY_SEGMENTS_URL unset): nothing to collect, unindexed ones "
                           f"are quarantined at start-up (under {data / 'quarantine'})")
                return
            index = Index(index_target(settings), fsync=False)  # the index replicas share: read only here
            try:
                found = collect_orphans(segments, index, settings.orphan_grace_s)
            finally:
                index.close()
        except _refusals() as exc:
            typer.echo(f"replay-service: {exc.message}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{len(found.deleted)} orphan segments deleted ({found.bytes} bytes), {len(found.young)} younger "
                   f"than REPLAY_ORPHAN_GRACE_S={settings.orphan_grace_s:g} kept")
        return
    try:
        store = open_store(settings)
    except _refusals() as exc:
        typer.echo(f"replay-service: {exc.message}", err=True)
        raise typer.Exit(2) from None
    try:
        import time

        chosen = due(store.index.runs(), cap, age, time.time())
        freed = 0
        with _progress() as progress:
            task = progress.add_task("deleting runs", total=len(chosen))
            for run_id, reason in chosen:
                removed = store.delete_run(run_id, reason)
                freed += removed.bytes
                progress.console.print(f"deleted run {run_id!r}: {reason}; {removed.bytes} bytes")
                progress.advance(task)
    finally:
        store.close()
    typer.echo(f"{len(chosen)} runs deleted, {freed} bytes freed")


@app.command()
def export(
    run: str = typer.Argument(..., help="run id"),
    to: Path = typer.Option(..., "--to", help="the Parquet file to write"),
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
) -> None:
    """Write RUN's rows (request, position, token, experts, flags) to a Parquet file. Read-only: safe while serving."""
    from replay_service.errors import NotFound
    from replay_service.ops.export import export_run

    _settings(data_dir=data)  # refused here, in one line, rather than inside the export
    with _progress() as progress:
        task = progress.add_task("exporting requests", total=None)
        try:
            rows = export_run(data, run, to, progress=lambda done, total: progress.update(task, completed=done,
                                                                                          total=total))
        except NotFound as exc:
            typer.echo(f"replay-service: {exc.message}", err=True)
            raise typer.Exit(1) from None
        except _refusals() as exc:
            typer.echo(f"replay-service: {exc.message}", err=True)
            raise typer.Exit(2) from None
    typer.echo(f"exported {rows} rows of run {run!r} to {to}")


if __name__ == "__main__":
    app()
