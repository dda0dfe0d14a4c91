"""The warehouse on an S3-compatible object store (moto's server mode, a real HTTP S3 API with
signature checks; see :mod:`icefloe.testing.objectstore`): real coordinators, a real SQLite
catalog and real Parquet files in a bucket, with merging, quarantine, upserts, ``s3a://``
aliases and ``icefloe maintain``. Rows are counted by pyarrow reading the objects itself
(:meth:`S3Store.read_ids`), never by the committer."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator, Mapping

import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.io.pyarrow import PyArrowFileIO

from icefloe.commit.compaction import Compactor, Thresholds
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.quarantine import Quarantine
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataFileMeta
from icefloe.ops.fileio import StatusFileIO, status_properties
from icefloe.ops.maintenance import expire_snapshots, remove_orphan_files
from icefloe.ops.status import table_status
from icefloe.testing.fixtures import (
    KEYED_ROWS_SCHEMA,
    ROWS_SCHEMA,
    commit_changes,
    create_rows_table,
    quarantine_entry,
    rows_table,
    write_rows,
)
from icefloe.testing.harness import Pipe, RowSource, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer
from icefloe.testing.objectstore import PAGE_SIZE, S3Store, doctor_storage

MERGED, PLAIN, KEYED = "db.merged", "db.plain", "db.keyed"


@pytest.fixture
def catalog(s3_catalog_properties: Mapping[str, str]) -> Catalog:
    return load_catalog("s3test", **s3_catalog_properties)


@pytest.fixture
def pipe(memory_server: MemoryServer, catalog: Catalog) -> Iterator[Pipe]:
    group_id = f"pipe-{uuid.uuid4().hex[:8]}"
    source = RowSource.create(catalog, [MERGED, PLAIN], rows_per_table=10)
    policies = TablePolicies(TablePolicy(), {MERGED: TablePolicy(merge_small_files=True)})
    settings = CoordinatorSettings(3600.0, 30.0, policies=policies)
    p = Pipe.open(MemoryBackend(memory_server, group_id, 1.0), catalog, group_id, source, settings)
    yield p
    p.writer.close()


def objects(store: S3Store, catalog: Catalog, table: str) -> set[str]:
    """Every object under the table's data directory, as ``s3://bucket/key`` (not the empty
    directory marker pyarrow leaves when it deletes the last file of a prefix)."""
    location = catalog.load_table(table).location()
    bucket = location.removeprefix("s3://").split("/", 1)[0]
    return {f"s3://{bucket}/{k}" for k in store.keys(f"{location}/data/") if not k.endswith("/")}


def committed(catalog: Catalog, table: str) -> set[str]:
    return {t.file.file_path for t in catalog.load_table(table).scan().plan_files()}


def test_commits_merges_quarantines_and_maintains_on_the_object_store(
    pipe: Pipe, catalog: Catalog, s3_store: S3Store
) -> None:
    coordinator = pipe.coordinator("c1")
    try:
        lead(coordinator)
        for seq in range(3):  # three small batches: merged into one file per cycle
            wait_pending(coordinator, pipe.source.publish(pipe.writer, seq).file_count)
        result = coordinator.commit_now()
        assert not result.failed, result.failed
        merged = next(r for r in result.tables if r.table == MERGED)
        assert (merged.data_files, merged.added_files) == (3, 1)
        # the merged originals are deleted from the bucket once the commit landed
        assert objects(s3_store, catalog, MERGED) == committed(catalog, MERGED)

        # an s3a:// alias of a file under the table is the same object: committed
        batch = pipe.source.batch("w", 3, group_id=pipe.group_id)
        aliased = s3a(batch.files)
        # and a file of another table announced for MERGED lies outside it: quarantined
        outside = write_rows(catalog.load_table(PLAIN), [10_000], "w", 4, pipe.group_id)
        pipe.writer.publish(3, aliased, batch.positions)
        pipe.writer.publish(4, {MERGED: outside}, batch.positions)
        wait_pending(coordinator, batch.file_count + 1)
        result = coordinator.commit_now()
        assert not result.failed, result.failed
        assert result.quarantined == {MERGED: 1}
    finally:
        coordinator.close()
    expected = {t: sorted(pipe.source.expected[t] + batch.ids[t]) for t in (MERGED, PLAIN)}
    for t in (MERGED, PLAIN):
        assert s3_store.read_ids(catalog.load_table(t)) == expected[t]
    assert any(p.startswith("s3a://") for p in committed(catalog, PLAIN))
    [entry] = Quarantine(catalog, pipe.settings.quarantine_table).list(pipe.group_id)
    assert (entry.table_name, entry.file_path, entry.error_type) == (
        MERGED,
        outside[0].path,
        "FileOutsideTableError",
    )

    # icefloe maintain over S3: expiry, then orphans listed and deleted in the bucket
    table = catalog.load_table(PLAIN)
    [stray] = write_rows(table, [99_999], "crashed-task", 0)  # never announced
    soon_ms = int(time.time() * 1000) + 60_000  # every object counts as old
    expiry = expire_snapshots(table, soon_ms, retain_last=1)
    assert len(expiry.expired) + len(expiry.kept_for_dedupe) >= 1
    dry = remove_orphan_files(catalog.load_table(PLAIN), soon_ms, dry_run=True)
    orphans = remove_orphan_files(catalog.load_table(PLAIN), soon_ms, quarantined=[outside[0].path])
    stray_key = stray.path.removeprefix("s3://")
    assert stray_key in dry.deleted
    assert stray_key in orphans.deleted
    assert orphans.kept_quarantined == (outside[0].path.removeprefix("s3://"),)
    assert stray.path not in objects(s3_store, catalog, PLAIN)
    assert outside[0].path in objects(s3_store, catalog, PLAIN)
    # nothing referenced was deleted (the s3a:// paths are the same objects)
    for t in (MERGED, PLAIN):
        assert s3_store.read_ids(catalog.load_table(t)) == expected[t]


def s3a(files: dict[str, list[DataFileMeta]]) -> dict[str, list[DataFileMeta]]:
    """The same files, named with the ``s3a://`` alias (Hadoop's spelling of the bucket)."""
    alias = "s3a://"
    return {
        t: [dataclasses.replace(m, path=alias + m.path.removeprefix("s3://")) for m in ms]
        for t, ms in files.items()
    }


def test_a_committed_file_announced_again_under_its_s3a_name_is_not_added_twice(
    pipe: Pipe, catalog: Catalog, s3_store: S3Store
) -> None:
    """s3a://b/k and s3://b/k are one object: the check that a file the branch already
    holds is never appended again must see through the alias."""
    first = pipe.source.publish(pipe.writer, 0)
    again = WriterClient(pipe.backend.writer("w2"), pipe.group_id, "w2")
    again.start()
    coordinator = pipe.coordinator("c1")
    try:
        lead(coordinator)
        wait_pending(coordinator, first.file_count)
        assert not coordinator.commit_now().failed
        again.publish(0, {PLAIN: s3a(first.files)[PLAIN]}, first.positions)
        wait_pending(coordinator, len(first.files[PLAIN]))
        result = coordinator.commit_now()
    finally:
        again.close()
        coordinator.close()
    assert not result.failed, result.failed
    assert result.quarantined == {}
    assert s3_store.read_ids(catalog.load_table(PLAIN)) == sorted(pipe.source.expected[PLAIN])


def test_upserts_write_position_deletes_to_the_object_store(
    catalog: Catalog, s3_store: S3Store
) -> None:
    create_rows_table(catalog, "db.scratch")  # the namespace
    catalog.create_table(KEYED, schema=KEYED_ROWS_SCHEMA)
    group = f"cdc-{uuid.uuid4().hex[:8]}"
    commit_changes(catalog, group, KEYED, upserts=range(10), batch_seq=0)
    commit_changes(catalog, group, KEYED, upserts=[3, 4, 11], deletes=[5, 6], batch_seq=1)
    assert s3_store.read_ids(catalog.load_table(KEYED)) == [0, 1, 2, 3, 4, 7, 8, 9, 11]


def test_a_compaction_round_rewrites_keyed_files_on_the_object_store(
    catalog: Catalog, s3_store: S3Store
) -> None:
    """A round reads the files and their deletes from the bucket, writes the rows left as
    one new object and drops the delete files; the old objects stay for time travel."""
    create_rows_table(catalog, "db.scratch")  # the namespace
    catalog.create_table(KEYED, schema=KEYED_ROWS_SCHEMA)
    group = f"cdc-{uuid.uuid4().hex[:8]}"
    commit_changes(catalog, group, KEYED, upserts=range(10), batch_seq=0)
    commit_changes(catalog, group, KEYED, upserts=[3, 4, 11], deletes=[5, 6], batch_seq=1)
    commit_changes(catalog, group, KEYED, upserts=[7], deletes=[0], batch_seq=2)
    before = objects(s3_store, catalog, KEYED)

    result = Compactor(group, catalog.load_table, lambda _: "main").compact(
        KEYED, Thresholds(), force=True
    )

    assert (result.rewritten_files, result.added_files, result.dropped_delete_files) == (3, 1, 2)
    table = catalog.load_table(KEYED)
    assert s3_store.read_ids(table) == [1, 2, 3, 4, 7, 8, 9, 11]
    (added,) = committed(catalog, KEYED)
    assert added.startswith("s3://")
    assert added not in before
    assert before < objects(s3_store, catalog, KEYED)  # nothing deleted from the bucket


def test_orphans_are_listed_and_deleted_over_several_pages(
    catalog: Catalog, s3_store: S3Store
) -> None:
    """The store answers a listing PAGE_SIZE keys at a time (as S3 does, 1000 at a time):
    orphans over several pages are all found and deleted."""
    table = create_rows_table(catalog, "db.many")
    bucket, _, prefix = table.location().removeprefix("s3://").partition("/")
    client = s3_store.client()
    count = 2 * PAGE_SIZE + 1
    for i in range(count):
        client.put_object(Bucket=bucket, Key=f"{prefix}/data/orphan-{i:04d}", Body=b"x")
    soon_ms = int(time.time() * 1000) + 60_000
    found = remove_orphan_files(table, soon_ms, dry_run=True)
    assert len([p for p in found.deleted if "/orphan-" in p]) == count
    removed = remove_orphan_files(table, soon_ms)
    assert sorted(removed.deleted) == sorted(found.deleted)
    assert [k for k in s3_store.keys(f"s3://{bucket}/{prefix}/data/") if "orphan-" in k] == []


def test_orphan_removal_keeps_a_table_inside_the_location_on_the_store(
    catalog: Catalog, s3_store: S3Store
) -> None:
    """A table created inside another's location (``<outer>/dlq``): the outer table's orphan
    removal found its objects unreferenced and deleted them all. It keeps them, found by the
    inner table's metadata objects in the listing; the outer table's own orphan goes."""
    outer = create_rows_table(catalog, "db.outer")
    outer.append(rows_table([1, 2]))
    inner = catalog.create_table("db.inner", schema=ROWS_SCHEMA, location=f"{outer.location()}/dlq")
    inner.append(rows_table([100, 101]))
    bucket, _, prefix = outer.location().removeprefix("s3://").partition("/")
    s3_store.client().put_object(Bucket=bucket, Key=f"{prefix}/data/orphan-0", Body=b"x")
    inside = sorted(f"{bucket}/{k}" for k in s3_store.keys(f"{inner.location()}/"))
    result = remove_orphan_files(catalog.load_table("db.outer"), int(time.time() * 1000) + 60_000)
    assert result.deleted == (f"{bucket}/{prefix}/data/orphan-0",)
    assert sorted(result.kept_other_tables) == inside
    assert s3_store.read_ids(catalog.load_table("db.inner")) == [100, 101]
    assert s3_store.read_ids(catalog.load_table("db.outer")) == [1, 2]


@pytest.mark.parametrize(
    ("key", "value"),
    [("s3.secret-access-key", "not-the-secret"), ("s3.access-key-id", "AKIANOSUCHKEY000000")],
)
def test_doctor_probes_the_store_and_names_the_rejected_key(
    s3_catalog_properties: Mapping[str, str],
    catalog: Catalog,
    s3_store: S3Store,
    key: str,
    value: str,
) -> None:
    create_rows_table(catalog, "db.there")
    tables = ["db.there", "db.missing"]
    ok = doctor_storage(s3_catalog_properties, tables)
    location = catalog.load_table("db.there").location()
    # the table, then the probes of its data location and of the warehouse (db.missing)
    assert [status for status, _ in ok] == ["ok", "ok", "ok"], ok
    assert ok[1][1] == f"{location}/data: written, read and deleted"
    assert not [k for k in s3_store.keys(s3_catalog_properties["warehouse"]) if "doctor" in k]

    wrong = doctor_storage({**s3_catalog_properties, key: value}, tables)
    # the table's metadata cannot be read (a HEAD request: no error code to tell why) and
    # the probe of the warehouse fails naming the key
    assert [s for s, _ in wrong] == ["fail", "fail"], wrong
    assert "check catalog properties s3.access-key-id and s3.secret-access-key" in wrong[0][1]
    assert wrong[-1][1].startswith(f"cannot write to {s3_catalog_properties['warehouse']}: ")
    assert f"check catalog property {key}:" in wrong[-1][1], wrong
    assert value not in " ".join(d for _, d in wrong)  # a secret is never echoed


@pytest.mark.parametrize(
    ("error", "properties", "named"),
    [
        (
            "AWS Error SIGNATURE_DOES_NOT_MATCH during PutObject",
            {"s3.secret-access-key": "x"},
            "property s3.secret-access-key:",
        ),
        (
            "SignatureDoesNotMatch",
            {"client.secret-access-key": "x"},
            "property client.secret-access-key:",
        ),
        (
            "AWS Error INVALID_ACCESS_KEY_ID",
            {},
            "property s3.access-key-id (s3.access-key-id not set",
        ),
        (
            "AWS Error ACCESS_DENIED during HeadObject",
            {"s3.access-key-id": "k", "s3.secret-access-key": "s"},
            "properties s3.access-key-id and s3.secret-access-key:",
        ),
        (
            "AWS Error NETWORK_CONNECTION during HeadBucket: Couldn't connect to server",
            {"s3.endpoint": "http://x"},
            "property s3.endpoint:",
        ),
        (
            "AWS Error NO_SUCH_BUCKET during PutObject",
            {"warehouse": "s3://gone/wh"},
            "property warehouse:",
        ),
    ],
)
def test_a_store_error_names_the_catalog_property_to_check(
    error: str, properties: dict[str, str], named: str
) -> None:
    from icefloe.ops.storage import hint

    said = hint(error, properties)
    assert said is not None
    assert said.startswith(f"check catalog {named}"), said
    assert said.endswith(f"({error})")
    assert hint("sqlite3.OperationalError: no such table", properties) is None


def test_status_reads_tables_and_quarantine_on_the_store(
    pipe: Pipe, catalog: Catalog, s3_catalog_properties: Mapping[str, str]
) -> None:
    """``icefloe status``'s FileIO (plain files for local paths) leaves ``s3://`` to the FileIO
    pyiceberg chooses (PyArrowFileIO): metadata and the quarantine table's rows are read from
    the bucket with the catalog's S3 properties."""
    coordinator = pipe.coordinator("c1")
    try:
        lead(coordinator)
        wait_pending(coordinator, pipe.source.publish(pipe.writer, 0).file_count)
        assert not coordinator.commit_now().failed
    finally:
        coordinator.close()
    location = catalog.load_table(PLAIN).location()
    reading = load_catalog("s3test", **status_properties(s3_catalog_properties))
    entry = quarantine_entry(pipe.group_id, PLAIN, f"{location}/data/refused.parquet")
    Quarantine(reading, pipe.settings.quarantine_table).add([entry])
    config = config_from_dict(
        {
            "name": pipe.group_id,
            "source": {"topics": ["t"]},
            "tables": [{"name": PLAIN}],
            "coordination": {"quarantine_table": pipe.settings.quarantine_table},
        }
    )

    status = table_status(reading, config, PLAIN, None, time.time() * 1000)

    assert (status.exists, status.rows, status.quarantined_files) == (True, 10, 1)
    io = reading.load_table(PLAIN).io
    assert isinstance(io, StatusFileIO)
    assert isinstance(io._io(location), PyArrowFileIO)
