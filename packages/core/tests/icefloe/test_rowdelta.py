"""Row deltas for upsert/CDC tables against a real SqlCatalog (SQLite) with real Parquet files.

Key files are written here as writers will (Parquet holding only the identifier columns, with
the table's field ids); results are read back with pyiceberg's own scan, which applies the
position deletes the committer wrote, and the delete files are checked with pyarrow.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import DataFileContent, ManifestContent
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit import rowdelta
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import APPLIED_KEY, decode_applied
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.request import PendingFile, TableCommitRequest, TableCommitResult
from icefloe.commit.summary import COMMIT_ID_KEY, RowCounts
from icefloe.config import config_from_dict
from icefloe.errors import (
    DataFileMissingError,
    KeyedBatchRefusedError,
    RowDeltaNotSupportedError,
    RowDeltaTableError,
)
from icefloe.events import DataFileMeta, FileContent
from icefloe.ops.maintenance import remove_orphan_files
from icefloe.ops.status import PipelineStatus, render_lines, table_status
from icefloe.records.datafiles import (
    DataFileBuilder,
    group_write_uuid,
    write_data_files,
    write_key_files,
)

GROUP = "pipe-a"
NAME = "db.users"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "name", StringType(), required=False),
    identifier_field_ids=[1],
)
REGIONAL = Schema(
    NestedField(1, "region", StringType(), required=True),
    NestedField(2, "id", LongType(), required=True),
    NestedField(3, "name", StringType(), required=False),
    identifier_field_ids=[1, 2],
)
BY_REGION = PartitionSpec(PartitionField(1, 1000, IdentityTransform(), "region"))


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[SqlCatalog]:
    cat = SqlCatalog(
        "test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh"
    )
    cat.create_namespace("db")
    yield cat
    cat.engine.dispose()


@pytest.fixture
def table(catalog: SqlCatalog) -> Table:
    return catalog.create_table(NAME, schema=SCHEMA)


class Cycle:
    """Builds one commit request batch by batch, in channel order."""

    _offsets = itertools.count()

    def __init__(self, table: Table) -> None:
        self.table = table
        self.files: list[PendingFile] = []

    def batch(
        self,
        writer: str,
        seq: int,
        upserts: Sequence[tuple[Any, ...]] = (),
        deletes: Sequence[tuple[Any, ...]] = (),
        group: str | None = None,
    ) -> Cycle:
        """A batch: ``upserts`` are full rows, ``deletes`` keys; key files cover both. With
        ``group``, the key files are named for that pipeline (as its Spark sink names them)."""
        offset = next(self._offsets)
        uid = str(self.table.metadata.table_uuid)
        schema = self.table.schema()
        arrow = schema_to_pyarrow(schema, include_field_ids=False)
        metas: list[DataFileMeta] = []
        if upserts:
            columns = list(zip(*upserts, strict=True))
            metas += write_data_files(
                self.table,
                pa.table([pa.array(c, f.type) for c, f in zip(columns, arrow, strict=True)], arrow),
            )
        id_count = len(schema.identifier_field_ids)
        keys = [row[:id_count] for row in upserts] + list(deletes)
        if keys:
            names = [schema.find_field(i).name for i in sorted(schema.identifier_field_ids)]
            tag = None if group is None else group_write_uuid(group)
            keyed = pa.table(list(zip(*keys, strict=True)), names)
            metas += write_key_files(self.table, keyed, tag)
        self.files += [PendingFile(m, writer, seq, "0", offset, uid) for m in metas]
        return self

    def request(self, commit_id: str | None = None) -> TableCommitRequest:
        return TableCommitRequest(
            table=".".join(self.table.name()),
            commit_id=commit_id or str(uuid.uuid4()),
            files=tuple(self.files),
            positions={"0": max(f.offset for f in self.files) + 1},
            source_offsets={},
            fencing_token=1,
        )


def commit(catalog: SqlCatalog, cycle: Cycle, commit_id: str | None = None) -> TableCommitResult:
    return IcebergCommitter(catalog, GROUP).commit(cycle.request(commit_id))


def content(catalog: SqlCatalog, name: str = NAME) -> list[tuple[Any, ...]]:
    """The table's rows as pyiceberg's scan reads them (position deletes applied)."""
    rows = catalog.load_table(name).scan().to_arrow().to_pylist()
    return sorted(tuple(r.values()) for r in rows)


def summary(catalog: SqlCatalog, name: str = NAME) -> dict[str, str]:
    head = catalog.load_table(name).current_snapshot()
    assert head is not None
    assert head.summary is not None
    return {"operation": head.summary.operation.value, **head.summary.additional_properties}


def seed(catalog: SqlCatalog, table: Table, ids: Sequence[int]) -> None:
    """Commit ``ids`` with names "v0" as a first upsert cycle (into an empty table)."""
    commit(catalog, Cycle(table).batch("w0", 0, upserts=[(i, "v0") for i in ids]))


def test_upsert_replaces_existing_rows_in_one_overwrite_snapshot(
    catalog: SqlCatalog, table: Table
) -> None:
    seed(catalog, table, range(10))
    before = len(catalog.load_table(NAME).snapshots())
    result = commit(
        catalog,
        Cycle(table).batch("w1", 0, upserts=[(3, "v1"), (5, "v1"), (20, "new")]),
        commit_id="c-2",
    )

    expected = [(i, "v0") for i in range(10) if i not in (3, 5)] + [
        (3, "v1"),
        (5, "v1"),
        (20, "new"),
    ]
    assert content(catalog) == sorted(expected)
    assert len(catalog.load_table(NAME).snapshots()) == before + 1
    props = summary(catalog)
    assert props["operation"] == "overwrite"
    assert props[COMMIT_ID_KEY] == "c-2"
    assert props["added-position-deletes"] == "2"
    assert props["added-records"] == "3"
    assert props["added-delete-files"] == "1"
    assert (result.data_files, result.records) == (1, 3)  # the key file is not counted


def test_position_delete_file_is_spec_valid(catalog: SqlCatalog, table: Table) -> None:
    seed(catalog, table, range(10))
    data_path = next(iter(catalog.load_table(NAME).scan().plan_files())).file.file_path
    commit(catalog, Cycle(table).batch("w1", 0, deletes=[(7,), (2,), (4,)]))

    loaded = catalog.load_table(NAME)
    head = loaded.current_snapshot()
    assert head is not None
    manifests = [m for m in head.manifests(loaded.io) if m.content == ManifestContent.DELETES]
    assert len(manifests) == 1
    [entry] = manifests[0].fetch_manifest_entry(loaded.io)
    delete_file = entry.data_file
    assert delete_file.content == DataFileContent.POSITION_DELETES
    assert delete_file.record_count == 3
    on_disk = pq.read_table(delete_file.file_path.removeprefix("file://"))
    assert on_disk.to_pydict() == {"file_path": [data_path] * 3, "pos": [2, 4, 7]}
    field_ids = [f.metadata[b"PARQUET:field_id"] for f in on_disk.schema]
    assert field_ids == [b"2147483546", b"2147483545"]
    assert on_disk.schema.field("pos").type == pa.int64()
    # full path bounds: readers index the file by the one data file it targets
    assert delete_file.lower_bounds[rowdelta.FILE_PATH_FIELD_ID] == data_path.encode()
    assert delete_file.upper_bounds[rowdelta.FILE_PATH_FIELD_ID] == data_path.encode()
    assert summary(catalog)["operation"] == "delete"
    assert content(catalog) == [(i, "v0") for i in (0, 1, 3, 5, 6, 8, 9)]
    # the manifest list and the manifest, read with fastavro (not pyiceberg's reader)
    with open(head.manifest_list.removeprefix("file://"), "rb") as stream:
        manifests_listed: list[Any] = list(fastavro.reader(stream))
        listed = {m["manifest_path"]: m for m in manifests_listed}
    assert listed[manifests[0].manifest_path]["content"] == 1  # deletes
    with open(manifests[0].manifest_path.removeprefix("file://"), "rb") as stream:
        reader = fastavro.reader(stream)
        assert reader.metadata["content"] == "deletes"
        records: list[Any] = list(reader)
        [raw] = records
    assert raw["data_file"]["content"] == 1  # position deletes
    assert raw["data_file"]["file_path"] == delete_file.file_path
    assert raw["data_file"]["record_count"] == 3


def test_last_change_wins_across_batches_and_writers(catalog: SqlCatalog, table: Table) -> None:
    seed(catalog, table, range(5))
    cycle = (
        Cycle(table)
        .batch("w1", 0, upserts=[(1, "a"), (2, "a")])
        .batch("w1", 1, upserts=[(1, "b")])
        .batch("w2", 0, upserts=[(1, "c"), (3, "c")])
    )
    commit(catalog, cycle)

    assert content(catalog) == [(0, "v0"), (1, "c"), (2, "a"), (3, "c"), (4, "v0")]
    # 1, 2, 3 from the seed, then 1 of w1's first batch, then 1 of w1's second batch
    assert summary(catalog)["added-position-deletes"] == "5"


def test_key_inserted_and_deleted_within_one_cycle_is_gone(
    catalog: SqlCatalog, table: Table
) -> None:
    seed(catalog, table, range(3))
    cycle = (
        Cycle(table)
        .batch("w1", 0, upserts=[(30, "tmp"), (1, "x")])
        .batch("w1", 1, deletes=[(30,)])
        .batch("w1", 2, upserts=[(31, "kept")])
    )
    commit(catalog, cycle)

    assert content(catalog) == [(0, "v0"), (1, "x"), (2, "v0"), (31, "kept")]


def test_rows_already_deleted_are_not_deleted_again(catalog: SqlCatalog, table: Table) -> None:
    seed(catalog, table, range(4))
    commit(catalog, Cycle(table).batch("w1", 0, upserts=[(2, "second")]))
    commit(catalog, Cycle(table).batch("w1", 1, upserts=[(2, "third")]))

    assert content(catalog) == [(0, "v0"), (1, "v0"), (2, "third"), (3, "v0")]
    # only the live row of the previous cycle; the seed's row 2 was deleted already
    assert summary(catalog)["added-position-deletes"] == "1"


def test_status_counts_live_rows_not_deleted_ones(catalog: SqlCatalog, table: Table) -> None:
    """Issue 24 item 1: ``total-records`` counts deleted rows too; status shows live rows."""
    seed(catalog, table, range(10))
    commit(catalog, Cycle(table).batch("w1", 0, upserts=[(3, "v1"), (5, "v1"), (20, "new")]))
    commit(catalog, Cycle(table).batch("w1", 1, deletes=[(7,)]))
    live = len(content(catalog))  # pyiceberg's scan applies the deletes
    assert (live, summary(catalog)["total-records"]) == (10, "13")

    config = config_from_dict(
        {"name": GROUP, "source": {"topics": ["t"]}, "tables": [{"name": NAME}]}
    )
    status = table_status(catalog, config, NAME, None, time.time() * 1000)

    assert status.rows == 10
    assert (status.deleted_rows, status.rows_exact) == (3, True)
    (line,) = render_lines(PipelineStatus(GROUP, "memory", None, None, [status]))[1:]
    assert "10 rows (3 deleted)" in line, line
    assert "13 rows" not in line, line
    (row,) = PipelineStatus(GROUP, "memory", None, None, [status]).to_json()["tables"]
    assert (row["rows"], row["deleted_rows"], row["rows_exact"]) == (10, 3, True)


def test_row_counts_with_equality_deletes_are_an_upper_bound() -> None:
    counts = RowCounts.of(
        {"total-records": "13", "total-position-deletes": "3", "total-equality-deletes": "2"}
    )
    assert counts is not None
    assert (counts.live, counts.deleted, counts.exact) == (10, 3, False)
    assert counts.describe() == "at most 10 rows (3 deleted, equality deletes not counted)"
    assert RowCounts.of({}) is None
    assert RowCounts(5000, 0, 0).describe() == "5,000 rows"


def test_replayed_request_deletes_nothing_twice(catalog: SqlCatalog, table: Table) -> None:
    seed(catalog, table, range(5))
    cycle = Cycle(table).batch("w1", 0, upserts=[(1, "new")], deletes=[(3,)])
    first = commit(catalog, cycle, commit_id="c-2")
    snapshots = len(catalog.load_table(NAME).snapshots())

    replay = commit(catalog, cycle, commit_id="c-2")
    again = commit(catalog, cycle, commit_id="c-3")  # a recovered coordinator, new id

    assert first.snapshot_id is not None
    assert replay.snapshot_id is None
    assert again.snapshot_id is None
    assert len(catalog.load_table(NAME).snapshots()) == snapshots
    assert content(catalog) == [(0, "v0"), (1, "new"), (2, "v0"), (4, "v0")]


def test_batch_reannounced_under_another_writer_keeps_its_rows(
    catalog: SqlCatalog, table: Table
) -> None:
    seed(catalog, table, range(3))
    cycle = Cycle(table).batch("w1", 0, upserts=[(1, "new")])
    commit(catalog, cycle)
    result = commit(catalog, reannounced(cycle, "w9"))

    assert result.snapshot_id is None
    assert content(catalog) == [(0, "v0"), (1, "new"), (2, "v0")]


def reannounced(cycle: Cycle, writer: str) -> Cycle:
    """The very files of ``cycle`` announced again by a writer with a fresh id (watermarks do
    not cover it), later on the channel."""
    again = Cycle(cycle.table)
    again.files = [
        PendingFile(f.meta, writer, 0, f.partition, f.offset + 100, f.table_uuid)
        for f in cycle.files
    ]
    return again


def test_delete_only_batch_reannounced_under_another_writer_deletes_nothing_again(
    catalog: SqlCatalog, table: Table
) -> None:
    seed(catalog, table, range(3))
    deletes = Cycle(table).batch("w1", 0, deletes=[(1,)])
    commit(catalog, deletes)
    commit(catalog, Cycle(table).batch("w1", 1, upserts=[(1, "back")]))

    result = commit(catalog, reannounced(deletes, "w9"))

    assert result.snapshot_id is None
    assert content(catalog) == [(0, "v0"), (1, "back"), (2, "v0")]


def test_reannounced_key_file_removed_as_an_orphan_does_not_fail_the_table(
    catalog: SqlCatalog, table: Table
) -> None:
    """An applied key file is an orphan (no snapshot names it): ``icefloe maintain`` deletes
    it. The same batch announced again must not fail the table on every cycle for good."""
    seed(catalog, table, range(3))
    deletes = Cycle(table).batch("w1", 0, deletes=[(1,)])
    commit(catalog, deletes)
    removed = remove_orphan_files(catalog.load_table(NAME), int(time.time() * 1000) + 60_000)
    assert {f.meta.path for f in deletes.files} <= {f"file://{p}" for p in removed.deleted}

    result = commit(catalog, reannounced(deletes, "w9"))

    assert result.snapshot_id is None
    assert content(catalog) == [(0, "v0"), (2, "v0")]


def applied_keys(catalog: SqlCatalog) -> tuple[str, ...]:
    """The key files the head's summary lists as applied (read from the side file itself)."""
    with open(summary(catalog)[APPLIED_KEY].removeprefix("file://"), "rb") as f:
        return decode_applied(f.read()).keys


def test_applied_key_files_stay_listed_while_they_exist_then_are_quarantined_as_missing(
    catalog: SqlCatalog, table: Table
) -> None:
    """The applied-files record is bounded: a key file ``icefloe maintain`` removed is dropped
    from it at the next commit that applies keys. Announced again after that, the missing key
    file is refused (quarantined as missing) and the batch's committed data file is not."""
    seed(catalog, table, range(3))
    first = Cycle(table).batch("w1", 0, upserts=[(1, "new")])
    commit(catalog, first)
    [key] = [f.meta.path for f in first.files if f.is_key_file]
    assert applied_keys(catalog)[-1] == key  # after the seed's
    remove_orphan_files(catalog.load_table(NAME), int(time.time() * 1000) + 60_000)
    second = Cycle(catalog.load_table(NAME)).batch("w1", 1, deletes=[(2,)])
    commit(catalog, second)
    assert applied_keys(catalog) == tuple(f.meta.path for f in second.files)

    again = reannounced(first, "w9")
    screened = IcebergCommitter(catalog, GROUP).screen(NAME, again.files)

    assert [(f.meta.path, type(e)) for f, e in screened.refused] == [(key, DataFileMissingError)]
    assert [f.meta.path for f in screened.accepted] == [
        f.meta.path for f in first.files if not f.is_key_file
    ]
    assert commit(catalog, Cycle(table).batch("w1", 2, upserts=[(3, "v")])).snapshot_id
    assert content(catalog) == [(0, "v0"), (1, "new"), (3, "v")]


def test_the_pipelines_own_key_files_are_deleted_once_applied(
    catalog: SqlCatalog, table: Table
) -> None:
    """A key file named for the pipeline is deleted once the snapshot applying it landed and
    leaves the list at the next commit, so the record does not grow with every cycle; another
    writer's key file (not named for it) is left alone."""
    committer = IcebergCommitter(catalog, GROUP)
    seed(catalog, table, range(3))
    deletes = Cycle(table).batch("w1", 0, deletes=[(1,)], group=GROUP)
    committer.commit(deletes.request())
    [key] = [f.meta.path for f in deletes.files]
    assert not Path(key.removeprefix("file://")).exists()
    assert applied_keys(catalog)[-1] == key  # until the next commit
    other = Cycle(catalog.load_table(NAME)).batch("w1", 1, upserts=[(1, "back")], group="other")
    committer.commit(other.request())
    [kept] = [f.meta.path for f in other.files if f.is_key_file]
    assert key not in applied_keys(catalog)
    assert Path(kept.removeprefix("file://")).exists()

    screened = committer.screen(NAME, reannounced(deletes, "w9").files)

    assert [(f.meta.path, type(e)) for f, e in screened.refused] == [(key, DataFileMissingError)]
    assert content(catalog) == [(0, "v0"), (1, "back"), (2, "v0")]


def test_partitioned_table_reads_only_partitions_of_the_keys(catalog: SqlCatalog) -> None:
    table = catalog.create_table(NAME, schema=REGIONAL, partition_spec=BY_REGION)
    regions = ["ap", "eu", "sa", "us"]
    seed_cycle = Cycle(table).batch(
        "w0", 0, upserts=[(r, i, "v0") for r in regions for i in range(5)]
    )
    commit(catalog, seed_cycle)
    loaded = catalog.load_table(NAME)
    assert len(list(loaded.scan().plan_files())) == 4  # one file per region

    cycle = Cycle(loaded).batch("w1", 0, upserts=[("eu", 1, "v1"), ("eu", 2, "v1")])
    build = DataFileBuilder(loaded.metadata).build
    data = [build(f.meta) for f in cycle.files if f.meta.content == FileContent.DATA]
    keys = [build(f.meta) for f in cycle.files if f.meta.content != FileContent.DATA]
    head = loaded.current_snapshot()
    assert head is not None
    resolution = rowdelta.resolve(loaded, head.snapshot_id, [rowdelta.Batch(data, keys)])
    assert (resolution.candidates, resolution.files_read, resolution.deleted_rows) == (4, 1, 2)

    commit(catalog, cycle)
    rows = content(catalog)
    assert len(rows) == 20
    assert [r for r in rows if r[2] == "v1"] == [("eu", 1, "v1"), ("eu", 2, "v1")]


def test_column_bounds_prune_files_that_cannot_hold_the_keys(
    catalog: SqlCatalog, table: Table
) -> None:
    for n in range(5):  # five files with disjoint id ranges
        commit(
            catalog,
            Cycle(table).batch("w0", n, upserts=[(i, "v0") for i in range(n * 100, n * 100 + 50)]),
        )
    loaded = catalog.load_table(NAME)
    head = loaded.current_snapshot()
    assert head is not None
    cycle = Cycle(loaded).batch("w1", 0, deletes=[(210,), (249,), (260,)])
    build = DataFileBuilder(loaded.metadata).build
    keys = [build(f.meta) for f in cycle.files]
    resolution = rowdelta.resolve(loaded, head.snapshot_id, [rowdelta.Batch([], keys)])
    assert (resolution.candidates, resolution.files_read, resolution.deleted_rows) == (5, 1, 2)

    commit(catalog, cycle)
    written = [i for n in range(5) for i in range(n * 100, n * 100 + 50)]
    assert [r[0] for r in content(catalog)] == [i for i in written if i not in (210, 249)]


def test_each_candidate_file_is_matched_only_against_the_keys_within_its_bounds(
    catalog: SqlCatalog, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files a compaction sorted hold disjoint key ranges: matching every file against all
    the batch's keys probed keys x files; each file now gets the keys its bounds admit."""
    ranges = [range(0, 50), range(100, 150), range(40, 161, 10), range(300, 350)]
    for n, ids in enumerate(ranges):
        commit(catalog, Cycle(table).batch("w0", n, upserts=[(i, f"v{n}") for i in ids]))
    loaded = catalog.load_table(NAME)
    head = loaded.current_snapshot()
    assert head is not None
    deleted = [999, 330, 150, 45, 10, 120]
    cycle = Cycle(loaded).batch("w1", 0, deletes=[(i,) for i in deleted])
    build = DataFileBuilder(loaded.metadata).build
    keys = [build(f.meta) for f in cycle.files]
    matched: list[tuple[int, list[int]]] = []
    original = rowdelta._matching_positions

    def spy(rows: pa.Table, wanted: pa.Table, names: Sequence[str]) -> Any:
        matched.append((rows.column(0)[0].as_py(), sorted(wanted.column(0).to_pylist())))
        return original(rows, wanted, names)

    monkeypatch.setattr(rowdelta, "_matching_positions", spy)
    rowdelta.resolve(loaded, head.snapshot_id, [rowdelta.Batch([], keys)])
    assert sorted(matched) == [(0, [10, 45]), (40, [45, 120, 150]), (100, [120]), (300, [330])]

    monkeypatch.undo()
    commit(catalog, cycle)
    expected = {i: f"v{n}" for n, ids in enumerate(ranges) for i in ids}  # later files win
    expected = {i: v for i, v in expected.items() if i not in deleted}
    assert sorted((r[0], r[1]) for r in content(catalog)) == sorted(expected.items())


def test_v1_table_refuses_key_files_with_a_typed_error(catalog: SqlCatalog) -> None:
    # (pyiceberg 0.12 cannot write v3 metadata, so v3's refusal is not testable here)
    table = catalog.create_table(NAME, schema=SCHEMA, properties={"format-version": "1"})
    assert table.metadata.format_version == 1
    cycle = Cycle(table).batch("w1", 0, upserts=[(1, "a")])
    committer = IcebergCommitter(catalog, GROUP)

    screening = committer.screen(NAME, cycle.files)
    assert screening.accepted == ()
    [(refused, error), (sibling, batch_error)] = sorted(
        screening.refused, key=lambda r: r[0].meta.content != FileContent.EQUALITY_DELETES
    )
    assert refused.meta.content == FileContent.EQUALITY_DELETES
    assert isinstance(error, RowDeltaTableError)
    assert "format version 2" in str(error)
    # the batch's row images go with its keys: alone they would duplicate key 1
    assert sibling.meta.content == FileContent.DATA
    assert isinstance(batch_error, KeyedBatchRefusedError)
    with pytest.raises(RowDeltaTableError, match="format version 2"):
        committer.commit(cycle.request())
    assert catalog.load_table(NAME).snapshots() == []


def test_key_files_on_other_columns_and_position_deletes_are_refused(
    catalog: SqlCatalog, table: Table
) -> None:
    cycle = Cycle(table).batch("w1", 0, upserts=[(1, "a")])
    [data, key] = cycle.files
    # each in a batch of its own: a keyed batch is refused whole
    wrong_ids = dataclasses.replace(
        key, batch_seq=1, meta=dataclasses.replace(key.meta, equality_ids=(2,))
    )
    positional = dataclasses.replace(
        key, batch_seq=2, meta=dataclasses.replace(key.meta, content=FileContent.POSITION_DELETES)
    )
    screening = IcebergCommitter(catalog, GROUP).screen(NAME, [data, key, wrong_ids, positional])
    assert screening.accepted == (data, key)
    kinds = [type(e) for _, e in screening.refused]
    assert kinds == [RowDeltaTableError, RowDeltaNotSupportedError]


def test_conflict_resolves_again_against_the_new_head(catalog: SqlCatalog, table: Table) -> None:
    seed(catalog, table, range(4))
    calls: list[int] = []

    def foreign_append() -> None:
        # another tool appends a second row with key 2 while the commit is being prepared
        calls.append(1)
        if len(calls) == 1:
            arrow = schema_to_pyarrow(SCHEMA, include_field_ids=False)
            catalog.load_table(NAME).append(pa.table([[2], ["foreign"]], arrow))

    committer = IcebergCommitter(catalog, GROUP, before_commit=foreign_append, retry_wait_s=0.001)
    committer.commit(Cycle(table).batch("w1", 0, upserts=[(2, "mine")]).request())

    assert len(calls) == 2  # the first attempt lost the race, the second re-resolved
    assert content(catalog) == [(0, "v0"), (1, "v0"), (2, "mine"), (3, "v0")]
    assert summary(catalog)["added-position-deletes"] == "2"


@pytest.mark.parametrize("branch_set_by", ["committer", "table policy"])
def test_row_delta_on_a_new_branch_leaves_main_alone(
    catalog: SqlCatalog, table: Table, branch_set_by: str
) -> None:
    seed(catalog, table, range(3))
    main_head = catalog.load_table(NAME).current_snapshot()
    assert main_head is not None
    if branch_set_by == "committer":
        committer = IcebergCommitter(catalog, GROUP, branch="audit")
    else:  # tables.branch: the committer's default stays main, this table is on audit
        policies = TablePolicies(TablePolicy(), {NAME: TablePolicy(branch="audit")})
        committer = IcebergCommitter(catalog, GROUP, policies=policies)
    committer.commit(Cycle(table).batch("w1", 0, upserts=[(1, "b")], deletes=[(0,)]).request())

    loaded = catalog.load_table(NAME)
    head = loaded.current_snapshot()
    assert head is not None
    assert head.snapshot_id == main_head.snapshot_id
    assert content(catalog) == [(0, "v0"), (1, "v0"), (2, "v0")]
    audit = loaded.snapshot_by_name("audit")
    assert audit is not None
    assert audit.parent_snapshot_id == main_head.snapshot_id
    rows = loaded.scan(snapshot_id=audit.snapshot_id).to_arrow().to_pylist()
    assert sorted(tuple(r.values()) for r in rows) == [(1, "b"), (2, "v0")]


@pytest.mark.parametrize(("file_rows", "keys"), [(1_000, 50), (1_000, 5_000)])
def test_matching_builds_no_set_larger_than_the_file_or_the_keys(file_rows: int, keys: int) -> None:
    """A candidate file is matched against a batch's keys once per file: the hash set
    ``is_in`` builds of its value set must not be all the batch's keys when they outnumber the
    file's rows (1M keys against 100 files built a 1M-entry set 100 times), and the positions
    found are exactly those whose id is a key, in order."""
    import random
    from unittest import mock

    import pyarrow.compute as pc

    rng = random.Random(file_rows + keys)
    ids = [rng.randrange(20_000) for _ in range(file_rows)]
    wanted = rng.sample(range(20_000), keys)
    rows = pa.table({"id": pa.array(ids, pa.int64())})
    key_table = pa.table({"id": pa.array(wanted, pa.int64())})
    with mock.patch.object(pc, "is_in", wraps=pc.is_in) as spy:
        hits = rowdelta._matching_positions(rows, key_table, ["id"])
    assert hits.tolist() == [i for i, v in enumerate(ids) if v in set(wanted)]
    assert hits.dtype == "int64"
    for call in spy.call_args_list:
        assert len(call.kwargs["value_set"]) <= min(file_rows, keys)
