"""Bounded table metadata: the committer merges manifests and drops old metadata files when
the table asks for it, and ``doctor`` names the tables that do not; on a real SqlCatalog."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.config import PipelineConfig, config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.reading import announced_files
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ConfigError, StaleFencingTokenError
from icefloe.ops.maintenance import (
    RECOMMENDED_TABLE_PROPERTIES,
    expire_snapshots,
    maintain,
    parse_age,
    recommended_properties,
    remove_orphan_files,
    table_property_advice,
)
from icefloe.plugins.manager import Plugins, new_plugins
from icefloe.testing.fixtures import (
    ROWS_SCHEMA,
    assert_exactly_once,
    create_rows_table,
    make_sqlite_catalog,
    quarantine_entry,
    rows_table,
    sqlite_catalog_properties,
    table_ids,
    write_rows,
)
from icefloe.testing.harness import RowSource, lead, wait_pending
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    memory_backend_options,
    serve_memory_server,
)

TABLE = "db.events"


def commit_cycles(catalog: SqlCatalog, cycles: int) -> None:
    """One real file and one commit per cycle, as a pipeline would."""
    committer = IcebergCommitter(catalog, "pipe")
    table = catalog.load_table(TABLE)
    for seq in range(cycles):
        [meta] = write_rows(table, [seq], "w1", seq)
        pending = PendingFile(meta, "w1", seq, "0", seq, str(table.metadata.table_uuid))
        result = committer.commit(
            TableCommitRequest(TABLE, str(uuid.uuid4()), (pending,), {"0": seq + 1}, {}, 1)
        )
        assert result.data_files == 1


def test_manifests_are_merged_when_the_table_enables_it(sqlite_catalog: SqlCatalog) -> None:
    create_rows_table(sqlite_catalog, TABLE)
    sqlite_catalog.load_table(TABLE).transaction().set_properties(
        {"commit.manifest-merge.enabled": "true", "commit.manifest.min-count-to-merge": "4"}
    ).commit_transaction()

    commit_cycles(sqlite_catalog, 12)

    table = sqlite_catalog.load_table(TABLE)
    snapshot = table.current_snapshot()
    assert snapshot is not None
    manifests = snapshot.manifests(table.io)
    assert len(manifests) < 4, f"{len(manifests)} manifests after 12 commits: none merged"
    assert table_ids(sqlite_catalog, TABLE) == list(range(12))  # merging lost nothing


def test_old_metadata_files_are_deleted_when_the_table_asks(sqlite_catalog: SqlCatalog) -> None:
    create_rows_table(sqlite_catalog, TABLE)
    sqlite_catalog.load_table(TABLE).transaction().set_properties(
        {
            "write.metadata.delete-after-commit.enabled": "true",
            "write.metadata.previous-versions-max": "3",
        }
    ).commit_transaction()

    commit_cycles(sqlite_catalog, 10)

    location = sqlite_catalog.load_table(TABLE).location().removeprefix("file://")
    kept = list((Path(location) / "metadata").glob("*.metadata.json"))
    assert len(kept) <= 4, f"{len(kept)} metadata files kept; previous-versions-max is 3"
    assert table_ids(sqlite_catalog, TABLE) == list(range(10))


def test_advice_names_each_missing_property_and_respects_explicit_values() -> None:
    assert table_property_advice("db.t", recommended_properties()) == []
    advice = table_property_advice("db.t", {"write.metadata.delete-after-commit.enabled": "false"})
    assert len(advice) == len(RECOMMENDED_TABLE_PROPERTIES) - 1
    assert all(a.startswith("table 'db.t': property ") for a in advice)
    assert any("commit.manifest-merge.enabled" in a and "set it to true" in a for a in advice)
    assert (
        recommended_properties({"write.metadata.previous-versions-max": "9"})[
            "write.metadata.previous-versions-max"
        ]
        == "9"
    )


def test_doctor_advice_covers_existing_pipeline_tables_only(tmp_path: Path) -> None:
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = SqlCatalog("doc", **props)
    catalog.create_namespace("db")
    catalog.create_table("db.bare", schema=ROWS_SCHEMA)
    catalog.create_table("db.good", schema=ROWS_SCHEMA, properties=recommended_properties())
    cfg = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "catalog": {"name": "doc", "properties": props},
            "tables": [{"name": "db.bare"}, {"name": "db.good"}, {"name": "db.missing"}],
        }
    )
    from icefloe.ops.doctor import catalog_checks

    advice = [c for c in catalog_checks(cfg) if c.name.endswith(" metadata")]
    assert len(advice) == len(RECOMMENDED_TABLE_PROPERTIES)
    assert all(c.status == "warn" and c.name == "table db.bare metadata" for c in advice)


# --- icefloe maintain next to a live pipeline --------------------------------------------


def _age_everything(location: str, seconds: float) -> None:
    """Make every file under the table look ``seconds`` old (a long-running table)."""
    stamp = time.time() - seconds
    for path in Path(location.removeprefix("file://")).rglob("*"):
        if path.is_file():
            os.utime(path, (stamp, stamp))


def test_maintain_keeps_what_dedupe_and_uncommitted_batches_need(
    sqlite_catalog: SqlCatalog, memory_server: MemoryServer
) -> None:
    source = RowSource.create(sqlite_catalog, [TABLE])
    backend = MemoryBackend(memory_server, "pipe")
    writer = WriterClient(backend.writer("w1"), "pipe", "w1")
    writer.start()
    coordinator = Coordinator(
        "pipe", backend.coordinator("c1"), sqlite_catalog, CoordinatorSettings(3600, 30)
    )
    try:
        lead(coordinator)
        ours: list[int] = []
        for seq in range(3):
            batch = source.publish(writer, seq)
            wait_pending(coordinator, batch.file_count)
            [result] = coordinator.commit_now().tables
            assert result.snapshot_id is not None
            ours.append(result.snapshot_id)
        foreign = []
        for rows in ([900], [901]):  # another tool appends on top of the pipeline's snapshots
            table = sqlite_catalog.load_table(TABLE)
            table.append(pa.table({"id": pa.array(rows, pa.int64())}, schema=_ids_schema()))
            snapshot = sqlite_catalog.load_table(TABLE).current_snapshot()
            assert snapshot is not None
            foreign.append(snapshot.snapshot_id)
        uncommitted = source.publish(writer, 3)  # published, not committed yet
        wait_pending(coordinator, uncommitted.file_count)
        table = sqlite_catalog.load_table(TABLE)
        [stray] = write_rows(table, [999], "crashed-task", 0)  # never announced
        _age_everything(table.location(), 10 * 86_400)
        [young] = write_rows(table, [998], "running-task", 0)  # written just now

        now_ms = int(time.time() * 1000)
        expiry = expire_snapshots(table, now_ms + 1000, retain_last=0)
        reader = backend.coordinator("maintain")
        pending = announced_files(reader, "pipe")
        reader.close()
        orphans = remove_orphan_files(
            sqlite_catalog.load_table(TABLE), now_ms - 86_400_000, pending
        )

        assert expiry.expired == tuple(sorted(ours[:2]))
        assert expiry.kept_for_dedupe == tuple(sorted([ours[2], foreign[0]]))
        announced = {_key(f.path) for f in uncommitted.files[TABLE]}
        assert pending == {f.path for f in uncommitted.files[TABLE]}
        assert set(orphans.kept_pending) == announced
        deleted_data = {p for p in orphans.deleted if "/data/" in p}
        assert deleted_data == {_key(stray.path)}, "only the stray data file is an orphan"
        assert Path(_key(young.path)).exists()

        # the pipeline goes on: commits the pending batch, nothing lost or doubled
        [result] = coordinator.commit_now().tables
        assert result.data_files == uncommitted.file_count
        assert table_ids(sqlite_catalog, TABLE) == sorted(source.expected[TABLE] + [900, 901])
    finally:
        writer.close()
        coordinator.close()


def pipe_config(catalog: str, props: dict[str, str], address: Any) -> PipelineConfig:
    """Pipeline ``pipe`` committing to :data:`TABLE`, on a served memory backend."""
    return config_from_dict(
        {
            "name": "pipe",
            "source": {"topics": ["source"]},
            "tables": [{"name": TABLE}],
            "catalog": {"name": catalog, "properties": props},
            "coordination": {"backend": "memory", "memory": memory_backend_options(address)},
        }
    )


def _key(uri: str) -> str:
    return uri.removeprefix("file://")


def _ids_schema() -> pa.Schema:
    return pa.schema([pa.field("id", pa.int64(), nullable=True)])


def test_ages_parse_and_bad_ones_are_config_errors() -> None:
    assert parse_age("7d") == 7 * 86_400
    assert parse_age("12h") == 12 * 3_600
    assert parse_age("90") == 90
    with pytest.raises(ConfigError, match="not an age"):
        parse_age("soon")


# --- issue 23 §2: maintain never deletes a quarantined file ---------------------------------


def test_maintain_keeps_quarantined_files_so_add_files_recovers_them(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """A batch in flight while the table's partition spec changes is quarantined; the
    channel's position moves past it, so no batch announces its file any more and no snapshot
    names it. ``icefloe maintain`` (age limit 0) must still keep it: the quarantine promises
    the rows back with ``add_files``."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    source = RowSource.create(catalog, [TABLE])
    with serve_memory_server() as (server, address):
        backend = MemoryBackend(server, "pipe")
        writer = WriterClient(backend.writer("w1"), "pipe", "w1")
        writer.start()
        coordinator = Coordinator(
            "pipe",
            backend.coordinator("c1"),
            catalog,
            CoordinatorSettings(3600, 30, table_retry_base_s=0.0, table_retry_max_s=0.0),
            plugins=new_plugins(autoload=False),
        )
        try:
            lead(coordinator)
            in_flight = source.publish(writer, 0)  # written under the old (unpartitioned) spec
            with catalog.load_table(TABLE).update_spec() as update:
                update.add_identity("writer")
            wait_pending(coordinator, in_flight.file_count)
            first = coordinator.commit_now()
            assert (first.failed, first.quarantined) == ({}, {TABLE: in_flight.file_count})
            wait_pending(coordinator, source.publish(writer, 1).file_count)
            assert not coordinator.commit_now().failed
            assert server.stored_position("pipe") == coordinator.read_position
        finally:
            writer.close()
            coordinator.close()
        entries = Quarantine(catalog).list("pipe", TABLE)
        quarantined = [f.path for f in in_flight.files[TABLE]]
        assert [(e.file_path, e.error_type) for e in entries] == [
            (p, "PartitionSpecChangedError") for p in quarantined
        ]
        rows_out = in_flight.ids[TABLE]
        committed = [i for i in source.expected[TABLE] if i not in rows_out]
        assert_exactly_once(catalog, TABLE, committed)

        config = pipe_config(catalog.name, props, address)
        lines = maintain(config, expire_older_than_s=0.0, orphans_older_than_s=0.0)

    assert all(Path(_key(p)).exists() for p in quarantined), lines
    assert any(line.endswith(f", {len(quarantined)} quarantined") for line in lines), lines
    # the operator's recovery, as the quarantine docs say: add the files, drop the entries
    catalog.load_table(TABLE).add_files(quarantined)
    Quarantine(catalog).drop("pipe", TABLE)
    assert_exactly_once(catalog, TABLE, source.expected[TABLE])


def test_dry_run_counts_the_orphans_the_real_run_deletes(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """A dry run expires nothing, yet must count the files only the snapshots it would expire
    reference (their manifest lists): it said 12 where the real run deleted 14."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 4)
    table = catalog.load_table(TABLE)
    [stray] = write_rows(table, [999], "crashed-task", 0)  # never announced: an orphan
    _age_everything(table.location(), 10 * 86_400)
    with serve_memory_server() as (_, address):
        config = pipe_config(catalog.name, props, address)
        would = maintain(config, (), 0.0, 1, 86_400.0, dry_run=True)
        did = maintain(config, (), 0.0, 1, 86_400.0)
    assert would == [line.replace(": ", ": would ", 1) for line in did], (would, did)
    assert did[0] == f"{TABLE}: expire 3 snapshot(s); kept 0 old one(s) the dedupe rule reads"
    # the stray data file and the three expired snapshots' manifest lists
    assert did[1].startswith(f"{TABLE}: delete 4 orphan file(s)"), did
    assert not Path(_key(stray.path)).exists()
    assert_exactly_once(catalog, TABLE, [0, 1, 2, 3])


def test_maintain_compacts_then_expires_then_removes_orphans(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """`icefloe maintain --compact` on an append table: the small files of earlier cycles are
    merged in one replace snapshot (never deleted by the compaction), and only then can
    expiry and orphan removal, in the same run, delete the originals."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 4)
    originals = [t.file.file_path for t in catalog.load_table(TABLE).scan().plan_files()]
    with serve_memory_server() as (_, address):
        config = pipe_config(catalog.name, props, address)
        would = maintain(config, (), 0.0, 1, 0.0, dry_run=True, compact=True)
        assert would[0] == f"{TABLE}: would compact 1 partition(s)"
        _age_everything(catalog.load_table(TABLE).location(), 10)
        lines = maintain(config, (), 0.0, 1, 0.0, compact=True)
    assert lines[0].startswith(f"{TABLE}: compacted 1 partition(s): 4 data file(s) into 1"), lines
    table = catalog.load_table(TABLE)
    head = table.current_snapshot()
    assert head is not None
    assert head.summary is not None
    assert head.summary.operation.value == "replace"
    assert len(list(table.scan().plan_files())) == 1
    assert_exactly_once(catalog, TABLE, [0, 1, 2, 3])
    # the compaction only un-referenced them, and the pipeline's last cycle, which the dedupe
    # rule reads, still names them; after the next cycle expiry and orphan removal delete them
    assert all(Path(_key(p)).exists() for p in originals)
    [meta] = write_rows(table, [4], "w2", 0)
    pending = PendingFile(meta, "w2", 0, "0", 9, str(table.metadata.table_uuid))
    IcebergCommitter(catalog, "pipe").commit(
        TableCommitRequest(TABLE, str(uuid.uuid4()), (pending,), {"0": 10}, {}, 1)
    )
    _age_everything(table.location(), 10)
    with serve_memory_server() as (_, address):
        maintain(pipe_config(catalog.name, props, address), (), 0.0, 1, 0.0)
    assert not any(Path(_key(p)).exists() for p in originals)
    assert_exactly_once(catalog, TABLE, [0, 1, 2, 3, 4])


def _nested_table(catalog: SqlCatalog, name: str, location: str, **properties: str) -> list[str]:
    """Another table created inside ``location`` (by any tool) holding ids 100-102; returns
    every file it has."""
    table = catalog.create_table(name, schema=ROWS_SCHEMA, location=location, properties=properties)
    table.append(rows_table([100, 101, 102]))
    files = [str(p) for p in Path(_key(location)).rglob("*") if p.is_file()]
    metadata = properties.get("write.metadata.path")
    if metadata is not None:
        files += [str(p) for p in Path(_key(metadata)).rglob("*") if p.is_file()]
    return sorted(files)


def test_orphan_removal_keeps_the_tables_inside_the_location(tmp_path: Path) -> None:
    """A table whose location lies inside another's (``<events>/dlq``) is, to the outer
    table, a tree of unreferenced files: orphan removal of the outer table deleted it whole,
    metadata included (``FileNotFoundError`` on its next read). It keeps a table it finds by
    its metadata files, and one the caller names whose metadata lies elsewhere; it still
    deletes the outer table's own orphan."""
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    outer = create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 1)
    location = outer.location()
    found = _nested_table(catalog, "db.dlq", f"{location}/dlq")
    named = _nested_table(
        catalog,
        "db.side",
        f"{location}/side",
        **{"write.metadata.path": f"file://{tmp_path}/side-metadata"},
    )
    [stray] = write_rows(catalog.load_table(TABLE), [999], "crashed-task", 0)
    _age_everything(location, 10 * 86_400)
    result = remove_orphan_files(
        catalog.load_table(TABLE),
        int(time.time() * 1000),
        other_tables=[catalog.load_table("db.side").location()],
    )
    assert result.deleted == (_key(stray.path),)
    inside = [f for f in [*found, *named] if f.startswith(_key(location))]
    assert sorted(result.kept_other_tables) == inside
    assert result.other_tables == (_key(f"{location}/dlq"), _key(f"{location}/side"))
    assert_exactly_once(catalog, "db.dlq", [100, 101, 102])
    assert_exactly_once(catalog, "db.side", [100, 101, 102])
    assert_exactly_once(catalog, TABLE, [0])


def test_maintain_keeps_a_dead_letter_table_inside_the_tables_location(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """``icefloe maintain`` (ages at zero) over a pipeline whose dead-letter table lies inside
    its table's location: the dead-letter table stays readable, and the line says why its
    files were kept."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    outer = create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 2)
    dlq = f"{outer.location()}/dead_letters"
    files = _nested_table(catalog, "db.dead_letters", dlq)
    with serve_memory_server() as (_, address):
        config = pipe_config(catalog.name, props, address)
        config = config.model_copy(
            update={
                "errors": config.errors.model_copy(
                    update={"policy": "dead_letter", "dead_letter_table": "db.dead_letters"}
                )
            }
        )
        lines = maintain(config, expire_older_than_s=0.0, orphans_older_than_s=0.0)
    assert f", {len(files)} of other tables inside its location ({_key(dlq)})" in lines[1], lines
    assert_exactly_once(catalog, "db.dead_letters", [100, 101, 102])
    assert_exactly_once(catalog, TABLE, [0, 1])


def test_maintain_keeps_another_tables_data_written_inside_the_location(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """A table elsewhere whose ``write.data.path`` lies inside this table's location keeps its
    data files there with no metadata folder beside them: ``icefloe maintain`` over both
    (ages at zero) deleted them as this table's orphans, and the other table lost its rows.
    They are kept and named; this table's own orphan still goes."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    outer = create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 2)
    shared = f"{outer.location()}/shared-data"
    elsewhere = catalog.create_table(
        "db.elsewhere",
        schema=ROWS_SCHEMA,
        location=f"file://{tmp_path}/elsewhere",
        properties={"write.data.path": shared},
    )
    elsewhere.append(rows_table([100, 101, 102]))
    data = sorted(str(p) for p in Path(_key(shared)).rglob("*.parquet"))
    assert data, "the other table wrote no data file inside the location"
    [stray] = write_rows(catalog.load_table(TABLE), [999], "crashed-task", 0)
    _age_everything(_key(outer.location()), 10 * 86_400)
    with serve_memory_server() as (_, address):
        config = pipe_config(catalog.name, props, address)
        lines = maintain(
            config, [TABLE, "db.elsewhere"], expire_older_than_s=0.0, orphans_older_than_s=0.0
        )
    assert f", {len(data)} of other tables inside its location ({_key(shared)})" in lines[1], lines
    assert sorted(str(p) for p in Path(_key(shared)).rglob("*.parquet")) == data
    assert not Path(_key(stray.path)).exists()
    assert_exactly_once(catalog, "db.elsewhere", [100, 101, 102])
    assert_exactly_once(catalog, TABLE, [0, 1])


def _data_files(catalog: SqlCatalog, name: str) -> set[str]:
    """The data files a table's current snapshot reads (pyiceberg's plan)."""
    return {_key(task.file.file_path) for task in catalog.load_table(name).scan().plan_files()}


def test_maintain_expires_the_quarantine_tables_fences_and_keeps_its_entries(
    tmp_path: Path, memory_plugins: Plugins
) -> None:
    """Every leader raises its fence with an empty snapshot of the quarantine table, and
    retiring entries rewrites its files: ``icefloe maintain`` left that table alone, so its
    metadata and files grew with every leader change for good. It is now expired and cleaned
    like the pipeline's tables (ages at zero): one snapshot left, the files a retire replaced
    deleted, the entries and the quarantined files they name kept, and the fence still
    refuses a deposed leader."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    table = create_rows_table(catalog, TABLE)
    commit_cycles(catalog, 1)
    quarantine = Quarantine(catalog)
    for token in range(1, 6):  # five leaders
        quarantine.fence("pipe", token)
    refused = [m.path for seq in (7, 8) for m in write_rows(table, [seq], "w9", seq)]
    entries = [quarantine_entry("pipe", TABLE, p) for p in refused]
    assert quarantine.add(entries, token=5) == entries
    added = _data_files(catalog, quarantine.identifier)
    assert quarantine.retire("pipe", TABLE, refused[:1], token=5) == 1
    current = _data_files(catalog, quarantine.identifier)
    before = len(catalog.load_table(quarantine.identifier).metadata.snapshots)
    assert before >= 7  # the five fences, the add, the retire's rewrite
    assert added - current  # the retire replaced the add's file
    with serve_memory_server() as (_, address):
        config = pipe_config(catalog.name, props, address)
        lines = maintain(config, expire_older_than_s=0.0, orphans_older_than_s=0.0)
        name = quarantine.identifier
        assert (
            f"{name}: expire {before - 1} snapshot(s); kept 0 old one(s) the dedupe rule reads"
            in lines
        )
        again = maintain(config, expire_older_than_s=0.0, orphans_older_than_s=0.0)
    assert len(catalog.load_table(name).metadata.snapshots) == 1
    assert not any(Path(p).exists() for p in added - current), lines
    assert all(Path(p).exists() for p in current)
    assert [line for line in again if line.startswith(f"{name}:")] == [
        f"{name}: expire 0 snapshot(s); kept 0 old one(s) the dedupe rule reads",
        f"{name}: delete 0 orphan file(s); kept 0 announced by uncommitted batches, 0 quarantined",
    ]
    assert [e.file_path for e in Quarantine(catalog).list("pipe", TABLE)] == refused[1:]
    assert all(Path(_key(p)).exists() for p in refused[1:])  # the pipeline table's run kept it
    with pytest.raises(StaleFencingTokenError):
        Quarantine(catalog).add([quarantine_entry("pipe", TABLE, "/x/late")], token=4)
    assert_exactly_once(catalog, TABLE, [0])
