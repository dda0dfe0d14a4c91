"""Every table a pipeline commits to, not only its ``[[tables]]``: the dead-letter table and
``[dynamic_tables]`` tables are committed by the same coordinator, so ``icefloe drain`` must
mark them, and ``icefloe status`` and ``icefloe maintain`` must cover them (issue 23 §5).

A real SQLite catalog and Parquet files; the old channel is a served reference channel the
pipeline file points to (the commands open it through the ``memory`` backend), the new one a
fresh in-process reference channel. Rows are counted with pyiceberg scans."""

from __future__ import annotations

import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from pyiceberg.catalog.sql import SqlCatalog
from typer.testing import CliRunner

from icefloe.cli.main import app
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.summary import drained_property
from icefloe.config import load_config
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.ops.maintenance import maintain
from icefloe.ops.status import collect, render_lines
from icefloe.ops.tables import committed_tables
from icefloe.plugins.manager import Plugins, new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    make_sqlite_catalog,
    sqlite_catalog_properties,
    write_rows,
)
from icefloe.testing.harness import RowSource, lead, wait_pending
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    memory_backend_options,
    serve_memory_server,
)

GROUP = "pipe"
LISTED = "ns.orders"  # a [[tables]] entry
BAD = "ns.bad"  # the dead-letter table
DYNAMIC = "dyn.old"  # a [dynamic_tables] table committed before the swap
FRESH = "dyn.fresh"  # a [dynamic_tables] table whose only batch waits on the old channel
ALL = (LISTED, BAD, DYNAMIC, FRESH)
SETTINGS = CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=10.0)


def pipeline_file(tmp_path: Path, catalog: SqlCatalog, memory: dict[str, Any]) -> Path:
    path = tmp_path / "pipeline.toml"
    config = {
        "name": GROUP,
        "source": {"topics": ["source"]},
        "tables": [{"name": LISTED}],
        "dynamic_tables": {"route_field": "kind", "namespace": "dyn"},
        "errors": {"policy": "dead_letter", "dead_letter_table": BAD},
        "catalog": {
            "name": catalog.name,
            "properties": sqlite_catalog_properties(tmp_path / "iceberg"),
        },
        "coordination": {"backend": "memory", "memory": memory},
    }
    path.write_text(tomli_w.dumps(config))
    return path


def coordinator(backend: MemoryBackend, catalog: SqlCatalog, name: str) -> Coordinator:
    return Coordinator(
        GROUP,
        backend.coordinator(name),
        catalog,
        SETTINGS,
        coordinator_id=name,
        plugins=new_plugins(autoload=False),
    )


@dataclass
class Stopped:
    """A pipeline stopped with batches left on its (served) channel: two committed cycles of
    LISTED, BAD and DYNAMIC, then one more batch of them and FRESH's first, not committed."""

    path: Path
    catalog: SqlCatalog
    source: RowSource
    fresh: RowSource
    channel_id: str

    def expected(self, table: str) -> list[int]:
        return (self.fresh if table == FRESH else self.source).expected[table]


@pytest.fixture
def stopped(tmp_path: Path, memory_plugins: Plugins) -> Iterator[Stopped]:
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    source = RowSource.create(catalog, [LISTED, BAD, DYNAMIC])
    fresh = RowSource.create(catalog, [FRESH])
    with serve_memory_server() as (server, address):
        path = pipeline_file(tmp_path, catalog, dict(memory_backend_options(address)))
        old = MemoryBackend(server, GROUP, 5.0)
        writer = WriterClient(old.writer("w"), GROUP, "w")
        writer.start()
        first = coordinator(old, catalog, "c0")
        try:
            lead(first)
            for seq in range(2):
                wait_pending(first, source.publish(writer, seq).file_count)
                assert not first.commit_now().failed
            channel_id = first.channel.channel_id()
            source.publish(writer, 2)
            fresh.publish(writer, 3)  # the catalog knows no commit of FRESH yet
        finally:
            first.close()
            writer.close()
        yield Stopped(path, catalog, source, fresh, channel_id)


def test_drain_marks_dead_letter_and_dynamic_tables_so_a_swap_goes_on(stopped: Stopped) -> None:
    """After a correct drain and swap, the new channel's first commit to every table the
    pipeline writes goes through (no ChannelChangedError), nothing lost or duplicated."""
    catalog = stopped.catalog
    drained = CliRunner().invoke(app, ["drain", "--config", str(stopped.path), "--timeout", "60"])
    assert drained.exit_code == 0, drained.output
    for table in ALL:
        assert_exactly_once(catalog, table, stopped.expected(table))

    new = MemoryBackend(MemoryServer(), GROUP, 5.0)
    writer = WriterClient(new.writer("w"), GROUP, "w")
    writer.start()
    heir = coordinator(new, catalog, "c1")
    try:
        lead(heir)
        files = stopped.source.publish(writer, 4).file_count
        files += stopped.fresh.publish(writer, 5).file_count
        wait_pending(heir, files)
        result = heir.commit_now()
        assert not result.failed, result.failed
        assert {r.table for r in result.tables if r.snapshot_id is not None} == set(ALL)
    finally:
        writer.close()
        heir.close()
    for table in ALL:
        assert_exactly_once(catalog, table, stopped.expected(table))
        props = catalog.load_table(table).metadata.properties  # the drain's mark stays
        assert props.get(drained_property(GROUP)) == stopped.channel_id, table


def test_doctor_fails_an_undrained_swap_as_run_would(stopped: Stopped, tmp_path: Path) -> None:
    """Issue 24 item 3: doctor checks every table's channel identity, the property `run`
    refuses on (ChannelChangedError), and names the drain; after the drain it passes."""
    with serve_memory_server() as (_, address):
        config = tomllib.loads(stopped.path.read_text())
        config["coordination"]["memory"] = dict(memory_backend_options(address))
        swapped = tmp_path / "swapped.toml"
        swapped.write_text(tomli_w.dumps(config))

        refused = CliRunner().invoke(app, ["doctor", "--config", str(swapped)])
        assert refused.exit_code == 1, refused.output
        failed = [line for line in refused.output.splitlines() if line.startswith("fail")]
        assert sorted(line.split(":")[0] for line in failed) == sorted(
            f"fail table {t} channel" for t in (LISTED, BAD, DYNAMIC)
        ), refused.output
        for line in failed:
            assert "drain the old backend first" in line, line
            assert "icefloe drain --config" in line, line
            assert stopped.channel_id in line, line

        drained = CliRunner().invoke(app, ["drain", "--config", str(stopped.path)])
        assert drained.exit_code == 0, drained.output
        passed = CliRunner().invoke(app, ["doctor", "--config", str(swapped)])
        assert passed.exit_code == 0, passed.output  # the drained channel is no longer named
        stopped.catalog.drop_table(LISTED)  # a missing table has no channel to check
        missing = CliRunner().invoke(app, ["doctor", "--config", str(swapped)])
        failed = [line for line in missing.output.splitlines() if line.startswith("fail")]
        assert [line.split(":")[0] for line in failed] == [f"fail table {LISTED}"], missing.output


def test_status_and_maintain_cover_dead_letter_and_dynamic_tables(stopped: Stopped) -> None:
    """``icefloe status`` lists every table, FRESH from the channel alone (its only batch is
    pending); ``icefloe maintain`` without ``--table`` maintains every committed one, and
    the quarantine table (its leaders' fences)."""
    config = load_config(stopped.path)
    shown = {t.name: t.pending_files for t in collect(config).tables}
    assert shown == dict.fromkeys(ALL, 1)
    lines = maintain(config)
    covered = set(ALL) - {FRESH} | {config.coordination.quarantine_table}
    assert sorted({line.split(":")[0] for line in lines}) == sorted(covered)


def test_status_shows_a_lag_only_for_the_tables_it_measures(stopped: Stopped) -> None:
    """The source lag is measured for the ``[[tables]]`` entries; a dead-letter or dynamic
    table takes a share of the records, so status prints no lag for it (it printed
    ``lag ?``, which reads as an unknown lag)."""
    lines = render_lines(collect(load_config(stopped.path)))
    shown = {name: line for name in ALL for line in lines if line.startswith(f"  table {name}:")}
    assert sorted(shown) == sorted(ALL)
    assert [n for n, line in shown.items() if ", lag " in line] == [LISTED]


@pytest.mark.parametrize(
    ("key", "line"),
    [
        ("commit_parallelism", "  committers 3 (threads of the leader)"),
        ("commit_processes", "  committers 3 (processes on the leader's machine)"),
        ("commit_tasks", "  committers 3 (Spark tasks on the executors, with icefloe run)"),
    ],
)
def test_status_names_the_leaders_committers(stopped: Stopped, key: str, line: str) -> None:
    """The committers are the leader's threads (as many as ``commit_parallelism`` says) or,
    with ``commit_processes``, processes on its machine, or with ``spark.commit_tasks``,
    Spark tasks."""
    config = load_config(stopped.path)
    section = "spark" if key == "commit_tasks" else "coordination"
    config = config.model_copy(
        update={section: getattr(config, section).model_copy(update={key: 3})}
    )
    status = collect(config)
    counts = {
        "commit_parallelism": status.committers,
        "commit_processes": status.committer_processes,
        "commit_tasks": status.committer_tasks,
    }
    assert counts[key] == 3
    assert line in render_lines(status)


def test_committed_tables_are_found_by_the_groups_property_in_nested_namespaces(
    sqlite_catalog: SqlCatalog,
) -> None:
    """Without ``[dynamic_tables].namespace`` a route value names ``namespace.table`` itself,
    so every namespace is searched, nested ones included; tables of other groups and tables
    nobody committed to are not the pipeline's."""

    def commit(group: str, name: str) -> None:
        table = create_rows_table(sqlite_catalog, name)
        [meta] = write_rows(table, [1], "w", 0)
        uid = str(table.metadata.table_uuid)
        request = TableCommitRequest(
            name, str(uuid.uuid4()), (PendingFile(meta, "w", 0, "0", 0, uid),), {"0": 1}, {}, 1
        )
        assert IcebergCommitter(sqlite_catalog, group).commit(request).data_files == 1

    sqlite_catalog.create_namespace("a")
    commit(GROUP, "a.b.x")
    commit(GROUP, "c.y")
    commit(f"{GROUP}2", "c.z")  # a group whose name starts with ours
    create_rows_table(sqlite_catalog, "c.w")
    assert committed_tables(sqlite_catalog, GROUP, None) == {"a.b.x", "c.y"}
    assert committed_tables(sqlite_catalog, GROUP, "a") == {"a.b.x"}
    assert committed_tables(sqlite_catalog, GROUP, "c") == {"c.y"}
    assert committed_tables(sqlite_catalog, GROUP, "nowhere") == set()

    # asked again with what an earlier call found: those are not loaded again, new ones are
    known: set[str] = set()
    assert committed_tables(sqlite_catalog, GROUP, None, known) == {"a.b.x", "c.y"}
    assert known == {"a.b.x", "c.y"}
    commit(GROUP, "c.v")
    loaded: list[str] = []
    load = sqlite_catalog.load_table

    def counting(identifier: Any) -> Any:
        loaded.append(".".join(SqlCatalog.identifier_to_tuple(identifier)))
        return load(identifier)

    sqlite_catalog.load_table = counting  # type: ignore[method-assign]
    try:
        assert committed_tables(sqlite_catalog, GROUP, None, known) == {"a.b.x", "c.v", "c.y"}
    finally:
        del sqlite_catalog.load_table
    assert sorted(loaded) == ["c.v", "c.w", "c.z"]  # not ours, or new; never a known one
    assert known == {"a.b.x", "c.v", "c.y"}
