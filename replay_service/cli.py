"""`replay-service`: run the service (optionally with a demo run)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer
import uvicorn

from replay_service.settings import DEFAULT_PORT, ServiceSettings

app = typer.Typer(help="routing-replay: record, check and serve MoE routing for R3.", no_args_is_help=True)


@app.callback()
def main() -> None:
    """routing-replay service commands."""


@app.command()
def serve(
    data: Path = typer.Option(Path("replay-data"), "--data", help="directory of the Arrow store"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="port to listen on"),
    demo: bool = typer.Option(False, "--demo", help="load a synthetic run with every kind of flagged row"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the store in DATA over HTTP."""
    from replay_service.app import create_app
    from replay_service.store import RouteStore

    settings = ServiceSettings(data_dir=data)
    store = RouteStore(settings)
    if store.swept:
        logging.getLogger("replay_service").warning("removed %d unacknowledged partial files", len(store.swept))
    if demo:
        from replay_service.demo import load_demo

        summary = load_demo(store)
        typer.echo(f"demo run {summary['run_id']!r}: {summary['requests']} requests, {summary['rows']} rows")
    typer.echo(f"routing-replay on http://{host}:{port}  (data: {data.resolve()}, API docs: /docs)")
    uvicorn.run(create_app(settings, store), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    app()
