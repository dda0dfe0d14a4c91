"""Compaction of upsert/CDC and append tables against a real SqlCatalog with real files.

Upsert cycles are committed by the real committer (key files resolved into position deletes);
the tables are read twice: by pyiceberg's scan, and by a reader that shares no code with
pyiceberg or icefloe (fastavro over the manifest list and manifests, pyarrow over the data
files minus the rows their position delete files name). Both must equal the model: the last
value written per key.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Operation
from pyiceberg.transforms import BucketTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit.applied import PRUNE_CHECKS, with_removed
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.compaction import (
    COMPACTED_DELETE_FILES_KEY,
    COMPACTED_FILES_KEY,
    Compactor,
    Thresholds,
)
from icefloe.commit.dedupe import CommitBoundary, decode_applied
from icefloe.commit.livefiles import LiveFiles
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.summary import GROUP_ID_KEY
from icefloe.ops.maintenance import expire_snapshots
from icefloe.records.datafiles import write_data_files, write_key_files
from icefloe.testing.readers import independent_rows, live_files, local, read_avro

GROUP = "pipe-c"
NAME = "db.kv"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "v", StringType(), required=False),
    identifier_field_ids=[1],
)
BY_BUCKET = PartitionSpec(PartitionField(1, 1000, BucketTransform(4), "id_bucket"))
EAGER = Thresholds(delete_ratio=0.01, delete_files=2, small_files=2)


@pytest.fixture
def catalog(sqlite_catalog: SqlCatalog) -> SqlCatalog:
    sqlite_catalog.create_namespace("db")
    return sqlite_catalog


class Keyed:
    """Drives upsert cycles through the real committer and keeps the model (id -> value)."""

    def __init__(self, catalog: SqlCatalog, name: str = NAME, **committer: Any) -> None:
        self.catalog = catalog
        self.name = name
        self.model: dict[int, str] = {}
        self.committer = IcebergCommitter(catalog, GROUP, **committer)
        self.requests: list[TableCommitRequest] = []
        self._seq = itertools.count()

    def cycle(
        self, upserts: dict[int, str], deletes: tuple[int, ...] = (), writer: str = "w"
    ) -> TableCommitRequest:
        table = self.catalog.load_table(self.name)
        seq = next(self._seq)
        metas = []
        if upserts:
            rows = pa.table(
                {
                    "id": pa.array(list(upserts), pa.int64(), from_pandas=False),
                    "v": pa.array(list(upserts.values()), pa.string()),
                },
                schema=pa.schema([pa.field("id", pa.int64(), False), pa.field("v", pa.string())]),
            )
            metas += write_data_files(table, rows)
        keys = [*upserts, *deletes]
        metas += write_key_files(table, pa.table({"id": pa.array(keys, pa.int64())}))
        uid = str(table.metadata.table_uuid)
        files = tuple(PendingFile(m, writer, seq, "0", seq, uid) for m in metas)
        request = TableCommitRequest(
            table=self.name,
            commit_id=str(uuid.uuid4()),
            files=files,
            positions={"0": seq + 1},
            source_offsets={},
            fencing_token=1,
        )
        self.committer.commit(request)
        self.requests.append(request)
        self.model.update(upserts)
        for k in deletes:
            self.model.pop(k, None)
        return request

    def random_cycle(self, rng: random.Random, keys: int, changes: int) -> None:
        picked = rng.sample(range(keys), changes)
        cut = changes // 4
        self.cycle({k: f"v{rng.random():.6f}" for k in picked[cut:]}, tuple(picked[:cut]))

    def expected(self) -> list[tuple[int, str]]:
        return sorted(self.model.items())

    def check(self) -> None:
        """pyiceberg's scan and the independent reader both equal the model."""
        table = self.catalog.load_table(self.name)
        scanned = sorted((r["id"], r["v"]) for r in table.scan().to_arrow().to_pylist())
        assert scanned == self.expected()
        assert sorted(independent_rows(table, ("id", "v"))) == self.expected()


def compactor(catalog: SqlCatalog, **options: Any) -> Compactor:
    return Compactor(GROUP, catalog.load_table, lambda _: "main", **options)


@pytest.mark.parametrize("spec", [PartitionSpec(), BY_BUCKET], ids=["unpartitioned", "bucket"])
def test_compaction_applies_deletes_in_one_replace_snapshot(
    catalog: SqlCatalog, spec: PartitionSpec
) -> None:
    catalog.create_table(NAME, schema=SCHEMA, partition_spec=spec)
    keyed = Keyed(catalog)
    rng = random.Random(7)
    keyed.cycle({k: "v0" for k in range(200)})
    for _ in range(6):
        keyed.random_cycle(rng, 260, 40)
    keyed.check()
    table = catalog.load_table(NAME)
    data_before, deletes_before = live_files(table)
    assert deletes_before
    snapshots = len(table.snapshots())

    result = compactor(catalog).compact(NAME, EAGER)

    table = catalog.load_table(NAME)
    assert len(table.snapshots()) == snapshots + 1
    head = table.current_snapshot()
    assert head is not None
    assert head.summary is not None
    assert head.summary.operation.value == "replace"
    assert head.summary[COMPACTED_FILES_KEY] == str(result.rewritten_files)
    assert head.summary[COMPACTED_DELETE_FILES_KEY] == str(len(deletes_before))
    assert head.summary["deleted-data-files"] == str(len(data_before))
    assert head.summary["removed-delete-files"] == str(len(deletes_before))
    data_after, deletes_after = live_files(table)
    assert deletes_after == []
    assert 1 <= len(data_after) <= (4 if spec.fields else 1)
    keyed.check()
    # the rows of each new file are sorted by the key, so its bounds are tight
    for path in data_after:
        ids = pq.read_table(local(path), columns=["id"])["id"].to_pylist()
        assert ids == sorted(ids)
    # nothing was deleted from storage: the old snapshot still reads
    for path in data_before + deletes_before:
        assert Path(local(path)).exists()
    # one delete manifest at most (merged), none needed here
    manifests = read_avro(head.manifest_list)
    assert [m for m in manifests if m["content"] == 1 and m["existing_files_count"]] == []
    # later cycles resolve against the compacted files
    keyed.random_cycle(rng, 260, 40)
    keyed.check()


def test_only_partitions_that_need_it_are_rewritten(catalog: SqlCatalog) -> None:
    catalog.create_table(NAME, schema=SCHEMA, partition_spec=BY_BUCKET)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(400)})
    table = catalog.load_table(NAME)
    in_bucket = [k for k in range(400) if _bucket(table, k) == 0]
    for n in range(3):  # deletes in bucket 0 only
        keyed.cycle({k: f"v{n + 1}" for k in in_bucket[n * 10 : n * 10 + 10]})
    before, _ = live_files(catalog.load_table(NAME))

    result = compactor(catalog).compact(NAME, Thresholds(delete_ratio=1.0, delete_files=2))

    assert result.partitions == 1
    after, deletes = live_files(catalog.load_table(NAME))
    assert deletes == []
    untouched = set(before) & set(after)
    assert len(untouched) == 3  # the seed's files of buckets 1-3
    keyed.check()


def _bucket(table: Table, key: int) -> int:
    transform = BucketTransform(4).pyarrow_transform(LongType())
    return int(transform(pa.array([key], pa.int64()))[0].as_py())


@pytest.mark.parametrize("force", [False, True], ids=["past-a-threshold", "forced"])
def test_partitions_of_an_older_spec_are_rewritten_into_the_current_one(
    catalog: SqlCatalog, force: bool
) -> None:
    """After the spec evolved, the old spec's files (and the deletes on them) moved into the
    current spec's partitions when their partition passed a threshold or the round was
    forced (`icefloe maintain --compact`); they were never compacted before."""
    catalog.create_table(NAME, schema=SCHEMA)  # unpartitioned: spec 0
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(200)})
    keyed.cycle({k: "v1" for k in range(0, 200, 5)})
    with catalog.load_table(NAME).update_spec() as update:
        update.add_field("id", BucketTransform(4), "id_bucket")
    keyed.cycle({k: "v2" for k in range(0, 200, 7)}, deletes=(3, 4))
    table = catalog.load_table(NAME)
    current = table.metadata.default_spec_id
    assert {t.file.spec_id for t in table.scan().plan_files()} == {0, current}
    # forced: no threshold passes, so only the older spec makes the round do anything
    thresholds = Thresholds(delete_ratio=1.0, delete_files=99, small_files=99) if force else EAGER

    result = compactor(catalog).compact(NAME, thresholds, force=force)

    assert result.snapshot_id is not None
    table = catalog.load_table(NAME)
    assert {t.file.spec_id for t in table.scan().plan_files()} == {current}
    assert live_files(table)[1] == []  # the deletes on the old files went with them
    keyed.check()
    keyed.random_cycle(random.Random(3), 260, 40)  # later cycles resolve against them
    keyed.check()


def test_a_round_reads_files_written_before_a_schema_change_in_the_current_schema(
    catalog: SqlCatalog,
) -> None:
    """A round reads each file whole, projected onto the current schema by field id, and
    drops its deleted positions itself: a renamed column keeps its values, an added one is
    null, the deleted rows stay out."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(50)})
    keyed.cycle({k: "v1" for k in range(0, 50, 3)}, deletes=(1, 2))
    with catalog.load_table(NAME).update_schema() as update:
        update.add_column("extra", LongType())
        update.rename_column("v", "value")

    assert compactor(catalog).compact(NAME, EAGER).snapshot_id is not None

    table = catalog.load_table(NAME)
    data, deletes = live_files(table)
    assert deletes == []
    scanned = sorted((r["id"], r["value"], r["extra"]) for r in table.scan().to_arrow().to_pylist())
    assert scanned == [(k, v, None) for k, v in keyed.expected()]
    assert sorted(independent_rows(table, ("id", "value"))) == keyed.expected()
    for path in data:
        assert pq.read_schema(local(path)).names == ["id", "value", "extra"]


def test_below_thresholds_nothing_is_committed(catalog: SqlCatalog) -> None:
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(100)})
    keyed.cycle({1: "v1"})
    snapshots = len(catalog.load_table(NAME).snapshots())
    result = compactor(catalog).compact(NAME, Thresholds())
    assert result.snapshot_id is None
    assert len(catalog.load_table(NAME).snapshots()) == snapshots


def test_a_cycle_after_an_external_rewrite_resolves_against_the_new_files(
    catalog: SqlCatalog,
) -> None:
    """Another engine rewrites the table (pyiceberg's overwrite: every data file replaced,
    the position delete files left dangling) after the committer loaded the table and before
    it commits: the commit must fail on the moved branch and resolve its keys again against
    the new files, or the update would delete rows of files that are gone and the old image
    of its keys would come back."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(50)})
    keyed.cycle({k: "v1" for k in range(0, 50, 5)})
    rewritten = threading.Event()

    def external_rewrite() -> None:
        if rewritten.is_set():
            return
        rewritten.set()
        table = catalog.load_table(NAME)
        table.overwrite(table.scan().to_arrow())

    keyed.committer = IcebergCommitter(
        catalog, GROUP, before_commit=external_rewrite, retry_wait_s=0.001
    )
    keyed.cycle({k: "v2" for k in range(0, 50, 2)}, deletes=(3, 9))
    assert rewritten.is_set()
    keyed.check()
    # the rewrite left delete files that target nothing: compaction drops them
    assert live_files(catalog.load_table(NAME))[1]
    compactor(catalog).compact(NAME, EAGER)
    assert live_files(catalog.load_table(NAME))[1] == []
    keyed.check()


def test_a_compaction_planned_on_an_older_head_commits_nothing(catalog: SqlCatalog) -> None:
    """A live cycle lands after the compaction read the table: the compaction must fail (its
    rewrite would bring back the rows the cycle replaced) and the next round redo it."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(50)})
    keyed.cycle({k: "v1" for k in range(10)})

    def cycle_meanwhile(_: str) -> None:
        keyed.cycle({k: "v2" for k in range(5)}, deletes=(40,))

    racing = compactor(catalog, after_write=cycle_meanwhile)
    assert racing.compact(NAME, EAGER).snapshot_id is None
    keyed.check()
    assert compactor(catalog).compact(NAME, EAGER).snapshot_id is not None
    keyed.check()


def test_a_compacted_file_announced_again_is_not_committed_again(catalog: SqlCatalog) -> None:
    """A batch announced again under a fresh writer id (a restart that lost its checkpoint)
    after compaction rewrote its files: the head no longer lists them, yet they were
    committed; committing them again would duplicate rows (and re-apply old images)."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(20)})
    first = keyed.cycle({1: "v1", 2: "v1"})
    keyed.cycle({1: "v2"})
    assert compactor(catalog).compact(NAME, EAGER).snapshot_id is not None
    assert announce_again(keyed, first) is None
    keyed.check()


def announce_again(keyed: Keyed, request: TableCommitRequest) -> int | None:
    """``request``'s files committed again under a fresh writer id; the snapshot it made."""
    again = tuple(
        PendingFile(f.meta, "w-restarted", 0, "0", 100 + i, f.table_uuid)
        for i, f in enumerate(request.files)
    )
    return keyed.committer.commit(
        TableCommitRequest(
            table=NAME,
            commit_id="again",
            files=again,
            positions={"0": 200},
            source_offsets={},
            fencing_token=1,
        )
    ).snapshot_id


def test_a_file_another_engine_rewrote_announced_again_is_not_committed_again(
    catalog: SqlCatalog,
) -> None:
    """As above, but another engine rewrote the files (an overwrite with the same rows, as
    its compaction or a copy-on-write rewrite does): the head no longer lists them and no
    icefloe compaction recorded them, yet they were committed."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(20)})
    first = keyed.cycle({1: "v1", 2: "v1"})
    keyed.cycle({1: "v2"})
    table = catalog.load_table(NAME)
    table.overwrite(table.scan().to_arrow())
    keyed.check()  # the rewrite changed no row
    announce_again(keyed, first)
    keyed.check()


def head_view(table: Table) -> tuple[Any, ...]:
    """What readers see of the head snapshot: operation, sequence number, summary (icefloe's
    own properties and byte sizes aside: delete files hold paths, which differ), and per
    manifest its kind, spec, counts and entries."""
    head = table.current_snapshot()
    assert head is not None
    assert head.summary is not None
    summary = {
        k: v
        for k, v in head.summary.additional_properties.items()
        if not k.startswith("icefloe") and not k.endswith("files-size")
    }
    manifests = sorted(
        (
            m.content,
            m.partition_spec_id,
            m.sequence_number,
            (m.added_files_count, m.existing_files_count, m.deleted_files_count),
            sorted(
                (e.status.value, e.sequence_number, e.data_file.content, e.data_file.record_count)
                for e in m.fetch_manifest_entry(table.io, discard_deleted=False)
            ),
        )
        for m in head.manifests(table.io)
    )
    return head.summary.operation, head.sequence_number, summary, manifests


def test_a_row_delta_makes_what_pyiceberg_makes_without_its_transaction(
    catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upserts, deletes and delete-only cycles on a partitioned keyed table: the committer's
    row delta (built like the plain append, without pyiceberg's transaction, whose deep copies
    of the metadata grew with the snapshot history) gives, snapshot by snapshot, the manifests,
    sequence numbers, summary totals and rows of the row delta through pyiceberg's producer."""
    from icefloe.commit import fastappend

    for name in ("db.ours", "db.ref"):
        catalog.create_table(name, schema=SCHEMA, partition_spec=BY_BUCKET)
    ours, ref = Keyed(catalog, "db.ours"), Keyed(catalog, "db.ref")
    transactions: list[str] = []
    opened = Table.transaction

    def transaction(self: Table) -> Any:
        transactions.append(".".join(self.name()))
        return opened(self)

    monkeypatch.setattr(Table, "transaction", transaction)
    applicable = fastappend.applicable
    monkeypatch.setattr(
        fastappend,
        "applicable",
        lambda table, *a: table.name() != ("db", "ref") and applicable(table, *a),
    )
    rng = random.Random(5)
    steps = [({k: "v0" for k in range(40)}, ())] + [
        ({k: f"v{n}" for k in rng.sample(range(60), 8)}, tuple(rng.sample(range(60), 3)))
        for n in range(1, 5)
    ]
    steps.append(({}, (1, 2, 3)))  # delete-only
    for upserts, deletes in steps:
        ours.cycle(upserts, deletes)
        ref.cycle(upserts, deletes)
        assert head_view(catalog.load_table("db.ours")) == head_view(catalog.load_table("db.ref"))
        ours.check()
        ref.check()
    assert "db.ours" not in transactions
    assert "db.ref" in transactions


def test_a_file_whose_rows_another_engine_deleted_announced_again_is_not_committed_again(
    catalog: SqlCatalog,
) -> None:
    """Another engine deletes rows of the pipeline's batch (copy-on-write: the batch's file
    leaves the head). Announced again, the file was committed once: the deleted rows must
    not come back, nor its upserted values."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(20)})
    first = keyed.cycle({1: "v1", 2: "v1"})
    keyed.cycle({1: "v2"})
    catalog.load_table(NAME).delete("id == 2")
    keyed.model.pop(2)
    keyed.check()
    assert announce_again(keyed, first) is None
    keyed.check()


def test_a_removal_is_found_after_the_snapshots_that_added_the_files_expired(
    catalog: SqlCatalog,
) -> None:
    """The pipeline's snapshots that added the files are expired, the other engine's rewrite
    that took them off the head is kept: it alone tells that they were committed (it is
    newer than what it removed, so it outlives it)."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(20)})
    first = keyed.cycle({1: "v1", 2: "v1"})
    table = catalog.load_table(NAME)
    table.overwrite(table.scan().to_arrow())
    keyed.cycle({1: "v2"})  # the pipeline's state lives on above the rewrite
    table = catalog.load_table(NAME)
    adders = [s.snapshot_id for s in table.snapshots()[:2]]
    table.maintenance.expire_snapshots().by_ids(adders).commit()
    assert announce_again(keyed, first) is None
    keyed.check()


@pytest.mark.parametrize("rewrite", ["compaction", "other engine"])
def test_a_rewritten_file_announced_again_after_maintain_expired_the_rewrite_is_held(
    catalog: SqlCatalog, rewrite: str
) -> None:
    """Issue 23: the pipeline's compaction (or another engine's rewrite) takes a committed
    file off the branch, the pipeline commits above it, and ``icefloe maintain``'s expiry,
    which keeps only the chain down to the pipeline's newest snapshot, expires the rewrite.
    The file is still in storage (an uncommitted batch announces it: maintain spares it), and
    announced again under a fresh writer id it was committed a second time: nothing retained
    named it. The commit above the rewrite lists what it took off."""
    catalog.create_table(NAME, schema=SCHEMA)
    committer = IcebergCommitter(catalog, GROUP)

    def append(ids: range, writer: str, seq: int, files: Any = None) -> TableCommitRequest:
        table = catalog.load_table(NAME)
        if files is None:
            rows = pa.table({"id": pa.array(ids, pa.int64()), "v": pa.array(["v"] * len(ids))})
            files = write_data_files(table, rows)
        uid = str(table.metadata.table_uuid)
        request = TableCommitRequest(
            table=NAME,
            commit_id=str(uuid.uuid4()),
            files=tuple(
                PendingFile(m, writer, seq, "0", 10 * seq + i, uid) for i, m in enumerate(files)
            ),
            positions={"0": 10 * seq + 10},
            source_offsets={},
            fencing_token=1,
        )
        committer.commit(request)
        return request

    first = append(range(0, 5), "w", 0)
    append(range(5, 10), "w", 1)
    if rewrite == "compaction":
        removed_by = compactor(catalog).compact(NAME, EAGER).snapshot_id
    else:
        table = catalog.load_table(NAME)
        table.overwrite(table.scan().to_arrow())
        removed_by = catalog.load_table(NAME).snapshots()[-1].snapshot_id
    append(range(10, 12), "w", 2)  # the pipeline commits above the rewrite
    expiry = expire_snapshots(catalog.load_table(NAME), int(time.time() * 1000) + 60_000)
    assert removed_by in expiry.expired
    again = [f.meta for f in first.files]
    assert all(Path(local(m.path)).exists() for m in again)
    append(range(0), "w-restarted", 9, again)  # past every recorded position
    ids = [r["id"] for r in catalog.load_table(NAME).scan().to_arrow().to_pylist()]
    assert sorted(ids) == list(range(12))


def test_rewritten_files_stay_listed_while_in_storage(catalog: SqlCatalog) -> None:
    """The list of rewritten files stays bounded: each commit that lists new ones looks up as
    many listed ones again (round the list), and drops those gone from storage."""
    catalog.create_table(NAME, schema=SCHEMA)
    table = catalog.load_table(NAME)
    rows = pa.table({"id": pa.array(range(40), pa.int64()), "v": pa.array(["x"] * 40)})
    paths = [m.path for k in range(40) for m in write_data_files(table, rows.slice(k, 1))]
    boundary, side = with_removed(table, CommitBoundary(), paths[:30])
    assert side is not None
    assert boundary.applied.removed == tuple(sorted(paths[:30]))
    assert all(p in boundary.applied for p in paths[:30])
    listed = boundary.applied.removed
    for p in listed[:5]:  # deleted as orphans once their removal expired
        Path(local(p)).unlink()
    boundary, side = with_removed(table, boundary, paths[30:])
    assert side is not None
    looked_up = PRUNE_CHECKS + 2 * 10
    kept = listed[looked_up:] + listed[5:looked_up]
    assert boundary.applied.removed == kept + tuple(sorted(paths[30:]))
    assert with_removed(table, boundary, paths[30:]) == (boundary, None)  # nothing new
    assert decode_applied(side[1]) == boundary.applied


def test_only_snapshots_that_may_remove_files_are_read(
    catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cycle looks beyond the head for its new files, over the whole history: it reads
    no snapshot of the pipeline (appends, and row deltas, which Iceberg names overwrites)
    and no append of another engine, and each removal once per committer."""
    spy = mock.Mock(side_effect=LiveFiles._decode_removed)
    monkeypatch.setattr(LiveFiles, "_decode_removed", spy)
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    keyed.cycle({k: "v0" for k in range(20)})
    keyed.cycle({1: "v1"}, deletes=(3,))
    assert spy.call_count == 0
    table = catalog.load_table(NAME)
    table.overwrite(table.scan().to_arrow())  # a delete and an append
    for n in range(3):
        keyed.cycle({5: f"v{n}"})
    table = catalog.load_table(NAME)
    summaries = [(s.snapshot_id, s.summary) for s in table.snapshots() if s.summary is not None]
    removals = [i for i, s in summaries if s.operation == Operation.DELETE]
    assert len(removals) == 1  # the rest: appends, and the pipeline's row deltas (overwrites)
    assert {s[GROUP_ID_KEY] for _, s in summaries if s.operation == Operation.OVERWRITE} == {GROUP}
    # read once, by the first cycle after it
    assert [c.args[1].snapshot_id for c in spy.call_args_list] == removals


def test_random_cycles_with_compaction_rounds_equal_the_model(catalog: SqlCatalog) -> None:
    catalog.create_table(NAME, schema=SCHEMA, partition_spec=BY_BUCKET)
    keyed = Keyed(catalog)
    rng = random.Random(11)
    rounds = compactor(catalog)
    keyed.cycle({k: "v0" for k in range(300)})
    for n in range(12):
        keyed.random_cycle(rng, 400, 30)
        if n % 3 == 2:
            rounds.compact(NAME, EAGER)
        keyed.check()
    _, deletes = live_files(catalog.load_table(NAME))
    assert len(deletes) <= 4 * 2


def test_a_round_writes_files_of_at_most_max_file_rows_rows(catalog: SqlCatalog) -> None:
    """pyiceberg applies a file's position deletes per batch against all of that file's
    deleted positions, so a big compacted file makes the next cycle's deletes slow to read:
    a round writes files of at most ``max_file_rows`` rows (key ranges, in key order), and
    such a file is not small, so the next round leaves them alone."""
    catalog.create_table(NAME, schema=SCHEMA)
    keyed = Keyed(catalog)
    rng = random.Random(5)
    keyed.cycle({k: "v0" for k in range(450)})
    keyed.random_cycle(rng, 450, 40)
    capped = Thresholds(delete_ratio=0.01, delete_files=2, small_files=2, max_file_rows=100)

    result = compactor(catalog).compact(NAME, capped)

    assert result.snapshot_id is not None
    data, deletes = live_files(catalog.load_table(NAME))
    assert deletes == []
    ids = [pq.read_table(local(p), columns=["id"])["id"].to_pylist() for p in data]
    assert sorted(len(i) for i in ids) == sorted(
        [100] * (len(keyed.model) // 100) + [len(keyed.model) % 100]
    )
    assert sorted(k for i in ids for k in i) == sorted(keyed.model)
    for i in ids:
        assert i == sorted(i)
    keyed.check()
    again = compactor(catalog).compact(NAME, capped)
    assert again.snapshot_id is None  # one remainder file is small, the full ones are not


def _file(path: str, size: int, content: Any = None, bounds: tuple[str, str] | None = None) -> Any:
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    from icefloe.commit.rowdelta import FILE_PATH_FIELD_ID

    f = DataFile.from_args(
        content=content or DataFileContent.DATA,
        file_path=path,
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=100,
        file_size_in_bytes=size,
        lower_bounds=None if bounds is None else {FILE_PATH_FIELD_ID: bounds[0].encode()},
        upper_bounds=None if bounds is None else {FILE_PATH_FIELD_ID: bounds[1].encode()},
    )
    f.spec_id = 0
    return f


@pytest.mark.parametrize(
    ("bounds", "rewritten"),
    [
        (("s3://b/a.parquet", "s3://b/a.parquet"), ["s3://b/a.parquet"]),
        (("s3://b/a.parquet", "s3://b/c.parquet"), ["s3://b/a.parquet", "s3://b/b.parquet"]),
        (None, ["s3://b/a.parquet", "s3://b/b.parquet"]),
        (("s3://b/x.parquet", "s3://b/z.parquet"), []),  # targets nothing live
    ],
    ids=["one-target", "range", "no-bounds", "dangling"],
)
def test_a_delete_file_goes_only_with_every_file_it_may_target(
    bounds: tuple[str, str] | None, rewritten: list[str]
) -> None:
    """Big files (not small) are rewritten only when the delete file's path bounds say it
    may target them; the delete file is then dropped, as no file left can be its target."""
    from pyiceberg.manifest import DataFileContent
    from pyiceberg.table import FileScanTask

    from icefloe.commit.compaction import PartitionState, plan_rewrite

    big = 100 * 1024 * 1024
    delete = _file("s3://b/d.parquet", 10, DataFileContent.POSITION_DELETES, bounds)
    part = PartitionState(
        (0, ()),
        [FileScanTask(_file(p, big)) for p in ("s3://b/a.parquet", "s3://b/b.parquet")],
        {delete.file_path: delete},
    )
    thresholds = Thresholds(target_file_size_bytes=128 * 1024 * 1024)
    chosen, drop = plan_rewrite(part, thresholds, current_spec=0)
    assert [t.file.file_path for t in chosen] == rewritten
    assert drop == [delete]
    # a partition of an older spec moves whole, and takes every delete file with it
    chosen, drop = plan_rewrite(part, thresholds, current_spec=1)
    assert [t.file.file_path for t in chosen] == ["s3://b/a.parquet", "s3://b/b.parquet"]
    assert drop == [delete]
