"""IcebergCommitter against a real SqlCatalog (SQLite) with a file:// warehouse and real
Parquet files written by ``icefloe.records.datafiles.write_data_files``; rows are counted by
scanning."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitStateUnknownException
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.transforms import DayTransform, IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType, TimestampType

from icefloe.commit.committer import IcebergCommitter, _write_side_file
from icefloe.commit.dedupe import POSITIONS_KEY, WATERMARKS_KEY, CommitBoundary
from icefloe.commit.livefiles import LiveFiles
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.rollback import ReplayRange
from icefloe.commit.summary import (
    COMMIT_ID_KEY,
    FENCING_TOKEN_KEY,
    GROUP_ID_KEY,
    SOURCE_OFFSETS_KEY,
    VALID_THROUGH_KEY,
    RecordedCommit,
    fencing_token_property,
    state_property,
)
from icefloe.errors import (
    CommitError,
    CommitHistoryLostError,
    FileOutsideTableError,
    NotLeaderError,
    PartitionSpecChangedError,
    RollbackNotReplayableError,
    RollbackPendingError,
    RowDeltaNotSupportedError,
    StaleFencingTokenError,
    TableMismatchError,
    TableMissingError,
)
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import write_data_files
from icefloe.testing.fixtures import postgres_catalog_database
from icefloe.testing.harness import once

GROUP = "pipe-a"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "name", StringType(), required=False),
    NestedField(3, "ts", TimestampType(), required=False),
)
ARROW = pa.schema([("id", pa.int64()), ("name", pa.string()), ("ts", pa.timestamp("us"))])
DAY0 = dt.datetime(2024, 5, 1, 12, 0)


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[SqlCatalog]:
    cat = SqlCatalog(
        "test",
        uri=f"sqlite:///{tmp_path}/catalog.db",
        warehouse=f"file://{tmp_path}/warehouse",
    )
    cat.create_namespace("db")
    yield cat
    cat.engine.dispose()


@pytest.fixture
def table(catalog: SqlCatalog) -> Table:
    return catalog.create_table("db.events", schema=SCHEMA)


def rows(ids: Sequence[int], names: Sequence[str] | None = None, days: int = 1) -> pa.Table:
    names = names if names is not None else ["n"] * len(ids)
    ts = [DAY0 + dt.timedelta(days=i % days) for i in range(len(ids))]
    return pa.table([pa.array(ids, pa.int64()), pa.array(names), pa.array(ts)], schema=ARROW)


def write(table: Table, ids: Sequence[int], **kw: Any) -> list[DataFileMeta]:
    metas = write_data_files(table, rows(ids, **kw))
    assert metas, "test setup wrote no file"
    return metas


def pending(
    metas: Sequence[DataFileMeta],
    table: Table | None = None,
    writer: str = "w1",
    batch_seq: int = 0,
    partition: str = "0",
    offset: int = 0,
) -> list[PendingFile]:
    uid = None if table is None else str(table.metadata.table_uuid)
    return [PendingFile(m, writer, batch_seq, partition, offset, uid) for m in metas]


def request(
    files: Sequence[PendingFile],
    positions: dict[str, int],
    token: int = 1,
    name: str = "db.events",
    commit_id: str | None = None,
    source_offsets: dict[str, dict[int, int]] | None = None,
    valid_through_ms: int | None = None,
) -> TableCommitRequest:
    return TableCommitRequest(
        table=name,
        commit_id=commit_id or str(uuid.uuid4()),
        files=tuple(files),
        positions=positions,
        source_offsets=source_offsets or {},
        fencing_token=token,
        valid_through_ms=valid_through_ms,
    )


def ids_in(catalog: Catalog, name: str = "db.events", branch: str | None = None) -> list[int]:
    t = catalog.load_table(name)
    if branch is None:
        scan = t.scan()
    else:
        head = t.snapshot_by_name(branch)
        if head is None:
            return []
        scan = t.scan(snapshot_id=head.snapshot_id)
    return sorted(scan.to_arrow().column("id").to_pylist())


def snapshot_count(catalog: Catalog, name: str = "db.events") -> int:
    return len(catalog.load_table(name).snapshots())


def summary(catalog: Catalog, snapshot_id: int, name: str = "db.events") -> dict[str, Any]:
    snap = catalog.load_table(name).snapshot_by_id(snapshot_id)
    assert snap is not None
    assert snap.summary is not None
    return {"operation": snap.summary.operation.value, **snap.summary.additional_properties}


# --- basic commit -------------------------------------------------------------------------


def test_commit_appends_files_and_records_summary(catalog: SqlCatalog, table: Table) -> None:
    f1 = pending(write(table, [1, 2, 3]), table, writer="w1", batch_seq=4, offset=0)
    f2 = pending(write(table, [4, 5]), table, writer="w2", batch_seq=7, partition="1", offset=3)
    req = request(
        f1 + f2,
        positions={"0": 1, "1": 4},
        token=3,
        source_offsets={"topic": {0: 100, 1: 50}},
        valid_through_ms=1_700_000_000_000,
    )
    result = IcebergCommitter(catalog, GROUP).commit(req)

    assert result.snapshot_id is not None
    assert (result.data_files, result.records, result.skipped_files) == (2, 5, 0)
    assert ids_in(catalog) == [1, 2, 3, 4, 5]
    s = summary(catalog, result.snapshot_id)
    assert s["operation"] == "append"
    assert s[GROUP_ID_KEY] == GROUP
    assert s[COMMIT_ID_KEY] == req.commit_id
    assert json.loads(s[POSITIONS_KEY]) == {"0": 1, "1": 4}
    assert json.loads(s[WATERMARKS_KEY]) == {"w1": 4, "w2": 7}
    assert json.loads(s[SOURCE_OFFSETS_KEY]) == {"topic": {"0": 100, "1": 50}}
    assert s[FENCING_TOKEN_KEY] == "3"
    assert s[VALID_THROUGH_KEY] == "1700000000000"
    props = catalog.load_table("db.events").properties
    assert props[fencing_token_property(GROUP)] == "3"

    state = IcebergCommitter(catalog, GROUP).state("db.events")
    assert state == RecordedCommit(
        snapshot_id=result.snapshot_id,
        commit_id=req.commit_id,
        boundary=CommitBoundary({"0": 1, "1": 4}, {"w1": 4, "w2": 7}),
        source_offsets={"topic": {0: 100, 1: 50}},
        fencing_token=3,
        valid_through_ms=1_700_000_000_000,
    )


def test_partial_cycle_has_no_valid_through(catalog: SqlCatalog, table: Table) -> None:
    result = IcebergCommitter(catalog, GROUP).commit(
        request(pending(write(table, [1]), table), {"0": 1})
    )
    assert result.snapshot_id is not None
    assert VALID_THROUGH_KEY not in summary(catalog, result.snapshot_id)
    state = IcebergCommitter(catalog, GROUP).state("db.events")
    assert state is not None
    assert state.valid_through_ms is None


def test_state_is_none_before_first_commit(catalog: SqlCatalog, table: Table) -> None:
    assert IcebergCommitter(catalog, GROUP).state("db.events") is None
    table.append(rows([1]))
    assert IcebergCommitter(catalog, GROUP).state("db.events") is None


# --- idempotency --------------------------------------------------------------------------


def test_replaying_the_same_request_adds_nothing(catalog: SqlCatalog, table: Table) -> None:
    committer = IcebergCommitter(catalog, GROUP)
    req = request(
        pending(write(table, [1, 2]), table) + pending(write(table, [3]), table), {"0": 1}
    )
    first = committer.commit(req)
    assert first.snapshot_id is not None
    snapshots = snapshot_count(catalog)

    # the version it made, as the catalog names it (a rollback watcher skips loading it)
    assert first.metadata_location == catalog.load_table("db.events").metadata_location

    again = committer.commit(req)
    assert again.snapshot_id is None
    assert (again.data_files, again.records, again.skipped_files) == (0, 0, 2)
    assert again.metadata_location is None  # made no version
    assert snapshot_count(catalog) == snapshots
    assert ids_in(catalog) == [1, 2, 3]


def test_only_files_after_positions_and_above_watermarks_are_committed(
    catalog: SqlCatalog, table: Table
) -> None:
    committer = IcebergCommitter(catalog, GROUP)
    old_a = pending(write(table, [1]), table, writer="w1", batch_seq=0, offset=0)
    old_b = pending(write(table, [2]), table, writer="w2", batch_seq=0, offset=1)
    committer.commit(request(old_a + old_b, {"0": 2}))

    # w1's batch 0 re-published later in the channel (a replay): its offset is past the
    # positions, but the watermark says the batch is in
    replayed = pending(write(table, [1]), table, writer="w1", batch_seq=0, offset=5)
    new_w1 = pending(write(table, [10]), table, writer="w1", batch_seq=1, offset=6)
    # another channel partition: offset 0 there is new although partition "0" is at 2
    new_p1 = pending(write(table, [11]), table, writer="w3", batch_seq=0, partition="1", offset=0)
    # before the positions, from a writer without a watermark: covered by positions alone
    before = pending(write(table, [12]), table, writer="w9", batch_seq=5, offset=1)
    files = old_a + old_b + replayed + new_w1 + new_p1 + before
    result = committer.commit(request(files, {"0": 7, "1": 1}))

    assert (result.data_files, result.records, result.skipped_files) == (2, 2, 4)
    assert ids_in(catalog) == [1, 2, 10, 11]
    assert result.snapshot_id is not None
    s = summary(catalog, result.snapshot_id)
    assert json.loads(s[POSITIONS_KEY]) == {"0": 7, "1": 1}
    # w9's batch is covered (by positions), so it counts as committed
    assert json.loads(s[WATERMARKS_KEY]) == {"w1": 1, "w2": 0, "w3": 0, "w9": 5}


def test_zero_record_files_and_duplicate_paths_are_dropped(
    catalog: SqlCatalog, table: Table
) -> None:
    [meta] = write(table, [1, 2])
    empty = dataclasses.replace(meta, path=meta.path.replace(".parquet", "-empty.parquet"))
    empty = dataclasses.replace(empty, record_count=0)
    files = [
        PendingFile(meta, "w1", 0, "0", 0, str(table.metadata.table_uuid)),
        PendingFile(meta, "w2", 0, "0", 1),  # same path published twice
        PendingFile(empty, "w1", 0, "0", 0),
    ]
    result = IcebergCommitter(catalog, GROUP).commit(request(files, {"0": 2}))

    assert (result.data_files, result.records, result.skipped_files) == (1, 2, 2)
    assert ids_in(catalog) == [1, 2]
    paths = catalog.load_table("db.events").inspect.files().column("file_path").to_pylist()
    assert paths == [meta.path]


def test_only_empty_files_make_no_snapshot(catalog: SqlCatalog, table: Table) -> None:
    [meta] = write(table, [1])
    empty = dataclasses.replace(meta, record_count=0)
    result = IcebergCommitter(catalog, GROUP).commit(request(pending([empty], table), {"0": 1}))
    assert result.snapshot_id is None
    assert result.skipped_files == 1
    assert snapshot_count(catalog) == 0


def test_foreign_writer_and_other_group_in_between(catalog: SqlCatalog, table: Table) -> None:
    ours = IcebergCommitter(catalog, GROUP)
    theirs = IcebergCommitter(catalog, "pipe-b")
    first = request(pending(write(table, [1, 2]), table, batch_seq=0, offset=0), {"0": 1})
    ours_first = ours.commit(first)

    catalog.load_table("db.events").append(rows([100]))  # a foreign, non-icefloe writer
    # another pipeline uses the same channel coordinates; they must not be confused with ours
    other = pending(write(table, [200]), table, writer="w1", batch_seq=9, offset=50)
    theirs.commit(request(other, {"0": 51}, token=7))
    catalog.load_table("db.events").append(rows([101]))

    state = ours.state("db.events")
    assert state is not None
    assert state.snapshot_id == ours_first.snapshot_id
    assert state.positions == {"0": 1}

    new = pending(write(table, [3]), table, batch_seq=1, offset=1)
    result = ours.commit(request(list(first.files) + new, {"0": 2}))
    assert (result.data_files, result.skipped_files) == (1, 1)
    assert ids_in(catalog) == [1, 2, 3, 100, 101, 200]
    # the other group's token does not fence ours, and ours is recorded separately
    props = catalog.load_table("db.events").properties
    assert props[fencing_token_property("pipe-b")] == "7"
    assert props[fencing_token_property(GROUP)] == "1"


# --- conflicts and retries ----------------------------------------------------------------


def test_conflict_with_foreign_commit_is_retried(catalog: SqlCatalog, table: Table) -> None:
    def foreign() -> None:
        catalog.load_table("db.events").append(rows([100]))

    callback = once(foreign)
    committer = IcebergCommitter(catalog, GROUP, before_commit=callback, retry_wait_s=0.001)
    result = committer.commit(request(pending(write(table, [1, 2]), table), {"0": 1}))

    assert len(callback.calls) == 2  # type: ignore[attr-defined]
    assert result.data_files == 1
    assert ids_in(catalog) == [1, 2, 100]
    state = committer.state("db.events")
    assert state is not None
    assert state.snapshot_id == result.snapshot_id


def test_conflict_with_a_commit_of_the_same_files_does_not_duplicate(
    catalog: SqlCatalog, table: Table
) -> None:
    """Another coordinator instance of the group commits the same files between our load
    and our commit: the retry must see them and commit nothing."""
    req = request(pending(write(table, [1, 2, 3]), table), {"0": 1})

    def rival() -> None:
        IcebergCommitter(catalog, GROUP).commit(req)

    committer = IcebergCommitter(catalog, GROUP, before_commit=once(rival), retry_wait_s=0.001)
    result = committer.commit(req)

    assert result.snapshot_id is None
    assert result.skipped_files == 1
    assert ids_in(catalog) == [1, 2, 3]
    assert snapshot_count(catalog) == 1


def test_zombie_loses_race_against_new_leader(catalog: SqlCatalog, table: Table) -> None:
    """A paused zombie (token 1) resumes after the new leader (token 2) committed the same
    files: its optimistic commit fails, the refresh shows the higher token, it refuses."""
    files = pending(write(table, [1, 2]), table)
    extra = pending(write(table, [3]), table, batch_seq=1, offset=1)

    def new_leader() -> None:
        IcebergCommitter(catalog, GROUP).commit(request(files, {"0": 1}, token=2))

    zombie = IcebergCommitter(catalog, GROUP, before_commit=once(new_leader), retry_wait_s=0.001)
    with pytest.raises(StaleFencingTokenError):
        zombie.commit(request(files + extra, {"0": 2}, token=1))
    assert ids_in(catalog) == [1, 2]
    assert catalog.load_table("db.events").properties[fencing_token_property(GROUP)] == "2"


def test_gives_up_after_max_attempts(catalog: SqlCatalog, table: Table) -> None:
    def always_foreign() -> None:
        catalog.load_table("db.events").append(rows([100]))

    committer = IcebergCommitter(
        catalog, GROUP, max_attempts=3, before_commit=always_foreign, retry_wait_s=0.001
    )
    with pytest.raises(CommitError, match="after 3 attempts"):
        committer.commit(request(pending(write(table, [1]), table), {"0": 1}))
    assert ids_in(catalog) == [100, 100, 100]
    assert committer.state("db.events") is None


def test_before_commit_failure_commits_nothing(catalog: SqlCatalog, table: Table) -> None:
    def lost_lease() -> None:
        raise NotLeaderError("lease lost")

    req = request(pending(write(table, [1]), table), {"0": 1})
    with pytest.raises(NotLeaderError):
        IcebergCommitter(catalog, GROUP, before_commit=lost_lease).commit(req)
    assert snapshot_count(catalog) == 0
    # the next leader commits the same files: nothing was lost
    assert IcebergCommitter(catalog, GROUP).commit(req).data_files == 1
    assert ids_in(catalog) == [1]


class _LostResponseCatalog(SqlCatalog):
    """A real SqlCatalog whose first commit lands but reports an unknown outcome, as a
    catalog whose response was lost would."""

    lost = 0

    def commit_table(self, table: Table, requirements: Any, updates: Any) -> Any:
        response = super().commit_table(table, requirements, updates)
        if self.lost == 0:
            self.lost += 1
            raise CommitStateUnknownException("response lost")
        return response


def test_unknown_outcome_that_landed_is_not_repeated(tmp_path: Path) -> None:
    catalog = _LostResponseCatalog(
        "lossy", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/wh"
    )
    catalog.create_namespace("db")
    table = catalog.create_table("db.events", schema=SCHEMA)
    committer = IcebergCommitter(catalog, GROUP, retry_wait_s=0.001)
    result = committer.commit(request(pending(write(table, [1, 2]), table), {"0": 1}))

    assert catalog.lost == 1
    assert result.snapshot_id is not None
    assert result.data_files == 1
    assert snapshot_count(catalog) == 1
    assert ids_in(catalog) == [1, 2]
    catalog.engine.dispose()


# --- fencing ------------------------------------------------------------------------------


def test_stale_token_is_refused_and_nothing_committed(catalog: SqlCatalog, table: Table) -> None:
    committer = IcebergCommitter(catalog, GROUP)
    committer.commit(request(pending(write(table, [1]), table), {"0": 1}, token=5))
    snapshots = snapshot_count(catalog)

    with pytest.raises(StaleFencingTokenError):
        committer.commit(request(pending(write(table, [2]), table, offset=1), {"0": 2}, token=4))
    assert snapshot_count(catalog) == snapshots
    assert ids_in(catalog) == [1]
    assert catalog.load_table("db.events").properties[fencing_token_property(GROUP)] == "5"


def test_token_property_alone_fences(catalog: SqlCatalog, table: Table) -> None:
    """A token recorded only as a table property (no icefloe snapshot yet) still fences."""
    with table.transaction() as tx:
        tx.set_properties({fencing_token_property(GROUP): "9"})
    with pytest.raises(StaleFencingTokenError):
        IcebergCommitter(catalog, GROUP).commit(
            request(pending(write(table, [1]), table), {"0": 1}, token=8)
        )
    assert snapshot_count(catalog) == 0


def test_token_is_recorded_and_only_raised(catalog: SqlCatalog, table: Table) -> None:
    committer = IcebergCommitter(catalog, GROUP)

    def token_after(token: int, ids: list[int], offset: int) -> str:
        files = pending(write(table, ids), table, batch_seq=offset, offset=offset)
        committer.commit(request(files, {"0": offset + 1}, token=token))
        return catalog.load_table("db.events").properties[fencing_token_property(GROUP)]

    assert token_after(1, [1], 0) == "1"
    assert token_after(3, [2], 1) == "3"
    assert token_after(3, [3], 2) == "3"  # the same leader keeps committing
    assert ids_in(catalog) == [1, 2, 3]


# --- wrong table, wrong place -------------------------------------------------------------


def test_recreated_table_is_refused(catalog: SqlCatalog, table: Table) -> None:
    files = pending(write(table, [1]), table)
    catalog.drop_table("db.events")
    catalog.create_table("db.events", schema=SCHEMA)

    with pytest.raises(TableMismatchError):
        IcebergCommitter(catalog, GROUP).commit(request(files, {"0": 1}))
    assert snapshot_count(catalog) == 0


def test_file_outside_table_location_is_refused(catalog: SqlCatalog, table: Table) -> None:
    other = catalog.create_table("db.other", schema=SCHEMA)
    good = pending(write(table, [1]), table)
    foreign = [PendingFile(m, "w1", 0, "0", 0) for m in write(other, [2])]

    committer = IcebergCommitter(catalog, GROUP)
    with pytest.raises(FileOutsideTableError):
        committer.commit(request(good + foreign, {"0": 1}))
    # a path that escapes the location with '..' is outside too
    escaped = dataclasses.replace(
        good[0].meta, path=f"{table.location()}/data/../../other/data/x.parquet"
    )
    with pytest.raises(FileOutsideTableError):
        committer.commit(request([PendingFile(escaped, "w1", 0, "0", 0)], {"0": 1}))
    assert snapshot_count(catalog) == 0
    assert snapshot_count(catalog, "db.other") == 0


def test_delete_files_are_refused_not_appended(catalog: SqlCatalog, table: Table) -> None:
    [meta] = write(table, [1])
    delete = dataclasses.replace(meta, content=FileContent.POSITION_DELETES)
    with pytest.raises(RowDeltaNotSupportedError, match="row delta"):
        IcebergCommitter(catalog, GROUP).commit(request(pending([delete], table), {"0": 1}))
    assert snapshot_count(catalog) == 0


# --- branches, partitions -----------------------------------------------------------------


def test_branch_on_empty_table(catalog: SqlCatalog, table: Table) -> None:
    committer = IcebergCommitter(catalog, GROUP, branch="audit")
    result = committer.commit(request(pending(write(table, [1, 2]), table), {"0": 1}))

    loaded = catalog.load_table("db.events")
    assert loaded.current_snapshot() is None  # main untouched
    head = loaded.snapshot_by_name("audit")
    assert head is not None
    assert head.snapshot_id == result.snapshot_id
    assert ids_in(catalog, branch="audit") == [1, 2]
    assert IcebergCommitter(catalog, GROUP).state("db.events") is None

    more = pending(write(table, [3]), table, batch_seq=1, offset=1)
    committer.commit(request(more, {"0": 2}))
    assert ids_in(catalog, branch="audit") == [1, 2, 3]
    state = committer.state("db.events")
    assert state is not None
    assert state.positions == {"0": 2}


def test_branch_forks_from_main(catalog: SqlCatalog, table: Table) -> None:
    table.append(rows([100]))
    main_head = catalog.load_table("db.events").current_snapshot()
    assert main_head is not None
    committer = IcebergCommitter(catalog, GROUP, branch="audit")
    result = committer.commit(request(pending(write(table, [1]), table), {"0": 1}))

    loaded = catalog.load_table("db.events")
    branch_head = loaded.snapshot_by_name("audit")
    assert branch_head is not None
    assert branch_head.snapshot_id == result.snapshot_id
    assert branch_head.parent_snapshot_id == main_head.snapshot_id
    assert ids_in(catalog, branch="audit") == [1, 100]
    assert ids_in(catalog) == [100]  # main unchanged


def test_tag_is_not_a_branch(catalog: SqlCatalog, table: Table) -> None:
    table.append(rows([100]))
    snapshot = catalog.load_table("db.events").current_snapshot()
    assert snapshot is not None
    catalog.load_table("db.events").manage_snapshots().create_tag(
        snapshot.snapshot_id, "v1"
    ).commit()
    with pytest.raises(CommitError, match="tag"):
        IcebergCommitter(catalog, GROUP, branch="v1").commit(
            request(pending(write(table, [1]), table), {"0": 1})
        )


def test_partitioned_table(catalog: SqlCatalog) -> None:
    spec = PartitionSpec(
        PartitionField(2, 1000, IdentityTransform(), "name"),
        PartitionField(3, 1001, DayTransform(), "ts_day"),
    )
    table = catalog.create_table("db.parted", schema=SCHEMA, partition_spec=spec)
    metas = write(table, list(range(12)), names=["a", "b", "c"] * 4, days=2)
    assert len(metas) == 6  # 3 names x 2 days
    result = IcebergCommitter(catalog, GROUP).commit(
        request(pending(metas, table), {"0": 1}, name="db.parted")
    )
    assert (result.data_files, result.records) == (6, 12)
    assert ids_in(catalog, "db.parted") == list(range(12))
    loaded = catalog.load_table("db.parted")
    assert loaded.scan(row_filter="name = 'b'").to_arrow().num_rows == 4
    day1 = loaded.scan(row_filter="ts >= '2024-05-02T00:00:00'").to_arrow()
    assert sorted(day1.column("id").to_pylist()) == [1, 3, 5, 7, 9, 11]
    partitions = loaded.inspect.partitions().column("partition").to_pylist()
    assert {(p["name"], p["ts_day"]) for p in partitions} == {
        (n, d) for n in "abc" for d in (dt.date(2024, 5, 1), dt.date(2024, 5, 2))
    }


def test_file_of_an_old_partition_spec_is_refused(catalog: SqlCatalog, table: Table) -> None:
    files = pending(write(table, [1]), table)
    with table.update_spec() as update:
        update.add_identity("name")
    with pytest.raises(PartitionSpecChangedError):
        IcebergCommitter(catalog, GROUP).commit(request(files, {"0": 1}))
    assert snapshot_count(catalog) == 0


def test_screen_refuses_only_the_bad_files(catalog: SqlCatalog, table: Table) -> None:
    """Each refusal concerns one file: the good ones of the same request stay accepted."""
    other = catalog.create_table("db.other", schema=SCHEMA)
    good = pending(write(table, [1]), table)
    outside = [PendingFile(m, "w1", 0, "0", 0) for m in write(other, [2])]
    stale_uuid = pending(write(table, [3]), table)
    stale_uuid = [dataclasses.replace(f, table_uuid=str(uuid.uuid4())) for f in stale_uuid]
    [meta] = write(table, [4])
    delete = pending([dataclasses.replace(meta, content=FileContent.POSITION_DELETES)], table)

    screening = IcebergCommitter(catalog, GROUP).screen(
        "db.events", good + outside + stale_uuid + delete
    )
    assert screening.accepted == tuple(good)
    refused = {f.meta.path: type(e) for f, e in screening.refused}
    assert refused == {
        outside[0].meta.path: FileOutsideTableError,
        stale_uuid[0].meta.path: TableMismatchError,
        delete[0].meta.path: RowDeltaNotSupportedError,
    }
    assert snapshot_count(catalog) == 0


def test_a_file_of_another_incarnation_of_the_table_is_refused_in_every_copy(
    catalog: SqlCatalog, table: Table
) -> None:
    """Found by the simulation (seeds 23001, 23003): a batch's files
    announced again under another writer id without a table uuid, the table dropped and
    created again under the same name and location: the original copy (the dropped table's
    uuid) was quarantined and the other committed, so the rows were in both places."""
    [meta] = write(table, [1])
    stale = [PendingFile(meta, "w1", 0, "0", 0, table_uuid=str(uuid.uuid4()))]
    again = [PendingFile(meta, "r1", 0, "0", 1)]  # no uuid: a writer that lost its identity
    screening = IcebergCommitter(catalog, GROUP).screen("db.events", stale + again)
    assert screening.accepted == ()
    assert [(f.writer_id, type(e)) for f, e in screening.refused] == [
        ("w1", TableMismatchError),
        ("r1", TableMismatchError),
    ]


def test_screen_of_a_missing_table_is_a_permanent_table_error(catalog: SqlCatalog) -> None:
    with pytest.raises(TableMissingError):
        IcebergCommitter(catalog, GROUP).screen("db.nope", [])


def test_file_the_table_already_holds_is_not_committed_again(
    catalog: SqlCatalog, table: Table
) -> None:
    """The same DataFileMeta announced again under another writer id (not covered by the
    positions or watermarks) must not be appended a second time."""
    committer = IcebergCommitter(catalog, GROUP)
    metas = write(table, [1, 2])
    committer.commit(request(pending(metas, table, writer="w1", offset=0), {"0": 1}))
    again = pending(metas, table, writer="w2", offset=5) + pending(
        write(table, [3]), table, writer="w2", offset=5
    )
    result = committer.commit(request(again, {"0": 6}))
    assert (result.data_files, result.skipped_files) == (1, len(metas))
    assert ids_in(catalog) == [1, 2, 3]
    # a fresh committer (no cached manifests) sees it too
    result = IcebergCommitter(catalog, GROUP).commit(
        request(pending(metas, table, writer="w3", offset=7), {"0": 8})
    )
    assert result.snapshot_id is None
    assert ids_in(catalog) == [1, 2, 3]


def test_a_held_file_announced_again_is_not_quarantined_after_a_spec_change(
    catalog: SqlCatalog, table: Table
) -> None:
    """Found by the commit-path simulation (test_simulation.py). A committed file announced
    again under another writer id, after the partition spec changed: the commit would drop it
    (the branch head holds it), so screening must not refuse it either, or the quarantine lists
    a committed file and recovering it with add_files, as the entry says, duplicates its rows."""
    committer = IcebergCommitter(catalog, GROUP)
    metas = write(table, [1, 2])
    committer.commit(request(pending(metas, table, writer="w1", offset=0), {"0": 1}))
    with catalog.load_table("db.events").update_spec() as spec:
        spec.add_identity("name")
    again = pending(metas, table, writer="w2", offset=5)
    screening = IcebergCommitter(catalog, GROUP).screen("db.events", again)
    assert screening.refused == ()
    assert screening.accepted == tuple(again)
    assert committer.commit(request(again, {"0": 6})).snapshot_id is None
    assert ids_in(catalog) == [1, 2]


# --- monotonic state ----------------------------------------------------------------------


def test_positions_watermarks_and_offsets_never_regress(catalog: SqlCatalog, table: Table) -> None:
    committer = IcebergCommitter(catalog, GROUP)
    committer.commit(
        request(
            pending(write(table, [1]), table, writer="w1", batch_seq=3, offset=9),
            {"0": 10, "1": 5},
            source_offsets={"t": {0: 100, 1: 7}},
        )
    )
    # a lagging request (e.g. from a recovery that re-read less) must not move anything back
    new = pending(write(table, [2]), table, writer="w2", batch_seq=0, partition="2", offset=0)
    result = committer.commit(
        request(new, {"0": 4, "2": 1}, source_offsets={"t": {0: 50, 2: 3}, "u": {0: 1}})
    )
    assert result.data_files == 1
    state = committer.state("db.events")
    assert state is not None
    assert state.positions == {"0": 10, "1": 5, "2": 1}
    assert state.watermarks == {"w1": 3, "w2": 0}
    assert state.source_offsets == {"t": {0: 100, 1: 7, 2: 3}, "u": {0: 1}}
    assert ids_in(catalog) == [1, 2]


def test_unreadable_own_summary_is_an_error(catalog: SqlCatalog, table: Table) -> None:
    table.append(rows([1]), snapshot_properties={GROUP_ID_KEY: GROUP, POSITIONS_KEY: "{oops"})
    with pytest.raises(CommitError, match="unreadable"):
        IcebergCommitter(catalog, GROUP).state("db.events")


def test_missing_table_is_a_commit_error(catalog: SqlCatalog) -> None:
    with pytest.raises(CommitError, match="does not exist"):
        IcebergCommitter(catalog, GROUP).commit(request([], {"0": 1}, name="db.nope"))


@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
)
def test_racing_committers_of_one_group_commit_each_file_once(
    database: str, tmp_path: Path
) -> None:
    """Three committers (say, a leader and two zombies that still believe they lead, same
    token) race on overlapping requests in different orders from their own catalog clients;
    every file ends up in the table exactly once. On PostgreSQL the clients' commits really
    run at once (SQLite serialises them), racing on the catalog row's compare-and-set."""
    with contextlib.ExitStack() as stack:
        uri = (
            f"sqlite:///{tmp_path}/c.db"
            if database == "sqlite"
            else stack.enter_context(postgres_catalog_database())
        )
        race_committers({"uri": uri, "warehouse": f"file://{tmp_path}/wh"})


def race_committers(props: dict[str, str]) -> None:
    """Three committers race; the table must end with every file once (see the test)."""
    setup = SqlCatalog("shared", **props)
    setup.create_namespace("db")
    table = setup.create_table("db.events", schema=SCHEMA)
    # request k holds every file up to cycle k, as a coordinator that has not seen any of
    # them committed would send it (the request contract: all before R is in the request)
    files: list[PendingFile] = []
    requests = []
    for cycle in range(6):
        ids = [cycle * 10, cycle * 10 + 1]
        files += pending(write(table, ids), table, batch_seq=cycle, offset=cycle)
        requests.append(request(files, {"0": cycle + 1}))
    errors: list[BaseException] = []

    def run(order: list[TableCommitRequest]) -> None:
        catalog = SqlCatalog("shared", **props)
        committer = IcebergCommitter(catalog, GROUP, max_attempts=50, retry_wait_s=0.001)
        try:
            for req in order:
                committer.commit(req)
        except BaseException as e:  # reported below; a thread cannot fail the test itself
            errors.append(e)
        finally:
            catalog.engine.dispose()

    orders = [requests, list(reversed(requests)), requests[2:] + requests[:2]]
    threads = [threading.Thread(target=run, args=(o,)) for o in orders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    expected = sorted(i for c in range(6) for i in (c * 10, c * 10 + 1))
    assert ids_in(setup) == expected
    setup.engine.dispose()


def commit_two(
    catalog: SqlCatalog, table: Table
) -> tuple[IcebergCommitter, int, TableCommitRequest, int]:
    """The group commits ids 1 (source offset 1) and 2 (offset 2); returns the committer, the
    first snapshot, the second request and its snapshot."""
    committer = IcebergCommitter(catalog, GROUP)
    first = committer.commit(
        request(pending(write(table, [1]), table), {"0": 1}, source_offsets={"t": {0: 1}})
    )
    second_req = request(
        pending(write(table, [2]), table, batch_seq=1, offset=1),
        {"0": 2},
        source_offsets={"t": {0: 2}},
    )
    second = committer.commit(second_req)
    assert first.snapshot_id is not None
    assert second.snapshot_id is not None
    return committer, first.snapshot_id, second_req, second.snapshot_id


def live_request(table: Table, ids: Sequence[int], seq: int = 2) -> TableCommitRequest:
    """A later batch of the live writer w1 (channel offset ``seq``, source offset ids+1)."""
    files = pending(write(table, ids), table, batch_seq=seq, offset=seq)
    return request(files, {"0": seq + 1}, source_offsets={"t": {0: seq + 1}})


def replay_files(table: Table, writer_id: str, ids: Sequence[int]) -> list[PendingFile]:
    """The rollback's replay batch, announced after everything else on the channel."""
    return pending(write(table, ids), table, writer=writer_id, batch_seq=0, offset=100)


def test_rollback_waits_for_its_replay_then_commits_it_once(
    catalog: SqlCatalog, table: Table
) -> None:
    """A rollback is read from the table alone (the kept state names a snapshot the branch no
    longer holds). Live files wait for the replay of the lost range; then both land in one
    snapshot, and the rolled-back batch re-read from the channel adds nothing."""
    committer, first, second_req, second = commit_two(catalog, table)
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    assert ids_in(catalog) == [1]

    rollback = committer.rollback("db.events")
    assert rollback is not None
    assert (rollback.restored_snapshot_id, rollback.lost_snapshot_id) == (first, second)
    assert (rollback.from_offsets, rollback.to_offsets) == ({"t": {0: 1}}, {"t": {0: 2}})
    state = committer.state("db.events")  # where a new writer starts: after the lost commit
    assert state is not None
    assert state.snapshot_id == second

    live = live_request(table, [3])
    with pytest.raises(RollbackPendingError, match="wait for the replay"):
        committer.commit(live)
    assert ids_in(catalog) == [1]

    both = dataclasses.replace(
        live, files=live.files + tuple(replay_files(table, rollback.writer_id, [2]))
    )
    assert committer.commit(both).data_files == 2
    assert ids_in(catalog) == [1, 2, 3]
    assert committer.rollback("db.events") is None
    assert committer.commit(second_req).snapshot_id is None  # covered: not committed twice
    assert committer.commit(both).snapshot_id is None  # the replay noticed again: covered
    assert ids_in(catalog) == [1, 2, 3]
    summary = catalog.load_table("db.events").current_snapshot().summary  # type: ignore[union-attr]
    assert summary is not None
    assert json.loads(summary[SOURCE_OFFSETS_KEY] or "{}") == {"t": {"0": 3}}


def test_a_replay_of_an_undone_rollback_is_dropped(catalog: SqlCatalog, table: Table) -> None:
    """Rolled back, then forward again before the replay was committed: the replay batch
    belongs to no pending rollback, and committing it would add its rows a second time."""
    committer, first, _, second = commit_two(catalog, table)
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    rollback = committer.rollback("db.events")
    assert rollback is not None
    catalog.load_table("db.events").manage_snapshots().set_current_snapshot(second).commit()
    assert committer.rollback("db.events") is None
    live = live_request(table, [3])
    stale = dataclasses.replace(
        live, files=live.files + tuple(replay_files(table, rollback.writer_id, [2]))
    )
    result = committer.commit(stale)
    assert (result.data_files, result.skipped_files) == (1, 1)
    assert ids_in(catalog) == [1, 2, 3]


def test_a_deeper_rollback_supersedes_the_first_replay(catalog: SqlCatalog, table: Table) -> None:
    """Rolled back twice before a replay was committed: only the second rollback's replay (the
    whole lost range) counts, the first one's would duplicate part of it."""
    committer, first, _, _ = commit_two(catalog, table)
    third = committer.commit(live_request(table, [3])).snapshot_id
    assert third is not None
    loaded = catalog.load_table("db.events")
    loaded.manage_snapshots().rollback_to_snapshot(loaded.snapshots()[1].snapshot_id).commit()
    shallow = committer.rollback("db.events")
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    deep = committer.rollback("db.events")
    assert shallow is not None
    assert deep is not None
    assert shallow.writer_id != deep.writer_id
    assert deep.from_offsets == {"t": {0: 1}}
    assert deep.to_offsets == {"t": {0: 3}}
    files = replay_files(table, shallow.writer_id, [3]) + replay_files(
        table, deep.writer_id, [2, 3]
    )
    committer.commit(request(files, {"0": 101}))
    assert ids_in(catalog) == [1, 2, 3]


def test_accepted_rollback_replays_nothing(catalog: SqlCatalog, table: Table) -> None:
    """``roll_back(replay=False)`` moves the branch and re-anchors the kept state in one
    transaction: no rollback is pending, live files commit at once, the lost batch stays
    out even when re-read."""
    committer, first, second_req, _ = commit_two(catalog, table)
    assert committer.roll_back("db.events", first, replay=False) is None
    assert ids_in(catalog) == [1]
    assert committer.commit(live_request(table, [3])).data_files == 1
    assert committer.commit(second_req).snapshot_id is None
    assert ids_in(catalog) == [1, 3]


def test_accepting_another_tools_rollback(catalog: SqlCatalog, table: Table) -> None:
    """A rollback made elsewhere is accepted by rolling back to the current snapshot."""
    committer, first, _, _ = commit_two(catalog, table)
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    assert committer.rollback("db.events") is not None
    assert committer.roll_back("db.events", None, replay=False) is None
    assert committer.commit(live_request(table, [3])).data_files == 1
    assert ids_in(catalog) == [1, 3]


def test_accepting_a_superseded_rollback_changes_nothing(catalog: SqlCatalog, table: Table) -> None:
    """The driver accepts a rollback whose range held no row only while it is still the one
    pending: a deeper rollback made meanwhile must still be replayed."""
    committer, first, _, _ = commit_two(catalog, table)
    committer.commit(live_request(table, [3]))
    shallow = committer.roll_back(
        "db.events", catalog.load_table("db.events").snapshots()[1].snapshot_id
    )
    assert shallow is not None
    deep = committer.roll_back("db.events", first)
    assert deep is not None
    kept = committer.roll_back("db.events", None, replay=False, only_if=shallow.writer_id)
    assert kept == deep
    assert committer.rollback("db.events") == deep


def test_roll_back_refuses_a_snapshot_off_the_branch(catalog: SqlCatalog, table: Table) -> None:
    committer, first, _, second = commit_two(catalog, table)
    committer.roll_back("db.events", first)
    with pytest.raises(CommitError, match="not in the history"):
        committer.roll_back("db.events", second)


def test_rollback_before_the_first_commit_is_not_history_lost(
    catalog: SqlCatalog, table: Table
) -> None:
    """Rolled back to a snapshot made before the pipeline's first commit: the table holds
    nothing of the pipeline, so the replay starts where the pipeline began; neither the
    fencing token nor the kept state make it look like expired history."""
    catalog.load_table("db.events").append(rows([100]))
    before = catalog.load_table("db.events").current_snapshot()
    assert before is not None
    committer, _, _, _ = commit_two(catalog, table)
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(
        before.snapshot_id
    ).commit()
    rollback = committer.rollback("db.events")
    assert rollback is not None
    assert rollback.restored_snapshot_id is None
    assert (rollback.from_offsets, rollback.to_offsets) == ({}, {"t": {0: 2}})
    live = live_request(table, [3])
    files = live.files + tuple(replay_files(table, rollback.writer_id, [1, 2]))
    committer.commit(dataclasses.replace(live, files=files))
    assert ids_in(catalog) == [1, 2, 3, 100]


def test_rollback_stays_pending_when_the_lost_snapshots_are_expired(
    catalog: SqlCatalog, table: Table
) -> None:
    """Expiring the rolled-back snapshots does not make the kept state look committed."""
    committer, first, _, second = commit_two(catalog, table)
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    catalog.load_table("db.events").maintenance.expire_snapshots().by_id(second).commit()
    rollback = committer.rollback("db.events")
    assert rollback is not None
    assert rollback.lost_snapshot_id == second
    with pytest.raises(RollbackPendingError):
        committer.commit(live_request(table, [3]))


@pytest.mark.parametrize("log", [True, False], ids=["metadata-log", "no-metadata-log"])
def test_a_rollback_below_a_kept_snapshot_is_no_expired_gap(
    catalog: SqlCatalog, table: Table, log: bool
) -> None:
    """The pipeline's last snapshot is kept (a tag), the table rolled back below it, another
    engine appended on top and the restored snapshot was expired: the walk down the branch
    stops at a gap, as when another engine expires snapshots between the kept one and the
    head, but the head holds no file of the kept snapshot. Still a rollback, never taken for
    an expired gap with the rolled-back rows skipped: found with the snapshot it restored
    where the table's earlier metadata files still link the head to it (its files then wait
    for the replay from that snapshot's offsets), refused as not replayable where they are
    gone (``write.metadata.delete-after-commit``, here deleted by hand)."""
    committer, first, _, second = commit_two(catalog, table)
    with catalog.load_table("db.events").manage_snapshots() as refs:
        refs.create_tag(second, "kept")
    catalog.load_table("db.events").manage_snapshots().rollback_to_snapshot(first).commit()
    catalog.load_table("db.events").append(rows([100]))
    catalog.load_table("db.events").maintenance.expire_snapshots().by_id(first).commit()
    if log:
        rollback = committer.rollback("db.events")
        assert rollback is not None
        assert (rollback.restored_snapshot_id, rollback.lost_snapshot_id) == (first, second)
        assert rollback.ranges() == [ReplayRange("t", 0, 1, 2)]
        with pytest.raises(RollbackPendingError, match=rollback.writer_id):
            committer.commit(live_request(table, [3]))
    else:
        for entry in catalog.load_table("db.events").metadata.metadata_log:
            Path(entry.metadata_file.removeprefix("file://")).unlink()
        with pytest.raises(RollbackNotReplayableError, match=f"snapshot {second}"):
            committer.commit(live_request(table, [3]))
    assert ids_in(catalog) == [1, 100]


def commit_then_expire(
    catalog: SqlCatalog, table: Table, keep_state_property: bool = True
) -> tuple[IcebergCommitter, TableCommitRequest, int]:
    """The group commits once, two foreign appends follow, then the group's snapshot is
    expired: no snapshot of the group is left in the history."""
    committer = IcebergCommitter(catalog, GROUP)
    req = request(pending(write(table, [1]), table), {"0": 1})
    ours = committer.commit(req).snapshot_id
    assert ours is not None
    for i in range(2):
        catalog.load_table("db.events").append(rows([100 + i]))
    if not keep_state_property:
        loaded = catalog.load_table("db.events")
        loaded.transaction().remove_properties(state_property(GROUP, "main")).commit_transaction()
    catalog.load_table("db.events").maintenance.expire_snapshots().by_id(ours).commit()
    assert catalog.load_table("db.events").metadata.snapshot_by_id(ours) is None
    return committer, req, ours


def test_expired_own_history_without_kept_state_is_refused(
    catalog: SqlCatalog, table: Table
) -> None:
    """Tables committed before the state was kept in a property: refuse rather than guess."""
    committer, req, _ = commit_then_expire(catalog, table, keep_state_property=False)
    with pytest.raises(CommitHistoryLostError, match="expired"):
        committer.commit(req)
    with pytest.raises(CommitHistoryLostError):
        committer.state("db.events")
    assert ids_in(catalog) == [1, 100, 101]


def test_expired_own_history_keeps_its_boundary_in_table_properties(
    catalog: SqlCatalog, table: Table
) -> None:
    """Expiring every snapshot of the group loses no dedupe boundary: the copy written to the
    table property in the same transaction takes over, so a replay adds nothing and new
    batches still commit."""
    committer, req, ours = commit_then_expire(catalog, table)
    state = committer.state("db.events")
    assert state is not None
    assert state.snapshot_id == ours
    assert state.positions == {"0": 1}
    assert state.watermarks == {"w1": 0}
    replay = committer.commit(req)
    assert replay.snapshot_id is None
    assert replay.skipped_files == 1
    later = committer.commit(
        request(pending(write(table, [2]), table, batch_seq=1, offset=1), {"0": 2})
    )
    assert later.data_files == 1
    assert ids_in(catalog) == [1, 2, 100, 101]


def test_expired_foreign_history_alone_is_fine(catalog: SqlCatalog, table: Table) -> None:
    """A group that never committed here is not confused by a history cut short."""
    for i in range(2):
        catalog.load_table("db.events").append(rows([100 + i]))
    first = catalog.load_table("db.events").snapshots()[0]
    catalog.load_table("db.events").maintenance.expire_snapshots().by_id(first.snapshot_id).commit()
    IcebergCommitter(catalog, GROUP).commit(request(pending(write(table, [1]), table), {"0": 1}))
    assert ids_in(catalog) == [1, 100, 101]


# --- cost that must not grow with the files of a commit ---------------------------------


def test_commit_reads_transaction_metadata_a_fixed_number_of_times(
    catalog: SqlCatalog, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyiceberg rebuilds (deep-copies) a transaction's metadata on every read: a read per file
    made a 10,000-file commit take seconds, growing with the table's history."""
    from pyiceberg.table import Transaction

    reads: list[int] = []
    original = Transaction.table_metadata

    def counted(tx: Transaction) -> Any:
        reads.append(1)
        return original.fget(tx)  # type: ignore[attr-defined]

    monkeypatch.setattr(Transaction, "table_metadata", property(counted))

    def reads_for(files: int, seq: int) -> int:
        [meta] = write(table, [seq])
        copies = []
        for i in range(files):  # distinct paths of one real file (hard links)
            path = meta.path.replace(".parquet", f"-{i}.parquet")
            Path(path.removeprefix("file://")).hardlink_to(meta.path.removeprefix("file://"))
            copies.append(dataclasses.replace(meta, path=path))
        reads.clear()
        IcebergCommitter(catalog, GROUP).commit(
            request(pending(copies, table, batch_seq=seq, offset=seq), {"0": seq + 1})
        )
        return len(reads)

    reads_for(1, 0)  # the table's first snapshot: later commits all have a parent
    few, many = reads_for(2, 1), reads_for(200, 2)
    assert many == few, f"metadata read {few} times for 2 files, {many} times for 200"
    assert ids_in(catalog) == [0] + [1] * 2 + [2] * 200


def test_consecutive_commits_do_not_decode_their_own_manifests_again(
    catalog: SqlCatalog, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The already-committed-path check reads the branch head's manifests; the manifest a
    commit just wrote holds exactly its files, so decoding it on the next commit doubled the
    cost of every commit."""
    from pyiceberg.manifest import ManifestFile

    decoded: list[str] = []
    original = ManifestFile.fetch_manifest_entry

    def counted(self: ManifestFile, *args: Any, **kwargs: Any) -> Any:
        decoded.append(self.manifest_path)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ManifestFile, "fetch_manifest_entry", counted)
    committer = IcebergCommitter(catalog, GROUP)
    for seq in range(4):
        files = pending(write(table, [seq]), table, batch_seq=seq, offset=seq)
        assert committer.commit(request(files, {"0": seq + 1})).data_files == 1
    assert decoded == [], f"decoded {len(decoded)} manifests the committer wrote itself"
    assert ids_in(catalog) == [0, 1, 2, 3]


def test_commits_after_a_manifest_merge_do_not_decode_the_merged_manifest(
    catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With manifest merging on, pyiceberg now and then rewrites older manifests into one; the
    next commit's live-path check decoded that whole merged manifest (1.7 s after a merge of
    41,000 entries in bench_coordinator's 50-cycle run). Its content is the union of the
    manifests it replaced, which the committer has cached; and that union must be right:
    a file committed before the merge and announced again afterwards is still skipped."""
    table = catalog.create_table(
        "db.events",
        schema=SCHEMA,
        properties={
            TableProperties.MANIFEST_MERGE_ENABLED: "true",
            TableProperties.MANIFEST_TARGET_SIZE_BYTES: "12000",  # a merge every few commits
        },
    )
    decoded: list[str] = []
    original = LiveFiles._decode_live

    def counted(table: Table, manifest: Any) -> frozenset[str]:
        decoded.append(manifest.manifest_path)
        return original(table, manifest)

    monkeypatch.setattr(LiveFiles, "_decode_live", staticmethod(counted))
    committer = IcebergCommitter(catalog, GROUP)
    first: list[DataFileMeta] = []
    for seq in range(12):
        metas = write(table, [seq])
        first = first or metas
        files = pending(metas, table, batch_seq=seq, offset=seq)
        assert committer.commit(request(files, {"0": seq + 1})).data_files == 1
    head = catalog.load_table("db.events").current_snapshot()
    assert head is not None
    merged = [m for m in head.manifests(table.io) if m.existing_files_count]
    assert merged, "the test's table properties made no merge: nothing was tested"
    assert decoded == [], f"decoded {len(decoded)} manifests after merges"
    again = pending(first, table, writer="w2", offset=20)
    assert committer.commit(request(again, {"0": 21})).snapshot_id is None
    assert ids_in(catalog) == list(range(12))


def test_a_side_file_already_written_with_its_content_is_not_rewritten(table: Table) -> None:
    """Another run of the same commit (a Spark commit task's speculative copy) may have landed
    a snapshot naming the side file: rewriting it in place would show readers a partial file
    (for good if killed mid-write). A partial file of a run that died is replaced."""
    location = f"{table.location()}/metadata/icefloe-applied-test.json"
    path = Path(location.removeprefix("file://"))
    content = b'{"keys": ["a"]}'
    _write_side_file(table, location, content)
    before = path.stat()
    _write_side_file(table, location, content)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    path.write_bytes(content[:5])  # a run killed mid-write
    _write_side_file(table, location, content)
    assert path.read_bytes() == content
