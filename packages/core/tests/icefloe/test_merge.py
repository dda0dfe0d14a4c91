"""Merging a cycle's small files before the commit (``tables.merge_small_files``): the grouping
rule on its own, then real coordinators, a real SQLite catalog and real Parquet files in a
partitioned table, with crashes at the dangerous points and every row counted by a pyiceberg
scan."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform
from pyiceberg.types import StringType

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.merge import groups, merged_name
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ConfigError
from icefloe.events import DataFileMeta, FileContent, PartitionValue
from icefloe.ops.maintenance import remove_orphan_files
from icefloe.records import datafiles
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    data_file_ids,
    group_snapshots,
    rows_table,
    write_rows,
)
from icefloe.testing.harness import Pipe, RowSource, SimulatedCrash, crash, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

MERGED, PLAIN = "db.merged", "db.plain"
BUCKETS = PartitionSpec(PartitionField(1, 1000, BucketTransform(4), "id_bucket"))
POLICIES = TablePolicies(TablePolicy(), {MERGED: TablePolicy(merge_small_files=True)})


def meta(path: str, size: int, bucket: int = 0, spec_id: int = 0) -> DataFileMeta:
    part = (PartitionValue(1000, "id_bucket", bucket),)
    return DataFileMeta(path, 1, size, spec_id=spec_id, partition=part)


def test_groups_pack_small_files_per_partition_up_to_the_target() -> None:
    files = [
        meta("a", 40),
        meta("b", 40, bucket=1),
        meta("c", 40),
        meta("big", 100),  # at the target: kept
        meta("d", 40),  # a+c+d would pass the target: d starts a new group
        meta("e", 40, spec_id=1),  # another spec: alone, kept
        meta("f", 10, bucket=1),
    ]
    merged, kept = groups(files, 100)
    assert [[m.path for m in g] for g in merged] == [["a", "c"], ["b", "f"]]
    assert sorted(m.path for m in kept) == ["big", "d", "e"]
    key = DataFileMeta("k", 1, 1, content=FileContent.EQUALITY_DELETES)
    assert groups([key, meta("x", 1)], 100) == ([], [key, meta("x", 1)])


@pytest.fixture
def pipe(memory_server: MemoryServer, sqlite_catalog: SqlCatalog) -> Iterator[Pipe]:
    group_id = f"pipe-{uuid.uuid4().hex[:8]}"
    create_rows_table(sqlite_catalog, MERGED, BUCKETS)
    create_rows_table(sqlite_catalog, PLAIN, BUCKETS)
    source = RowSource(sqlite_catalog, [MERGED, PLAIN], rows_per_table=40)
    settings = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=30.0, policies=POLICIES
    )
    backend = MemoryBackend(memory_server, group_id, 1.0)
    p = Pipe.open(backend, sqlite_catalog, group_id, source, settings)
    yield p
    p.writer.close()


def data_files(table: Table) -> set[str]:
    """Every Parquet file under the table's data directory."""
    root = Path(table.location().removeprefix("file://")) / "data"
    return {f"file://{p}" for p in root.rglob("*.parquet")}


def committed_files(table: Table) -> set[str]:
    return {task.file.file_path for task in table.scan().plan_files()}


def publish(
    pipe: Pipe, coordinator_name: str, seqs: range, hooks: CoordinatorHooks | None = None
) -> Coordinator:
    """A new leader of ``pipe`` with the batches ``seqs`` published and read (not committed)."""
    coordinator = pipe.coordinator(coordinator_name, hooks)
    lead(coordinator)
    for seq in seqs:
        wait_pending(coordinator, pipe.source.publish(pipe.writer, seq).file_count)
    return coordinator


def test_a_cycle_commits_one_file_per_partition_instead_of_one_per_batch(pipe: Pipe) -> None:
    catalog = pipe.catalog
    coordinator = publish(pipe, "c1", range(4))
    try:
        originals = data_files(catalog.load_table(MERGED))
        result = coordinator.commit_now()
    finally:
        coordinator.close()
    assert not result.failed
    merged = next(r for r in result.tables if r.table == MERGED)
    plain = next(r for r in result.tables if r.table == PLAIN)
    # 4 batches of 40 ids over 4 buckets: a file per batch and bucket, merged to one per bucket
    assert merged.data_files == plain.data_files == 16
    assert (merged.added_files, plain.added_files) == (4, None)
    table = catalog.load_table(MERGED)
    (snapshot,) = group_snapshots(catalog, MERGED, pipe.group_id)
    assert snapshot.summary is not None
    assert snapshot.summary["added-data-files"] == "4"
    assert snapshot.summary["added-records"] == "160"
    assert "icefloe.writer-watermarks" in snapshot.summary.additional_properties
    assert_exactly_once(catalog, MERGED, pipe.source.expected[MERGED])
    assert_exactly_once(catalog, PLAIN, pipe.source.expected[PLAIN])
    # the originals are gone once the commit landed; only committed files remain
    assert data_files(table) == committed_files(table)
    assert not originals & data_files(table)


def test_crash_after_merged_files_are_written_before_the_commit(pipe: Pipe) -> None:
    """The leader merges (writes the merged files), passes its lease check and dies before
    the catalog commit. Its successor commits the same batches exactly once, under names of its
    own cycle; the dead cycle's merged files are orphans that ``icefloe maintain`` removes."""
    catalog = pipe.catalog
    committing: list[str] = []  # the table whose commit runs (the lease hook does not say)

    def crash_at_merged(_: str) -> None:
        if committing[-1] == MERGED:
            crash()

    hooks = CoordinatorHooks(
        before_table_commit=committing.append, after_lease_check=crash_at_merged
    )
    doomed = publish(pipe, "doomed", range(3), hooks)
    try:
        originals = data_files(catalog.load_table(MERGED))
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()
    finally:
        doomed.close()
    written = data_files(catalog.load_table(MERGED)) - originals
    assert len(written) == 4  # the merged files exist ...
    assert group_snapshots(catalog, MERGED, pipe.group_id) == []  # ... and nothing committed

    heir = publish(pipe, "heir", range(3, 4))
    try:
        assert not heir.commit_now().failed
    finally:
        heir.close()
    table = catalog.load_table(MERGED)
    assert_exactly_once(catalog, MERGED, pipe.source.expected[MERGED])
    assert_exactly_once(catalog, PLAIN, pipe.source.expected[PLAIN])
    assert not written & committed_files(table)  # the dead cycle's names were not committed
    assert data_files(table) - committed_files(table) == written  # they are orphans

    orphans = remove_orphan_files(table, int(time.time() * 1000) + 60_000)
    assert {f"file://{p}" for p in orphans.deleted} >= written
    assert_exactly_once(catalog, MERGED, pipe.source.expected[MERGED])


def test_crash_after_the_merged_commit_replays_nothing(pipe: Pipe) -> None:
    """The merged snapshot landed, then the leader died before storing the channel position:
    the successor re-reads the batches, whose originals are deleted by then; the dedupe rule
    (unchanged: the summary records the announced batches) skips them without reading them."""
    catalog = pipe.catalog
    doomed = publish(pipe, "doomed", range(2), CoordinatorHooks(after_iceberg_commits=crash))
    try:
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()
    finally:
        doomed.close()
    heir = publish(pipe, "heir", range(2, 3))
    try:
        result = heir.commit_now()
    finally:
        heir.close()
    assert not result.failed
    assert not result.quarantined
    assert len(group_snapshots(catalog, MERGED, pipe.group_id)) == 2
    assert_exactly_once(catalog, MERGED, pipe.source.expected[MERGED])


def test_a_merged_file_announced_again_is_held_then_quarantined_not_committed(
    pipe: Pipe,
) -> None:
    """The live-path rule (a file the branch references is never appended again) cannot see
    originals that were merged away. The summary lists them, so announced again right after
    (another writer id) they are held as committed; once deleted and dropped from the list by
    the next commit, they no longer exist, so screening quarantines them."""
    catalog = pipe.catalog
    first = pipe.source.publish(pipe.writer, 0)
    coordinator = publish(pipe, "c1", range(1, 2))  # two batches: a file each per bucket
    clients: list[WriterClient] = []
    try:
        assert not coordinator.commit_now().failed
        results = []
        for writer_id in ("w2", "w3"):  # the same files announced again by other writer ids
            again = WriterClient(pipe.backend.writer(writer_id), pipe.group_id, writer_id)
            again.start()
            clients.append(again)
            again.publish(0, {MERGED: first.files[MERGED]}, first.positions)
            wait_pending(coordinator, len(first.files[MERGED]))
            results.append(coordinator.commit_now())
            # a commit that drops the deleted originals from the list
            wait_pending(coordinator, pipe.source.publish(pipe.writer, len(results) + 1).file_count)
            assert not coordinator.commit_now().failed
    finally:
        for client in clients:
            client.close()
        coordinator.close()
    assert [r.quarantined for r in results] == [{}, {MERGED: len(first.files[MERGED])}]
    assert_exactly_once(catalog, MERGED, pipe.source.expected[MERGED])
    entries = Quarantine(catalog, pipe.settings.quarantine_table).list(pipe.group_id)
    assert {e.error_type for e in entries} == {"DataFileMissingError"}


def test_a_commit_retried_after_a_conflict_writes_its_merged_files_once(
    sqlite_catalog: SqlCatalog,
) -> None:
    """A foreign commit lands between the merge and the catalog commit: the retry merges the
    same groups under the same names (derived from the commit id and the sources), so no
    second copy is left beside the committed one."""
    table = create_rows_table(sqlite_catalog, MERGED, BUCKETS)
    files = [
        PendingFile(m, "w", seq, "0", seq)
        for seq in range(3)
        for m in write_rows(table, range(seq * 40, seq * 40 + 40), "w", seq, group_id="pipe")
    ]
    conflicts: list[int] = []

    def foreign_commit_once() -> None:
        if not conflicts:
            conflicts.append(1)
            sqlite_catalog.load_table(MERGED).append(rows_table([1000]))

    committer = IcebergCommitter(
        sqlite_catalog,
        "pipe",
        before_commit=foreign_commit_once,
        retry_wait_s=0.001,
        policies=POLICIES,
    )
    request = TableCommitRequest(MERGED, "commit-1", tuple(files), {"0": 3}, {}, fencing_token=1)
    result = committer.commit(request)
    assert conflicts
    assert (result.data_files, result.added_files) == (len(files), 4)
    table = sqlite_catalog.load_table(MERGED)
    assert data_files(table) == committed_files(table)  # 4 merged + the foreign one
    assert_exactly_once(sqlite_catalog, MERGED, [*range(120), 1000])


def test_originals_a_deposed_leaders_merged_commit_deletes_during_the_heirs_screening_are_held(
    sqlite_catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deposed leader's committer commits merged files and deletes their originals right
    after the heir's screening loaded the table: on that older version the originals are
    neither committed nor there, yet they are no missing files (quarantined, a recovery would
    add their rows twice): the version loaded after they were seen missing holds them."""
    table = create_rows_table(sqlite_catalog, MERGED, BUCKETS)
    files = tuple(
        PendingFile(m, "w", seq, "0", seq)
        for seq in range(2)
        for m in write_rows(table, range(seq * 40, seq * 40 + 40), "w", seq, group_id="pipe")
    )
    request = TableCommitRequest(MERGED, "commit-1", files, {"0": 2}, {}, fencing_token=1)
    deposed = IcebergCommitter(sqlite_catalog, "pipe", policies=POLICIES)
    heir = IcebergCommitter(sqlite_catalog, "pipe", policies=POLICIES)
    load = heir._load
    landed: list[int | None] = []

    def loaded_then_landed(name: str, after_screen: bool = False) -> Table:
        loaded = load(name, after_screen)
        if not landed:  # the heir's screening loaded the table: now the merged commit lands
            landed.append(deposed.commit(request).added_files)
        return loaded

    monkeypatch.setattr(heir, "_load", loaded_then_landed)
    screened = heir.screen(MERGED, files)

    assert landed == [4]
    assert not any(Path(f.meta.path.removeprefix("file://")).exists() for f in files)
    assert screened.refused == ()
    assert screened.accepted == files  # held as committed: the commit drops them
    again = TableCommitRequest(MERGED, "commit-2", files, {"0": 2}, {}, fencing_token=2)
    assert heir.commit(again).snapshot_id is None
    assert_exactly_once(sqlite_catalog, MERGED, list(range(80)))


def test_overlapping_runs_of_one_commit_never_overwrite_the_merged_file_that_landed(
    sqlite_catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two attempts of one Spark commit task (a speculative copy, or a zombie beside its retry)
    run the same request at once. B read the originals and is writing its last merged file
    when the schema evolves and A merges, lands and deletes the originals. B must not write over
    the files A's snapshot names: after a schema change its bytes differ from what A's
    manifest records (and killed mid-write it would leave them truncated). B's own files are
    orphans that ``icefloe maintain`` removes."""
    table = create_rows_table(sqlite_catalog, MERGED, BUCKETS)
    files = [
        PendingFile(m, "w", seq, "0", seq)
        for seq in range(3)
        for m in write_rows(table, range(seq * 40, seq * 40 + 40), "w", seq, group_id="pipe")
    ]
    request = TableCommitRequest(MERGED, "commit-1", tuple(files), {"0": 3}, {}, fencing_token=1)
    a = IcebergCommitter(sqlite_catalog, "pipe", retry_wait_s=0.001, policies=POLICIES)
    b = IcebergCommitter(sqlite_catalog, "pipe", retry_wait_s=0.001, policies=POLICIES)
    landed: dict[str, tuple[int, bytes]] = {}  # A's committed files: manifest size, bytes
    real_write = datafiles.write_data_files
    b_writes = 0

    def a_lands_while_b_merges(*args: Any, **kwargs: Any) -> Any:
        nonlocal b_writes
        b_writes += 1  # B's four (a group per bucket), then A's, which run in B's fourth
        if b_writes == 4:  # B's last: it has read every original
            with sqlite_catalog.load_table(MERGED).update_schema() as update:
                update.add_column("note", StringType())
            assert a.commit(request, "spark-task-0").snapshot_id is not None
            for task in sqlite_catalog.load_table(MERGED).scan().plan_files():
                path = task.file.file_path
                landed[path] = (task.file.file_size_in_bytes, local(path).read_bytes())
        return real_write(*args, **kwargs)

    monkeypatch.setattr("icefloe.commit.merge.write_data_files", a_lands_while_b_merges)
    originals = {f.meta.path for f in files}
    assert b.commit(request, "spark-task-1").snapshot_id is None  # A's commit holds them
    monkeypatch.undo()

    assert len(landed) == 4
    assert not originals & landed.keys()  # A merged them and deleted them
    for path, (size, content) in landed.items():
        assert local(path).stat().st_size == size, f"{path} rewritten after it was committed"
        assert local(path).read_bytes() == content
    table = sqlite_catalog.load_table(MERGED)
    assert committed_files(table) == landed.keys()
    assert data_file_ids(table) == list(range(120))  # pyarrow over the committed files
    assert_exactly_once(sqlite_catalog, MERGED, range(120))  # a pyiceberg scan
    orphans = data_files(table) - committed_files(table)
    assert len(orphans) == 4  # B's merged files, under names of its own
    removed = remove_orphan_files(table, int(time.time() * 1000) + 60_000)
    assert {f"file://{p}" for p in removed.deleted} == orphans
    assert data_file_ids(sqlite_catalog.load_table(MERGED)) == list(range(120))


def test_merged_names_keep_the_only_run_and_tell_attempts_apart() -> None:
    group = [meta("s3://w/a.parquet", 1), meta("s3://w/b.parquet", 1)]
    names = {merged_name("c", group, attempt) for attempt in ("", "spark-task-0", "spark-task-1")}
    assert len(names) == 3
    # the only run of a commit keeps the names merged files always had
    assert str(merged_name("c", group)) == "83e7fad9-4964-5a4f-9620-83148cbbc110"


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


@pytest.mark.parametrize("section", ["tables", "dynamic_tables"])
def test_keyed_tables_cannot_merge_and_the_error_names_the_key(section: str) -> None:
    table = {"mode": "cdc", "id_columns": ["id"], "merge_small_files": True}
    data: dict[str, Any] = {"name": "p", "source": {"topics": ["t"]}}
    if section == "tables":
        data["tables"] = [{"name": "a.b", **table}]
        key = "tables.0.merge_small_files"
    else:
        data["dynamic_tables"] = {"route_field": "kind", **table}
        key = "dynamic_tables.merge_small_files"
    with pytest.raises(ConfigError, match=re.escape(key)) as caught:
        config_from_dict(data)
    assert "set merge_small_files = false" in str(caught.value)
