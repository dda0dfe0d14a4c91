"""The committer's cheap path: table versions reused while unchanged, and the plain append
built without pyiceberg's transaction. Real SqlCatalog (SQLite), real Parquet files; rows are
read back by pyiceberg's scan, the snapshots and manifests compared with pyiceberg's own append.

(A rollback made by another tool between two commits of one committer is covered by
test_committer.py::test_rollback_waits_for_its_replay_then_commits_it_once.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import ManifestEntryStatus
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.update import SetPropertiesUpdate
from pyiceberg.types import StringType

from icefloe.commit import versions
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.versions import KnownVersions
from icefloe.events import DataFileMeta
from icefloe.records.datafiles import DataFileBuilder
from icefloe.testing.fixtures import (
    assert_exactly_once,
    catalog_warehouse,
    create_rows_table,
    make_sqlite_catalog,
    postgres_catalog_properties,
    rows_table,
    write_rows,
)

__all__ = ["catalog_warehouse", "postgres_catalog_properties"]  # fixtures, used below

GROUP = "pipe-v"
NAME = "db.events"


@pytest.fixture
def catalog(tmp_path: Path) -> SqlCatalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def request(table: Table, metas: Sequence[DataFileMeta], seq: int) -> TableCommitRequest:
    uid = str(table.metadata.table_uuid)
    files = tuple(PendingFile(m, "w1", seq, "0", seq, uid) for m in metas)
    return TableCommitRequest(
        table=table_name(table),
        commit_id=str(uuid.uuid4()),
        files=files,
        positions={"0": seq + 1},
        source_offsets={},
        fencing_token=1,
        valid_through_ms=None,
    )


def table_name(table: Table) -> str:
    return ".".join(table.name())


def cycle(
    committer: IcebergCommitter, catalog: SqlCatalog, name: str, ids: list[int], seq: int
) -> Any:
    """One coordinator cycle for one table: screen, then commit what screening accepted."""
    table = catalog.load_table(name)  # as a writer sees it now
    req = request(table, write_rows(table, ids, "w1", seq), seq)
    screening = committer.screen(name, req.files)
    assert screening.refused == (), [str(e) for _, e in screening.refused]
    return committer.commit(req)


def test_unchanged_table_is_not_loaded_again(
    catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Screen and commit of a table unchanged since this committer's last commit use the
    version it committed, and so does pyiceberg's SQL catalog commit: no full load at all."""
    create_rows_table(catalog, NAME)
    committer = IcebergCommitter(catalog, GROUP)
    cycle(committer, catalog, NAME, [1], 0)
    table = catalog.load_table(NAME)
    req = request(table, write_rows(table, [2], "w1", 1), 1)
    loads: list[str] = []
    original = SqlCatalog.load_table

    def counted(self: SqlCatalog, identifier: Any) -> Table:
        loads.append(str(identifier))
        return original(self, identifier)

    monkeypatch.setattr(SqlCatalog, "load_table", counted)
    assert committer.screen(NAME, req.files).refused == ()
    assert committer.commit(req).data_files == 1
    # was 3 (screen, commit, the catalog inside its commit), then 1 (the catalog)
    assert loads == []
    monkeypatch.undo()
    assert_exactly_once(catalog, NAME, [1, 2])


def test_a_partition_spec_changed_by_another_engine_between_cycles_is_seen(
    catalog: SqlCatalog, tmp_path: Path
) -> None:
    """No snapshot marks a spec change: a committer trusting the version it committed would
    judge files written under the new spec by the old one and refuse them."""
    create_rows_table(catalog, NAME)
    committer = IcebergCommitter(catalog, GROUP)
    cycle(committer, catalog, NAME, [1], 0)
    other = make_sqlite_catalog(tmp_path / "iceberg")  # another engine, same catalog
    with other.load_table(NAME).update_spec() as update:
        update.add_identity("writer")
    result = cycle(committer, catalog, NAME, [2, 3], 1)
    assert result.data_files == 1
    snapshot = catalog.load_table(NAME).current_snapshot()
    assert snapshot is not None
    manifests = snapshot.manifests(catalog.load_table(NAME).io)
    assert {m.partition_spec_id for m in manifests} == {0, 1}
    assert_exactly_once(catalog, NAME, [1, 2, 3])


def test_a_schema_changed_by_another_engine_between_cycles_is_seen(
    catalog: SqlCatalog, tmp_path: Path
) -> None:
    """The snapshot records the schema it was written with: the current one, not the one
    the committer saw at its last commit."""
    create_rows_table(catalog, NAME)
    committer = IcebergCommitter(catalog, GROUP)
    cycle(committer, catalog, NAME, [1], 0)
    other = make_sqlite_catalog(tmp_path / "iceberg")
    with other.load_table(NAME).update_schema() as update:
        update.add_column("note", StringType())
    cycle(committer, catalog, NAME, [2], 1)
    table = catalog.load_table(NAME)
    snapshot = table.current_snapshot()
    assert snapshot is not None
    assert snapshot.schema_id == table.schema().schema_id == 1
    assert_exactly_once(catalog, NAME, [1, 2])


def pyiceberg_append(table: Table, metas: Sequence[DataFileMeta], merge: bool) -> None:
    """The same data files appended by pyiceberg's own transaction (the reference)."""
    build = DataFileBuilder(table.metadata).build
    with table.transaction() as tx:
        update = tx.update_snapshot()
        with update.merge_append() if merge else update.fast_append() as append:
            for meta in metas:
                append.append_data_file(build(meta))


def manifest_view(table: Table) -> list[Any]:
    """What readers see of the head: per manifest its kind, spec, counts and entries."""
    snapshot = table.current_snapshot()
    assert snapshot is not None
    view = []
    for m in sorted(snapshot.manifests(table.io), key=lambda m: m.sequence_number or 0):
        entries = sorted(
            (
                e.status.value,
                e.sequence_number,
                e.file_sequence_number,
                e.data_file.record_count,
            )
            for e in m.fetch_manifest_entry(table.io, discard_deleted=False)
        )
        counts = (m.added_files_count, m.existing_files_count, m.deleted_files_count)
        view.append((m.content, m.partition_spec_id, m.sequence_number, counts, entries))
    return view


@pytest.mark.parametrize("merge", [False, True], ids=["plain", "manifest-merge"])
def test_append_makes_what_pyiceberg_makes(catalog: SqlCatalog, merge: bool) -> None:
    """Snapshot by snapshot, the committer's append and pyiceberg's produce the same
    sequence numbers, manifests (entries, statuses, counts), summary totals and rows; with
    manifest merging on and a low merge count, pyiceberg's merges happen all the same."""
    props = {"commit.manifest-merge.enabled": "true", "commit.manifest.min-count-to-merge": "3"}
    ours, ref = create_rows_table(catalog, "db.ours"), create_rows_table(catalog, "db.ref")
    for t in (ours, ref):
        if merge:
            t.transaction().set_properties(props).commit_transaction()
    committer = IcebergCommitter(catalog, GROUP)
    expected: list[int] = []
    previous = None
    for seq in range(5):
        ids = [10 * seq + i for i in range(seq + 1)]
        expected += ids
        committed = cycle(committer, catalog, "db.ours", ids, seq)
        assert committed.data_files == 1
        ref = catalog.load_table("db.ref")
        pyiceberg_append(ref, write_rows(ref, ids, "w1", seq), merge)
        a, b = catalog.load_table("db.ours"), catalog.load_table("db.ref")
        assert manifest_view(a) == manifest_view(b), f"commit {seq}"
        sa, sb = a.current_snapshot(), b.current_snapshot()
        assert sa is not None
        assert sb is not None
        assert sa.summary is not None
        assert sb.summary is not None
        assert sa.sequence_number == sb.sequence_number
        assert sa.summary.operation == sb.summary.operation
        assert {
            k: v for k, v in sa.summary.additional_properties.items() if not k.startswith("icefloe")
        } == sb.summary.additional_properties
        assert sa.parent_snapshot_id == previous
        previous = sa.snapshot_id
    assert_exactly_once(catalog, "db.ours", expected)
    assert_exactly_once(catalog, "db.ref", expected)
    if merge:  # the merges happened: fewer manifests than commits
        head = catalog.load_table("db.ours").current_snapshot()
        assert head is not None
        assert len(head.manifests(catalog.load_table("db.ours").io)) < 5
    status = {e[0] for m in manifest_view(catalog.load_table("db.ours")) for e in m[4]}
    assert status <= {ManifestEntryStatus.ADDED.value, ManifestEntryStatus.EXISTING.value}


def test_without_a_cheap_lookup_only_the_commit_right_after_screening_reuses(
    catalog: SqlCatalog,
) -> None:
    """A catalog that cannot tell its metadata location cheaply (not a SQL catalog) gets a
    full load at every attempt but the commit that follows its screening."""
    table = create_rows_table(catalog, NAME)
    no_lookup: Any = object()  # any catalog but a SqlCatalog
    versions = KnownVersions()
    versions.remember(NAME, table)
    assert versions.reusable(no_lookup, NAME, after_screen=True) is None  # not screened
    versions.screened(NAME)
    assert versions.reusable(no_lookup, NAME, after_screen=False) is None  # a retry
    versions.screened(NAME)
    reused = versions.reusable(no_lookup, NAME, after_screen=True)
    assert reused is not None
    assert reused.metadata_location == table.metadata_location
    assert versions.reusable(no_lookup, NAME, after_screen=True) is None  # used up
    # a SQL catalog is asked: the same version is reused, another one is not
    assert versions.reusable(catalog, NAME, after_screen=False) is not None
    table.transaction().set_properties({"k": "v"}).commit_transaction()
    assert versions.reusable(catalog, NAME, after_screen=True) is None


def test_a_refused_append_leaves_no_orphan_manifests(catalog: SqlCatalog) -> None:
    """A commit refused for a moved branch head deletes the manifest and manifest list it
    wrote; the retry's are the only ones left besides the foreign writer's."""
    create_rows_table(catalog, NAME)
    foreign: list[int] = []

    def foreign_append() -> None:
        if not foreign:  # once: between the first attempt's planning and its commit
            foreign.append(1)
            other = catalog.load_table(NAME)
            pyiceberg_append(other, write_rows(other, [100], "foreign", 0), merge=False)

    committer = IcebergCommitter(catalog, GROUP, before_commit=foreign_append)
    assert cycle(committer, catalog, NAME, [1], 0).data_files == 1
    table = catalog.load_table(NAME)
    referenced: set[str] = set()
    for snapshot in table.snapshots():
        referenced.add(snapshot.manifest_list)
        referenced |= {m.manifest_path for m in snapshot.manifests(table.io)}
    metadata_dir = Path(table.location().removeprefix("file://")) / "metadata"
    on_disk = {f"file://{p}" for p in metadata_dir.glob("*.avro")}
    assert on_disk == referenced, sorted(on_disk - referenced)
    assert_exactly_once(catalog, NAME, [1, 100])


def test_committer_caches_survive_threads_evicting_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Commit threads (coordination.commit_parallelism) share the committer's caches. An
    unguarded "evict the oldest, then insert" let two threads evict the same key: KeyError
    in a commit. Tiny caches and a tiny switch interval make the race frequent."""
    import sys
    import threading

    from icefloe.commit import livefiles

    monkeypatch.setattr(livefiles, "_LIST_CACHE_SIZE", 2)
    cache = livefiles.LiveFiles()
    errors: list[BaseException] = []

    def hammer(worker: int) -> None:
        try:
            for i in range(20_000):
                cache.remember_list(f"{worker}-{i}", ())
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


@pytest.fixture(params=["sqlite", "postgres"])
def sql_catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlCatalog]:
    """pyiceberg's SQL catalog on SQLite and on the real PostgreSQL."""
    if request.param == "sqlite":
        yield make_sqlite_catalog(tmp_path / "iceberg")
        return
    properties = request.getfixturevalue("postgres_catalog_properties")
    catalog = SqlCatalog("icefloe_test", **properties)
    yield catalog
    catalog.engine.dispose()


def metadata_files(table: Table) -> set[str]:
    return {p.name for p in Path(urlsplit(table.location()).path, "metadata").glob("*.json")}


def test_a_commit_on_a_version_no_longer_current_is_refused_and_leaves_no_file(
    sql_catalog: SqlCatalog,
) -> None:
    """The commit on a known version swaps the catalog's row only where it still names that
    version: another client's commit in between (here: a property) makes it fail as a failed
    requirement does, keeps the other's change, and removes the metadata file it wrote."""
    create_rows_table(sql_catalog, NAME)
    committer = IcebergCommitter(sql_catalog, GROUP)
    cycle(committer, sql_catalog, NAME, [1], 0)
    stale = versions.without_retries(sql_catalog.load_table(NAME))
    sql_catalog.load_table(NAME).transaction().set_properties(other="1").commit_transaction()
    current = sql_catalog.load_table(NAME)
    before = metadata_files(current)

    with pytest.raises(CommitFailedException, match="changed since version"):
        versions.commit_table(stale, (), (SetPropertiesUpdate(updates={"ours": "1"}),))

    after = sql_catalog.load_table(NAME)
    assert after.metadata_location == current.metadata_location
    assert after.properties.get("other") == "1"
    assert "ours" not in after.properties
    assert metadata_files(after) == before
    # and the committer, planning again on the current version, lands its files once
    cycle(committer, sql_catalog, NAME, [2], 1)
    assert_exactly_once(sql_catalog, NAME, [1, 2])


def test_the_commit_retries_override_is_never_stored(sql_catalog: SqlCatalog) -> None:
    """The committer plans on a copy whose properties turn pyiceberg's own retries off; the
    commit on a known version applies its updates to the stored metadata, not to that copy."""
    create_rows_table(sql_catalog, NAME)
    committer = IcebergCommitter(sql_catalog, GROUP)
    for seq in range(3):
        cycle(committer, sql_catalog, NAME, [seq], seq)
    table = sql_catalog.load_table(NAME)
    assert TableProperties.COMMIT_NUM_RETRIES not in table.properties
    assert len(table.snapshots()) == 3
    assert_exactly_once(sql_catalog, NAME, [0, 1, 2])


def test_a_version_moved_by_its_own_commit_goes_through_the_catalog(
    sql_catalog: SqlCatalog,
) -> None:
    """pyiceberg's Table moves itself to the version it committed; its stored metadata is
    then no longer known, so a later commit through it takes the catalog's path (applying
    it to the older stored metadata would swap the row and drop the first commit's change)."""
    create_rows_table(sql_catalog, NAME)
    table = versions.without_retries(sql_catalog.load_table(NAME))
    assert table.stored is not None
    table.transaction().set_properties(first="1").commit_transaction()
    assert table.stored is None
    versions.commit_table(table, (), (SetPropertiesUpdate(updates={"second": "2"}),))
    properties = sql_catalog.load_table(NAME).properties
    assert (properties.get("first"), properties.get("second")) == ("1", "2")


def test_a_commit_right_after_its_screening_asks_the_catalog_nothing_more(
    catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The screening looked the table's location up a moment before; the commit that follows
    plans on that version without asking again (its compare-and-swap refuses a stale one).
    It asked twice per table and cycle: a round trip per table at 1,000 tables a cycle."""
    create_rows_table(catalog, NAME)
    committer = IcebergCommitter(catalog, GROUP)
    cycle(committer, catalog, NAME, [1], 0)
    lookups: list[str] = []
    original = versions._sql_location

    def counted(catalog: Any, name: str) -> str | None:
        lookups.append(name)
        return original(catalog, name)

    monkeypatch.setattr(versions, "_sql_location", counted)
    assert cycle(committer, catalog, NAME, [2], 1).data_files == 1
    assert lookups == [NAME]  # the screening's
    monkeypatch.undo()
    assert_exactly_once(catalog, NAME, [1, 2])


def test_another_engines_commit_between_screening_and_commit_is_planned_on_again(
    catalog: SqlCatalog, tmp_path: Path
) -> None:
    """Another engine appends after the screening: the commit's first attempt, planned on the
    screened version, is refused by the compare-and-swap, and the next one commits on top of
    the other engine's snapshot; every row once."""
    table = create_rows_table(catalog, NAME)
    committer = IcebergCommitter(catalog, GROUP)
    cycle(committer, catalog, NAME, [1], 0)
    req = request(table, write_rows(catalog.load_table(NAME), [2], "w1", 1), 1)
    assert committer.screen(NAME, req.files).refused == ()
    other = make_sqlite_catalog(tmp_path / "iceberg").load_table(NAME)
    other.append(rows_table([100]))
    foreign = other.current_snapshot()
    assert foreign is not None
    result = committer.commit(req)
    assert result.data_files == 1
    head = catalog.load_table(NAME).current_snapshot()
    assert head is not None
    assert head.snapshot_id == result.snapshot_id
    assert head.parent_snapshot_id == foreign.snapshot_id
    assert_exactly_once(catalog, NAME, [1, 2, 100])
