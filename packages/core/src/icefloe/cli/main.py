"""The ``icefloe`` command line. Core provides configuration and coordination commands;
plugins (the Spark runner) add theirs through the ``icefloe_cli`` hook."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast, get_args

import tomli_w
import typer
import typer.main

from icefloe import __version__
from icefloe.cli.logs import LogFormatOption, LogLevelOption, VerboseOption, resolve_level
from icefloe.cli.logs import configure as configure_logging
from icefloe.cli.new_backend import new_backend_command
from icefloe.cli.quarantine import app as quarantine_app
from icefloe.config import load_config, redact, redacted_dict, show_references
from icefloe.errors import ConfigError, IcefloeError
from icefloe.options import MetricsPortOption
from icefloe.plugins.backends import backend_config, installed_backends, open_backend
from icefloe.plugins.manager import get_plugins

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    name="icefloe",
    help="Exactly-once, centrally coordinated commits of streaming data into Apache Iceberg.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(quarantine_app)


@functools.cache
def _console() -> Console:
    """stderr's rich console, made on first use: commands that print nothing through it
    (``icefloe status``) do not import rich."""
    from rich.console import Console

    return Console(stderr=True)


def _say(label: str, style: str, message: str) -> None:
    """One unwrapped stderr line; plain text, so brackets in messages are not markup."""
    from rich.text import Text

    _console().print(Text.assemble((label, style), message), soft_wrap=True)


ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Pipeline TOML file.")]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"icefloe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Exactly-once, centrally coordinated commits of streaming data into Apache Iceberg."""


@app.command()
def version() -> None:
    """Print the icefloe version."""
    typer.echo(__version__)


@app.command("show-config")
def show_config(
    config: ConfigOption,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of TOML.")] = False,
) -> None:
    """Print the effective configuration (file + environment) with secrets redacted, as TOML
    (a file you can use) or JSON."""
    cfg = load_config(config)
    data = redacted_dict(cfg)
    try:
        data["coordination"][cfg.coordination.backend] = redact(
            backend_config(cfg).model_dump(mode="python")
        )
    except IcefloeError as exc:
        _say("warning: ", "yellow", f"backend section not validated: {exc}")
    data = show_references(data, cfg)
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
    else:
        typer.echo(tomli_w.dumps(_toml_ready(data)), nl=False)


def _toml_ready(value: Any) -> Any:
    """TOML has no null: leave out unset keys (their defaults apply when read back)."""
    if isinstance(value, dict):
        return {k: _toml_ready(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_toml_ready(v) for v in value if v is not None]
    return value


@app.command()
def backends() -> None:
    """List the installed coordination backends, each with the backend contract it implements
    and the distribution that provides it, and the record codecs. A backend of a contract
    this icefloe cannot drive is marked OUTDATED and explained on stderr."""
    plugins = get_plugins()
    refusals: list[str] = []
    for b in installed_backends(plugins):
        refusal = b.refusal()
        flag = "OUTDATED " if refusal else ""
        typer.echo(
            f"backend  {b.spec.name:10s} contract {b.contract}  {b.origin:34s} "
            f"{flag}{b.spec.description}"
        )
        if refusal:
            refusals.append(refusal)
    for name, cspec in sorted(plugins.codecs().items()):
        typer.echo(f"codec    {name:10s} {cspec.description}")
    for refusal in refusals:
        _say("outdated: ", "red", refusal)


@app.command()
def doctor(
    config: ConfigOption,
    verbose: VerboseOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per check.")] = False,
) -> None:
    """Check everything `icefloe run` needs, one line each: plugins, the backend's server and
    its durability settings, the catalog and every table, the Kafka source and its topics,
    Java. Exits 1 when anything would make `run` fail."""
    from icefloe.ops.doctor import run_checks

    configure_logging(resolve_level(None, verbose, quiet=not verbose))
    cfg = load_config(config)
    checks = run_checks(cfg, verbose=verbose)
    styles = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        if as_json:
            typer.echo(json.dumps({"check": c.name, "status": c.status, "detail": c.detail}))
        else:
            _say(f"{c.status:4s} ", styles[c.status], f"{c.name}: {c.detail}")
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    summary = f"{failed} failed, {warned} warning(s), {len(checks) - failed - warned} ok"
    _say("", "", summary if failed else f"ok ({summary})")
    if failed:
        raise typer.Exit(1)


@app.command()
def status(
    config: ConfigOption,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """The pipeline's state from the backend and the catalog (no Spark): leader, token, lease
    age, writers, and per table the last commit, rows, lag, quarantined files. Exits 1 when a
    table is stuck or the backend is unreachable."""
    from icefloe.ops.status import collect, render_lines

    configure_logging(resolve_level(None, quiet=True))
    cfg = load_config(config)
    state = collect(cfg)
    if as_json:
        typer.echo(json.dumps(state.to_json(), default=str))
    else:
        for line in render_lines(state):
            typer.echo(line)
    if state.stuck:
        raise typer.Exit(1)


@app.command()
def maintain(
    config: ConfigOption,
    table: Annotated[
        list[str] | None, typer.Option("--table", help="Only this table (repeatable).")
    ] = None,
    expire_older_than: Annotated[
        str, typer.Option(help="Expire snapshots older than this (e.g. 7d, 12h).")
    ] = "7d",
    retain_last: Annotated[int, typer.Option(help="Always keep this many newest.")] = 1,
    orphans_older_than: Annotated[
        str, typer.Option(help="Delete unreferenced files only when older than this.")
    ] = "3d",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report, change nothing.")] = False,
    compact: Annotated[
        bool,
        typer.Option(
            "--compact",
            help="First rewrite data files with their position deletes applied, and merge "
            "small files (every partition that has deletes or small files).",
        ),
    ] = False,
) -> None:
    """Expire old snapshots and delete orphan files (with --compact: compact first); safe
    next to a running pipeline."""
    from icefloe.ops import maintenance  # pulls in pyiceberg

    for line in maintenance.maintain(
        load_config(config),
        table or (),
        maintenance.parse_age(expire_older_than),
        retain_last,
        maintenance.parse_age(orphans_older_than),
        dry_run,
        compact,
    ):
        typer.echo(line)


@app.command("coordinator")
def coordinator_command(
    config: ConfigOption,
    coordinator_id: Annotated[
        str | None,
        typer.Option("--id", help="Name of this process in the lease (default: host-pid)."),
    ] = None,
    verbose: VerboseOption = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Warnings and errors only.")] = False,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = "text",
    metrics_port: MetricsPortOption = None,
) -> None:
    """Run the pipeline's commit coordinator standalone until SIGINT or SIGTERM.

    Several may run: one leads, the others wait to take over when it stops or dies.
    """
    # imported here: the command pulls in pyiceberg, the other commands stay quick
    import os
    import signal
    import socket
    import threading

    from pyiceberg.catalog import load_catalog

    from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
    from icefloe.metrics import start_metrics

    configure_logging(resolve_level(log_level, verbose, quiet), log_format)
    cfg = load_config(config)
    start_metrics(metrics_port)
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
            CoordinatorSettings.for_pipeline(cfg),
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


@app.command("drain")
def drain_command(
    config: ConfigOption,
    timeout_s: Annotated[
        float, typer.Option("--timeout", help="Give up after this many seconds.")
    ] = 600.0,
) -> None:
    """Commit everything the configured channel still holds, then mark every table the
    pipeline commits to ([[tables]], the dead-letter table, dynamic tables) as drained of it,
    so the pipeline may continue on another backend. Stop the pipeline (`icefloe run`)
    first. Exits 0 once drained."""
    import logging
    import os
    import socket

    from pyiceberg.catalog import load_catalog

    from icefloe.commit.committer import IcebergCommitter
    from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
    from icefloe.ops.drain import drain
    from icefloe.ops.tables import pipeline_tables

    cfg = load_config(config)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = f"drain-{socket.gethostname()}-{os.getpid()}"
    catalog = load_catalog(cfg.catalog.name, **cfg.catalog.properties)
    backend = open_backend(cfg)
    try:
        coordinator = Coordinator(
            cfg.name,
            backend.coordinator(name),
            catalog,
            CoordinatorSettings.for_pipeline(cfg),
            coordinator_id=name,
        )
        try:
            result = drain(
                coordinator,
                IcebergCommitter.for_pipeline(catalog, cfg),
                lambda: pipeline_tables(catalog, cfg),
                timeout_s=timeout_s,
            )
        finally:
            coordinator.close()
    finally:
        backend.close()
    _say("", "", f"drained channel {result.channel_id} of pipeline {cfg.name}")
    for table in result.skipped:
        _say(
            "note: ",
            "yellow",
            f"{table}: not marked (absent, or committed through another channel)",
        )


@app.command("rollback")
def rollback_command(
    config: ConfigOption,
    table: Annotated[str, typer.Argument(help="The table (namespace.table) to roll back.")],
    snapshot_id: Annotated[
        int, typer.Argument(help="Its current snapshot or one of that snapshot's ancestors.")
    ],
    no_replay: Annotated[
        bool,
        typer.Option(
            "--no-replay",
            help="Accept the rollback: the rolled-back rows stay out, nothing is replayed "
            "(the way for upsert/cdc tables, and for a rollback another tool made).",
        ),
    ] = False,
) -> None:
    """Roll TABLE back to SNAPSHOT_ID on the pipeline's branch and say what the pipeline will
    do: a running `icefloe run` re-reads the rolled-back source range and commits those rows
    to TABLE again, exactly once; no other table is touched."""
    from pyiceberg.catalog import load_catalog

    from icefloe.commit.committer import IcebergCommitter
    from icefloe.commit.rollback import describe, keyed_refusal
    from icefloe.ops.tables import change_options, pipeline_tables

    cfg = load_config(config)
    catalog = load_catalog(cfg.catalog.name, **cfg.catalog.properties)
    if table not in pipeline_tables(catalog, cfg):
        raise ConfigError(
            "tables",
            f"'{table}' is not a table the pipeline commits to",
            "name one of its [[tables]], its dead-letter table or a [dynamic_tables] table "
            "it committed to",
            table,
        )
    options = change_options(cfg, table)
    if options is not None and options.keyed and not no_replay:
        raise keyed_refusal(table, options.mode)
    committer = IcebergCommitter.for_pipeline(catalog, cfg)
    rollback = committer.roll_back(table, snapshot_id, replay=not no_replay)
    typer.echo(describe(rollback, table, replay=not no_replay))


def build_command() -> Any:
    """The click command behind ``icefloe``, plugin commands included. Flags (boolean
    options) show no ``<bool>`` value placeholder in help: they take no value."""
    get_plugins().extend_cli(app)
    command = typer.main.get_command(app)
    commands = [command, *getattr(command, "commands", {}).values()]
    for cmd in commands:
        for param in cmd.params:
            param.metavar = "" if getattr(param, "is_flag", False) else _placeholder(param)
        cmd.get_help_option = _flag_help_option(cmd.get_help_option)
    return command


def _placeholder(param: Any) -> str | None:
    """A short, plain value placeholder (``PATH``, ``N``, ``TEXT``) instead of typer's Python
    types (``<list[str]>``, ``<int range>``), which also widen help's columns until option
    names are cut; an argument's, a choice's or a set metavar stays as it is."""
    desc = getattr(param, "type_descriptor", None)
    if param.metavar is not None or param.param_type_name == "argument" or desc is None:
        return cast("str | None", param.metavar)
    if desc.is_choice:
        return None
    annotation = desc.annotation
    if desc.is_list:
        annotation = next(iter(get_args(annotation)), str)
    if desc.is_path or annotation is Path:
        return "PATH"
    return "N" if annotation in (int, float) else "TEXT"


def _flag_help_option(make: Any) -> Any:
    """``--help`` is made per context: give it no placeholder either."""

    def get_help_option(ctx: Any) -> Any:
        option = make(ctx)
        if option is not None:
            option.metavar = ""
        return option

    return get_help_option


app.command("new-backend")(new_backend_command)


def main() -> None:
    """Entry point: add plugin commands, run, and turn icefloe errors into one clean line."""
    try:
        build_command().main(prog_name="icefloe")
    except IcefloeError as exc:
        _say("error: ", "red", str(exc))
        sys.exit(2)
