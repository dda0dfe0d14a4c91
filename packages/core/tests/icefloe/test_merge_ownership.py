"""``merge_small_files`` deletes only what the pipeline provably owns, and a merged original is
as committed as any file (issue 23, defects 1 and 6).

Real coordinators and writer clients over the in-memory channel, a real SQLite catalog and real
Parquet files. A DataWritten under a new writer id (forged, or a writer that lost its identity)
names files the pipeline does not own: live on another branch, kept only by an older snapshot,
a position-delete file announced as data. Rows are counted with pyarrow over the files each
snapshot references (position deletes applied), not with the committer's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import PyArrowFileIO, schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import MERGED_KEY, decode_merged
from icefloe.commit.ownership import Ownership
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.coordination.coordinator import Coordinator
from icefloe.coordination.settings import CoordinatorSettings, CycleResult
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataFileMeta, FileContent, SourcePosition
from icefloe.ops.maintenance import referenced_files
from icefloe.records.datafiles import (
    DataFileBuilder,
    group_write_uuid,
    to_meta,
    write_data_files,
    write_key_files,
    written_for,
)
from icefloe.testing.fixtures import create_rows_table, rows_table
from icefloe.testing.harness import Batch, Pipe, RowSource, SimulatedCrash, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

T = "db.t"
MERGE_ON_MAIN = TablePolicies(TablePolicy(), {T: TablePolicy(merge_small_files=True)})
MERGE_ON_AUDIT = TablePolicies(
    TablePolicy(), {T: TablePolicy(branch="audit", merge_small_files=True)}
)


def local(path: str) -> str:
    return path.removeprefix("file://")


def snapshot_ids(table: Table, snapshot_id: int) -> list[int]:
    """Every ``id`` the snapshot holds, read with pyarrow from the Parquet files it references,
    its position deletes applied (FileNotFoundError if one of them was deleted)."""
    ids: list[int] = []
    for task in table.scan(row_filter=AlwaysTrue(), snapshot_id=snapshot_id).plan_files():
        data = pq.read_table(local(task.file.file_path))
        dead: set[int] = set()
        for delete in task.delete_files:
            deletes = pq.read_table(local(delete.file_path))
            mine = pc.equal(deletes["file_path"], task.file.file_path)
            dead |= set(deletes.filter(mine)["pos"].to_pylist())
        ids += [v for pos, v in enumerate(data["id"].to_pylist()) if pos not in dead]
    return sorted(ids)


def branch_ids(catalog: SqlCatalog, branch: str) -> list[int]:
    table = catalog.load_table(T)
    head = table.snapshot_by_name(branch)
    assert head is not None, f"no branch {branch}"
    return snapshot_ids(table, head.snapshot_id)


def assert_once(got: Sequence[int], expected: Sequence[int]) -> None:
    counts = Counter(got)
    assert sorted(counts) == sorted(set(expected)), f"{sorted(counts)} != {sorted(expected)}"
    dupes = {i: n for i, n in counts.items() if n > 1}
    assert not dupes, f"ids committed more than once: {dupes}"


def live_metas(table: Table) -> list[DataFileMeta]:
    """The metadata of the data files live in the table's current snapshot, as a writer would
    announce them."""
    return [to_meta(task.file, table.metadata) for task in table.scan().plan_files()]


@dataclasses.dataclass
class Scene:
    """One pipeline on table ``T``: its channel, writer ``w`` and the rows it published."""

    pipe: Pipe
    coordinator: Coordinator
    others: list[WriterClient] = dataclasses.field(default_factory=list)

    @property
    def catalog(self) -> SqlCatalog:
        catalog = self.pipe.catalog
        assert isinstance(catalog, SqlCatalog)
        return catalog

    def publish(self, seq: int) -> Batch:
        before = self.pending()
        batch = self.pipe.source.publish(self.pipe.writer, seq)
        wait_pending(self.coordinator, before + batch.file_count)
        return batch

    def pending(self) -> int:
        return sum(self.coordinator.pending_files().values())

    def announce(self, writer_id: str, files: Sequence[DataFileMeta], seq: int = 0) -> None:
        """``files`` announced by another writer id (forged, or a writer that lost its id);
        the writer stays open, so cycles do not wait for its answer."""
        client = WriterClient(self.pipe.backend.writer(writer_id), self.pipe.group_id, writer_id)
        client.start()
        self.others.append(client)
        before = self.pending()
        client.publish(seq, {T: list(files)}, [SourcePosition("source", 99, seq + 1)])
        wait_pending(self.coordinator, before + len(files))

    def commit(self) -> CycleResult:
        result = self.coordinator.commit_now()
        assert not result.failed, result.failed
        return result

    def expected(self) -> list[int]:
        return self.pipe.source.expected[T]

    def new_coordinator(self, name: str) -> None:
        self.coordinator.close()
        self.coordinator = self.pipe.coordinator(name)
        lead(self.coordinator)


@contextlib.contextmanager
def open_scene(
    server: MemoryServer, catalog: SqlCatalog, policies: TablePolicies
) -> Iterator[Scene]:
    group_id = f"pipe-{uuid.uuid4().hex[:8]}"
    if not catalog.table_exists(T):
        create_rows_table(catalog, T)
    settings = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=30.0, policies=policies
    )
    source = RowSource(catalog, [T], rows_per_table=10)
    pipe = Pipe.open(MemoryBackend(server, group_id, 1.0), catalog, group_id, source, settings)
    coordinator = pipe.coordinator("c1")
    scene = Scene(pipe, coordinator)
    try:
        lead(coordinator)
        yield scene
    finally:
        scene.coordinator.close()
        for client in [pipe.writer, *scene.others]:
            client.close()


@pytest.fixture
def on_main(memory_server: MemoryServer, sqlite_catalog: SqlCatalog) -> Iterator[Scene]:
    with open_scene(memory_server, sqlite_catalog, MERGE_ON_MAIN) as scene:
        yield scene


@pytest.fixture
def on_audit(memory_server: MemoryServer, sqlite_catalog: SqlCatalog) -> Iterator[Scene]:
    with open_scene(memory_server, sqlite_catalog, MERGE_ON_AUDIT) as scene:
        yield scene


def test_only_data_files_named_for_the_group_under_the_data_location_are_owned(
    sqlite_catalog: SqlCatalog,
) -> None:
    """The ownership rule's conditions on one file each, against a real table: named for this
    group (not another's, not untagged), data content (not a key file), under the data
    location (not the metadata directory), named by no snapshot."""
    table = create_rows_table(sqlite_catalog, T)
    rows = rows_table([1])
    mine = write_data_files(table, rows, group_write_uuid("g"))
    theirs = write_data_files(table, rows, group_write_uuid("other"))
    untagged = write_data_files(table, rows)
    key = dataclasses.replace(mine[0], content=FileContent.EQUALITY_DELETES)
    metadata_dir = Path(local(table.location())) / "metadata"
    stray = metadata_dir / f"00000-0-{group_write_uuid('g')}.parquet"
    stray.write_bytes(Path(local(mine[0].path)).read_bytes())
    misplaced = dataclasses.replace(mine[0], path=f"file://{stray}")
    escaping = dataclasses.replace(
        mine[0], path=f"{table.location()}/data/../metadata/{stray.name}"
    )
    committed = write_data_files(table, rows, group_write_uuid("g"))
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(DataFileBuilder(table.metadata).build(committed[0]))
    table = sqlite_catalog.load_table(T)

    files = [*mine, *theirs, *untagged, key, misplaced, escaping, *committed]
    ownership = Ownership("g")
    assert ownership.mergeable(table, files) == {mine[0].path}
    # paths only: the content was proven when the file was merged
    assert ownership.deletable(table, [f.path for f in files]) == {mine[0].path}
    assert written_for(mine[0].path, "g")
    assert not written_for(mine[0].path, "other")
    assert group_write_uuid("g").version == 8


# --- defect 1: never delete what the pipeline does not own -------------------------------


def test_a_file_live_on_main_is_not_deleted_by_a_pipeline_that_commits_to_audit(
    on_audit: Scene,
) -> None:
    """(a) The pipeline commits to branch ``audit``; another engine appends to ``main``. A
    DataWritten naming main's file is committed to audit as announced, but never merged away:
    main keeps its file and stays readable."""
    scene = on_audit
    scene.publish(0)
    scene.commit()  # creates the audit branch
    table = scene.catalog.load_table(T)
    table.append(rows_table(range(1000, 1010), "engine"))
    (foreign,) = live_metas(scene.catalog.load_table(T))
    scene.publish(1)  # a small file of the pipeline, in the same partition: a merge group
    scene.announce("w2", [foreign])
    scene.commit()

    assert Path(local(foreign.path)).exists()
    assert branch_ids(scene.catalog, "main") == list(range(1000, 1010))
    assert_once(branch_ids(scene.catalog, "audit"), [*scene.expected(), *range(1000, 1010)])


def test_a_file_kept_only_by_an_older_snapshot_is_not_deleted(on_main: Scene) -> None:
    """(b) Another engine appended a file and deleted its rows again: only the older snapshot
    references it (time travel). Announced by a forged DataWritten, it is not deleted: the
    older snapshot stays readable. Nor is it committed: the delete snapshot in main's history
    took it off, and committing it would bring back the rows deleted."""
    scene = on_main
    scene.publish(0)
    scene.commit()
    ours = {m.path for m in live_metas(scene.catalog.load_table(T))}
    scene.catalog.load_table(T).append(rows_table(range(1000, 1010), "engine"))
    table = scene.catalog.load_table(T)
    old = table.current_snapshot()
    assert old is not None
    (foreign,) = [m for m in live_metas(table) if m.path not in ours]
    table.delete("writer == 'engine'")
    scene.publish(1)
    scene.announce("w2", [foreign])
    scene.commit()

    assert Path(local(foreign.path)).exists()
    table = scene.catalog.load_table(T)
    assert snapshot_ids(table, old.snapshot_id) == [*scene.expected()[:10], *range(1000, 1010)]
    assert_once(branch_ids(scene.catalog, "main"), scene.expected())


def test_a_pipeline_file_kept_only_by_a_tag_is_not_deleted(on_main: Scene) -> None:
    """The pipeline's own file (named for it) was committed; another engine deleted its rows
    from main and expired every snapshot but the one tag ``v1`` keeps. Announced again, the
    file is not the pipeline's to delete any more (a ref names it): it is not merged away,
    ``v1`` stays readable. Nor is it committed again: it was committed once, and its rows stay
    deleted (the delete snapshot, main's head, took it off)."""
    scene = on_main
    (own,) = scene.publish(0).files[T]
    scene.commit()  # a group of one file: committed as it is
    table = scene.catalog.load_table(T)
    tagged = table.current_snapshot()
    assert tagged is not None
    table.manage_snapshots().create_tag(tagged.snapshot_id, "v1").commit()
    scene.catalog.load_table(T).delete("batch_seq == 0")
    table = scene.catalog.load_table(T)
    head = table.current_snapshot()
    assert head is not None
    old = [s.snapshot_id for s in table.snapshots() if s.snapshot_id != tagged.snapshot_id]
    table.maintenance.expire_snapshots().by_ids([i for i in old if i != head.snapshot_id]).commit()
    scene.publish(1)
    scene.announce("w2", [own])
    scene.commit()

    assert Path(local(own.path)).exists()
    table = scene.catalog.load_table(T)
    assert snapshot_ids(table, tagged.snapshot_id) == scene.expected()[:10]
    assert_once(branch_ids(scene.catalog, "main"), scene.expected()[10:])


KEYED = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "writer", StringType(), required=False),
    NestedField(3, "batch_seq", LongType(), required=False),
    identifier_field_ids=[1],
)


def keyed(ids: Sequence[int]) -> pa.Table:
    return pa.Table.from_pylist(
        [{"id": i, "writer": "o", "batch_seq": 0} for i in ids], schema_to_pyarrow(KEYED)
    )


def test_a_position_delete_file_announced_as_data_is_quarantined_not_merged(
    memory_server: MemoryServer, sqlite_catalog: SqlCatalog
) -> None:
    """(c) Main holds a position-delete file (another pipeline upserted). Announced as data, it
    must neither be merged as data (its rows are not rows of the table) nor deleted (main
    would be unreadable): it is quarantined, the pipeline's own file is committed."""
    sqlite_catalog.create_namespace("db")
    table = sqlite_catalog.create_table(T, schema=KEYED)
    # another pipeline: ids 1001-1003, then an upsert of 1001 (a key file -> a position delete)
    other = IcebergCommitter(sqlite_catalog, "other")
    files = [
        PendingFile(m, "o", 0, "0", 0) for m in write_data_files(table, keyed([1001, 1002, 1003]))
    ]
    other.commit(TableCommitRequest(T, "o-1", tuple(files), {"0": 1}, {}, fencing_token=1))
    table = sqlite_catalog.load_table(T)
    upsert = write_data_files(table, keyed([1001]))
    keys = write_key_files(table, pa.table({"id": pa.array([1001], pa.int64())}))
    files = [PendingFile(m, "o", 1, "0", 1) for m in [*upsert, *keys]]
    other.commit(TableCommitRequest(T, "o-2", tuple(files), {"0": 2}, {}, fencing_token=1))
    with sqlite_catalog.load_table(T).update_schema() as update:  # the keys' time is over
        update.set_identifier_fields()
        update.make_column_optional("id")
    table = sqlite_catalog.load_table(T)
    (delete,) = {d.file_path: d for t in table.scan().plan_files() for d in t.delete_files}.values()
    forged = dataclasses.replace(to_meta(delete, table.metadata), content=FileContent.DATA)
    head = table.current_snapshot()
    assert head is not None
    assert snapshot_ids(table, head.snapshot_id) == [1001, 1002, 1003]

    with open_scene(memory_server, sqlite_catalog, MERGE_ON_MAIN) as scene:
        scene.publish(0)
        scene.announce("w2", [forged])
        result = scene.commit()
        assert result.quarantined == {T: 1}
        entries = Quarantine(sqlite_catalog, scene.pipe.settings.quarantine_table).list(
            scene.pipe.group_id
        )
        assert [(e.file_path, e.error_type) for e in entries] == [
            (forged.path, "NotADataFileError")
        ]
        assert Path(local(delete.file_path)).exists()
        assert_once(branch_ids(sqlite_catalog, "main"), [1001, 1002, 1003, *scene.expected()])


# --- defect 6: a merged original is committed once ---------------------------------------


@pytest.mark.parametrize("fault", ["delete fails", "crash before delete"])
def test_a_merged_original_announced_again_is_not_committed_twice(
    on_main: Scene, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged commit landed but its originals were not deleted (the delete failed, which
    is tolerated, or the coordinator died first). The same originals announced again under
    another writer id are already committed: each id stays in the table exactly once. The
    next commit that lands deletes the originals after all."""
    scene = on_main
    originals = scene.publish(0).files[T]  # announced again below
    scene.publish(1)
    committed = list(scene.expected())

    def refuse(self: PyArrowFileIO, location: object) -> None:
        if fault == "crash before delete":
            raise SimulatedCrash
        raise PermissionError(f"simulated: cannot delete {location}")

    with monkeypatch.context() as patch:
        patch.setattr(PyArrowFileIO, "delete", refuse)
        if fault == "crash before delete":
            with pytest.raises(SimulatedCrash):
                scene.coordinator.commit_now()
            scene.new_coordinator("heir")
        else:
            assert scene.commit().tables[0].added_files == 1
    assert all(Path(local(m.path)).exists() for m in originals)
    assert_once(branch_ids(scene.catalog, "main"), committed)
    # the summary lists them in a side file, which `icefloe maintain` keeps
    table = scene.catalog.load_table(T)
    head = table.current_snapshot()
    assert head is not None
    assert head.summary is not None
    listed = head.summary[MERGED_KEY]
    assert listed is not None
    assert decode_merged(Path(local(listed)).read_bytes()) >= {m.path for m in originals}
    assert local(listed) in referenced_files(table)

    scene.announce("w2", originals)
    scene.publish(2)
    result = scene.commit()
    assert_once(branch_ids(scene.catalog, "main"), scene.expected())
    assert result.quarantined == {}
    assert result.tables[0].skipped_files == len(originals)
    assert not any(Path(local(m.path)).exists() for m in originals)
