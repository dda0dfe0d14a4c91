"""The ``icefloe`` command line. Core provides configuration and coordination commands;
plugins (the Spark runner) add theirs through the ``icefloe_cli`` hook."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from icefloe import __version__
from icefloe.backends import backend_config, open_backend
from icefloe.config import load_config, redact, redacted_dict
from icefloe.errors import IcefloeError
from icefloe.plugins import get_plugins

app = typer.Typer(
    name="icefloe",
    help="Exactly-once, centrally coordinated commits of streaming data into Apache Iceberg.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

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
        console.print(f"[yellow]backend section not validated: {exc}[/yellow]")
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
    backend = open_backend(cfg)
    try:
        warnings = backend.doctor()
    finally:
        backend.close()
    for w in warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    typer.echo("ok" if not warnings else f"{len(warnings)} warning(s)")


def main() -> None:
    """Entry point: add plugin commands, run, and turn icefloe errors into one clean line."""
    try:
        get_plugins().extend_cli(app)
        app()
    except IcefloeError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)
