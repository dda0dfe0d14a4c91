"""A keyed (upsert/CDC) writer batch is committed or quarantined whole, never by halves: its
key file deletes the rows its data files replace, so committing one half without the other
loses a key (keys applied, new images refused) or duplicates it (images kept, keys refused).

Real coordinator, committer and writer client over the reference channel, a real SQLite
catalog and real Parquet files; the tables are read back by pyiceberg's scan (position
deletes applied), not by the committer's code."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.screening import Screening
from icefloe.commit.summary import fencing_token_property
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings, CycleResult
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataFileMeta, FileContent, SourcePosition
from icefloe.plugins.manager import new_plugins
from icefloe.records.datafiles import group_write_uuid, write_data_files, write_key_files
from icefloe.testing.harness import lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

NAME = "db.customers"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "region", StringType(), required=True),
    NestedField(3, "name", StringType(), required=False),
    identifier_field_ids=[1],
)
Row = tuple[int, str, str]


class KeyedPipe:
    """One pipeline with a keyed table: writers publish batches as write tasks do (data files
    with the final row images, a key file with every key touched), one coordinator commits."""

    def __init__(self, server: MemoryServer, catalog: SqlCatalog) -> None:
        self.group_id = f"pipe-{uuid.uuid4().hex[:8]}"
        self.backend = MemoryBackend(server, self.group_id, 1.0)
        self.catalog = catalog
        catalog.create_namespace("db")
        catalog.create_table(NAME, schema=SCHEMA)
        self.writers: dict[str, WriterClient] = {}
        self.offsets: dict[str, int] = {}
        self.coordinator = Coordinator(
            self.group_id,
            self.backend.coordinator("c1"),
            catalog,
            CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=30.0),
            coordinator_id="c1",
            plugins=new_plugins(autoload=False),
        )
        lead(self.coordinator)

    def table(self) -> Table:
        return self.catalog.load_table(NAME)

    def write(
        self, upserts: list[Row], deletes: tuple[Row, ...] = (), owned: bool = False
    ) -> list[DataFileMeta]:
        """A batch's files, written against the table as it is now (not published): the
        rows of ``upserts``, and a key file with the identifier columns of all changes.
        ``owned``: named for the pipeline, as write tasks name them (so a commit that applied
        the key file deletes it)."""
        table = self.table()

        def named() -> uuid.UUID | None:
            return group_write_uuid(self.group_id) if owned else None

        schema = table.schema()
        arrow = schema_to_pyarrow(schema, include_field_ids=False)
        metas: list[DataFileMeta] = []
        if upserts:
            images = pa.Table.from_pylist([_row(r) for r in upserts], arrow)
            metas += write_data_files(table, images, named())
        changes = pa.Table.from_pylist([_row(r) for r in [*upserts, *deletes]], arrow)
        keys = sorted(schema.identifier_field_names(), key=schema.column_names.index)
        metas += write_key_files(table, changes.select(keys), named())
        return metas

    def publish(self, writer_id: str, seq: int, files: list[DataFileMeta]) -> None:
        writer = self.writers.get(writer_id)
        if writer is None:
            writer = WriterClient(self.backend.writer(writer_id), self.group_id, writer_id)
            writer.start()
            self.writers[writer_id] = writer
        offset = self.offsets[writer_id] = self.offsets.get(writer_id, 0) + 1
        part = sorted(self.writers).index(writer_id)
        uid = str(self.table().metadata.table_uuid)
        writer.publish(seq, {NAME: files}, [SourcePosition("cdc", part, offset, 0)], {NAME: uid})

    def commit(self, files: int) -> CycleResult:
        """Wait for ``files`` pending files, run one cycle; its result."""
        wait_pending(self.coordinator, files)
        return self.coordinator.commit_now()

    def rows(self) -> list[Row]:
        """The table as pyiceberg's scan reads it, position deletes applied."""
        scanned = self.table().scan().to_arrow().to_pylist()
        return sorted((r["id"], r["region"], r["name"]) for r in scanned)

    def quarantined(self) -> dict[str, str]:
        """Quarantined path -> error type, of this pipeline's keyed table."""
        entries = Quarantine(self.catalog).list(self.group_id, NAME)
        return {e.file_path: e.error_type for e in entries}

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.coordinator.close()


def _row(r: Row) -> dict[str, Any]:
    return {"id": r[0], "region": r[1], "name": r[2]}


@pytest.fixture
def pipe(memory_server: MemoryServer, sqlite_catalog: SqlCatalog) -> Iterator[KeyedPipe]:
    p = KeyedPipe(memory_server, sqlite_catalog)
    yield p
    p.close()


def _seed(pipe: KeyedPipe) -> list[Row]:
    rows = [(1, "eu", "v0"), (2, "eu", "v0"), (3, "us", "v0")]
    files = pipe.write(rows)
    pipe.publish("w1", 0, files)
    result = pipe.commit(len(files))
    assert result.failed == {}
    assert result.quarantined == {}
    assert pipe.rows() == rows
    return rows


def _bucket_by_id(table: Table) -> None:
    # re-partitioning by bucket(id), as docs/upsert.md recommends for keyed tables
    with table.update_spec() as spec:
        spec.add_field("id", BucketTransform(4), "id_bucket")


def _key_columns_id_and_region(table: Table) -> None:
    with table.update_schema() as update:
        update.set_identifier_fields("id", "region")


@pytest.mark.parametrize(
    ("change", "refused_half", "refusal"),
    [
        # the new row images are refused (old spec) while the key file would delete the old
        # rows: the keys would vanish
        (_bucket_by_id, FileContent.DATA, "PartitionSpecChangedError"),
        # the key file is refused (not the table's identifier fields any more) while the new
        # images would be appended next to the old rows: the keys would be duplicated
        (_key_columns_id_and_region, FileContent.EQUALITY_DELETES, "RowDeltaTableError"),
    ],
    ids=["images-refused", "keys-refused"],
)
def test_a_keyed_batch_is_quarantined_whole_when_one_of_its_files_is_refused(
    pipe: KeyedPipe,
    change: Callable[[Table], None],
    refused_half: FileContent,
    refusal: str,
) -> None:
    seeded = _seed(pipe)
    in_flight = pipe.write([(1, "eu", "v1"), (4, "us", "new")], deletes=((3, "us", ""),))
    change(pipe.table())  # another engine changes the table while the batch is in flight
    pipe.publish("w1", 1, in_flight)
    # a batch of another writer in the same cycle, written after the change: unaffected
    after = pipe.write([(2, "eu", "v2")])
    pipe.publish("w2", 0, after)

    result = pipe.commit(len(in_flight) + len(after))

    # key 1 neither vanished nor doubled, key 3 is not deleted, key 4 not inserted
    assert pipe.rows() == [seeded[0], (2, "eu", "v2"), seeded[2]]
    assert result.failed == {}
    assert result.quarantined == {NAME: len(in_flight)}
    expected = {
        f.path: refusal if f.content == refused_half else "KeyedBatchRefusedError"
        for f in in_flight
    }
    assert pipe.quarantined() == expected
    assert pipe.coordinator.pending_files() == {}


def test_a_keyed_batch_a_deposed_committer_lands_during_the_heirs_screening_is_not_quarantined(
    pipe: KeyedPipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deposed leader's committer (a process or Spark task that outlives its leader) commits
    a keyed batch and deletes its applied key file, right after the heir's screening loaded the
    table. On that older version the batch is not committed and its key file is missing: only
    a version loaded after the file was seen missing may refuse it, and that one holds the
    batch as committed. Quarantined, its rows would be in the table and in quarantine."""
    seeded = _seed(pipe)
    batch = pipe.write([(1, "eu", "v1")], owned=True)
    pipe.publish("w1", 1, batch)
    wait_pending(pipe.coordinator, len(batch))
    heir = pipe.coordinator._cycle._committer
    deposed = IcebergCommitter(pipe.catalog, pipe.group_id)
    token = int(pipe.table().metadata.properties[fencing_token_property(pipe.group_id)])
    screen, load = heir.screen, heir._load
    landed: list[int | None] = []
    screened: list[tuple[tuple[PendingFile, ...], str | None]] = []

    def screening(
        table: str, files: Iterable[PendingFile], channel_id: str | None = None
    ) -> Screening:
        screened.append((tuple(files), channel_id))
        return screen(table, screened[-1][0], channel_id)

    def loaded_then_landed(name: str, after_screen: bool = False) -> Table:
        loaded = load(name, after_screen)
        if screened and not landed:  # the heir's screening loaded the table: now it lands
            files, channel = screened[0]
            positions = {f.partition: f.offset + 1 for f in files}
            request = TableCommitRequest(NAME, "old", files, positions, {}, token, None, channel)
            landed.append(deposed.commit(request).snapshot_id)
        return loaded

    monkeypatch.setattr(heir, "screen", screening)
    monkeypatch.setattr(heir, "_load", loaded_then_landed)

    result = pipe.commit(0)

    assert len(landed) == 1
    assert landed[0] is not None
    key = next(m.path for m in batch if m.content == FileContent.EQUALITY_DELETES)
    assert not pipe.table().io.new_input(key).exists()  # applied, then deleted
    assert result.failed == {}
    assert result.quarantined == {}
    assert pipe.quarantined() == {}
    assert pipe.rows() == [(1, "eu", "v1"), *seeded[1:]]  # the new image once, the old gone
    assert pipe.coordinator.pending_files() == {}
