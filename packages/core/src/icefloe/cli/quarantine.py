"""``icefloe quarantine``: list and acknowledge the files the coordinator quarantined.

Kept apart from :mod:`icefloe.cli.main` so the core CLI stays small; the commands only need the
pipeline's catalog (the quarantine is an Iceberg table there, whatever the backend).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from icefloe.config import load_config

if TYPE_CHECKING:  # pyarrow and pyiceberg load when a quarantine command runs, not with the CLI
    from icefloe.commit.quarantine import Quarantine

app = typer.Typer(
    name="quarantine",
    help="Files the coordinator refused to commit: list them, drop (acknowledge) them.",
    no_args_is_help=True,
)

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Pipeline TOML file.")]
TableOption = Annotated[
    str | None, typer.Option("--table", "-t", help="Only entries of this target table.")
]
QuarantineTableOption = Annotated[
    str | None,
    typer.Option(
        "--quarantine-table",
        help="Where the coordinator records them (default: coordination.quarantine_table).",
    ),
]


def _open(config: Path, quarantine_table: str | None) -> tuple[str, Quarantine]:
    # imported here: pyiceberg's catalog loading is slow, other commands stay quick
    from pyiceberg.catalog import load_catalog

    from icefloe.commit.quarantine import Quarantine

    cfg = load_config(config)
    catalog = load_catalog(cfg.catalog.name, **cfg.catalog.properties)
    return cfg.name, Quarantine(catalog, quarantine_table or cfg.coordination.quarantine_table)


@app.command("list")
def list_command(
    config: ConfigOption,
    table: TableOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    quarantine_table: QuarantineTableOption = None,
) -> None:
    """List the pipeline's quarantined files, oldest first."""
    group_id, quarantine = _open(config, quarantine_table)
    entries = quarantine.list(group_id, table)
    for e in entries:
        if as_json:
            typer.echo(
                json.dumps(
                    {**e.__dict__, "quarantined_at": e.quarantined_at.isoformat()},
                    sort_keys=True,
                )
            )
        else:
            typer.echo(
                f"{e.quarantined_at.isoformat()}  {e.table_name}  {e.file_path}  "
                f"records={e.record_count}  writer={e.writer_id} batch={e.batch_seq}  "
                f"{e.error_type}: {e.error_message}"
            )
    if not as_json:
        typer.echo(f"{len(entries)} quarantined file(s)", err=True)


@app.command("drop")
def drop_command(
    config: ConfigOption,
    table: TableOption = None,
    path: Annotated[
        str | None, typer.Option("--path", "-p", help="Only the entry of this file.")
    ] = None,
    drop_all: Annotated[bool, typer.Option("--all", help="Every entry of the pipeline.")] = False,
    quarantine_table: QuarantineTableOption = None,
) -> None:
    """Acknowledge entries: delete them from the quarantine (the data files stay in place;
    add them to a table yourself, e.g. with pyiceberg's add_files, if they are wanted)."""
    if table is None and path is None and not drop_all:
        raise typer.BadParameter("name --table and/or --path, or pass --all")
    group_id, quarantine = _open(config, quarantine_table)
    n = quarantine.drop(group_id, table, path)
    typer.echo(f"dropped {n} quarantined file(s)")
