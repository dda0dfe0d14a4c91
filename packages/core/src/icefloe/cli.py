"""The ``icefloe`` command line. Core provides configuration and coordination commands;
plugins (the Spark runner) add theirs through the ``icefloe_cli`` hook."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from icefloe import __version__
from icefloe.backends import backend_config, open_backend
from icefloe.config import load_config, redact, redacted_dict
from icefloe.errors import IcefloeError
from icefloe.new_backend import new_backend_command
from icefloe.plugins import get_plugins

app = typer.Typer(
    name="icefloe",
    help="Exactly-once, centrally coordinated commits of streaming data into Apache Iceberg.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _say(label: str, style: str, message: str) -> None:
    """One unwrapped stderr line; plain text, so brackets in messages are not markup."""
    console.print(Text.assemble((label, style), message), soft_wrap=True)


ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Pipeline TOML file.")]


@app.command()
def version() -> None:
    """Print the icefloe version."""
    typer.echo(__version__)


@app.command("show-config")
def show_config(config: ConfigOption) -> None:
    """Print the effective configuration (file + environment) with secrets redacted."""
    cfg = load_config(config)
    data = redacted_dict(cfg)
    try:
        data["coordination"][cfg.coordination.backend] = redact(
            backend_config(cfg).model_dump(mode="python")
        )
    except IcefloeError as exc:
        _say("warning: ", "yellow", f"backend section not validated: {exc}")
    typer.echo(json.dumps(data, indent=2, default=str))


@app.command()
def backends() -> None:
    """List the installed coordination backends and record codecs."""
    plugins = get_plugins()
    for name, spec in sorted(plugins.backends().items()):
        typer.echo(f"backend  {name:10s} {spec.description}")
    for name, cspec in sorted(plugins.codecs().items()):
        typer.echo(f"codec    {name:10s} {cspec.description}")


@app.command()
def doctor(config: ConfigOption) -> None:
    """Check the configuration and the backend's server setup; print warnings."""
    cfg = load_config(config)
    get_plugins().check_pending()
    backend = open_backend(cfg)
    try:
        warnings = backend.doctor()
    finally:
        backend.close()
    for w in warnings:
        _say("warning: ", "yellow", w)
    typer.echo("ok" if not warnings else f"{len(warnings)} warning(s)")


@app.command("coordinator")
def coordinator_command(
    config: ConfigOption,
    coordinator_id: Annotated[
        str | None,
        typer.Option("--id", help="Name of this process in the lease (default: host-pid)."),
    ] = None,
) -> None:
    """Run the pipeline's commit coordinator standalone until SIGINT or SIGTERM.

    Several may run: one leads, the others wait to take over when it stops or dies.
    """
    # imported here: the command pulls in pyiceberg, the other commands stay quick
    import logging
    import os
    import signal
    import socket
    import threading

    from pyiceberg.catalog import load_catalog

    from icefloe.coordinator import Coordinator, CoordinatorSettings

    cfg = load_config(config)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = coordinator_id or f"{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    backend = open_backend(cfg)
    try:
        coordinator = Coordinator(
            cfg.name,
            backend.coordinator(name),
            load_catalog(cfg.catalog.name, **cfg.catalog.properties),
            CoordinatorSettings.from_config(cfg.coordination),
            coordinator_id=name,
        )
        _say("", "", f"coordinator {name} of pipeline {cfg.name} started")
        try:
            coordinator.run(stop)
        finally:
            coordinator.close()
    finally:
        backend.close()
    _say("", "", f"coordinator {name} stopped")


app.command("new-backend")(new_backend_command)


def main() -> None:
    """Entry point: add plugin commands, run, and turn icefloe errors into one clean line."""
    try:
        get_plugins().extend_cli(app)
        app()
    except IcefloeError as exc:
        _say("error: ", "red", str(exc))
        sys.exit(2)
