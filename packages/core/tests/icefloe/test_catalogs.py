"""The committer and the coordinator through the catalogs production runs: pyiceberg's
``SqlCatalog`` on the real PostgreSQL, and the Iceberg REST protocol (pyiceberg's
``RestCatalog`` client against :mod:`icefloe.testing.rest_catalog`, served over a real
``SqlCatalog`` on SQLite or PostgreSQL).

Another writer commits to the same table through the same catalog between our load and our
commit, so the conflict and retry paths run through each catalog's client; the table must end
with every row exactly once, counted with pyarrow from the data files the manifests list.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError
from pyiceberg.table import Table
from pyiceberg.table.update import (
    AssertCreate,
    AssertRefSnapshotId,
    AssertTableUUID,
    SetPropertiesUpdate,
    TableRequirement,
)

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.coordination.coordinator import CoordinatorSettings
from icefloe.testing.fixtures import (
    create_rows_table,
    data_file_ids,
    postgres_catalog_database,
    rows_table,
    write_rows,
)
from icefloe.testing.harness import Pipe, RowSource, once
from icefloe.testing.memory import MemoryBackend, MemoryServer
from icefloe.testing.rest_catalog import RestCatalogServer

GROUP = "catalogs"
TABLE = "db.rows"
FOREIGN_IDS = iter(range(1_000_000, 2_000_000))  # rows of the other writer


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)],
)
def backing(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlCatalog]:
    """The real SqlCatalog the REST server serves (or that the test uses directly)."""
    warehouse = f"file://{tmp_path / 'warehouse'}"
    if request.param == "sqlite":
        catalog = SqlCatalog("backing", uri=f"sqlite:///{tmp_path}/c.db", warehouse=warehouse)
        yield catalog
        catalog.engine.dispose()
        return
    with postgres_catalog_database() as uri:
        catalog = SqlCatalog("backing", uri=uri, warehouse=warehouse)
        yield catalog
        catalog.engine.dispose()


@pytest.fixture
def server(backing: SqlCatalog) -> Iterator[RestCatalogServer]:
    with RestCatalogServer(backing) as served:
        yield served


def rest_client(server: RestCatalogServer) -> RestCatalog:
    catalog = load_catalog(f"rest-{uuid.uuid4().hex[:6]}", **server.client_properties())
    assert isinstance(catalog, RestCatalog)
    return catalog


def foreign_append(catalog: Catalog, n: int = 2) -> list[int]:
    """Another writer (not icefloe) appends ``n`` rows through ``catalog``; returns them."""
    ids = [next(FOREIGN_IDS) for _ in range(n)]
    catalog.load_table(TABLE).append(rows_table(ids, "foreign"))
    return ids


def pending(table: Table, ids: list[int], seq: int) -> tuple[PendingFile, ...]:
    metas = write_rows(table, ids, "w1", seq, GROUP)
    uid = str(table.metadata.table_uuid)
    return tuple(PendingFile(m, "w1", seq, "0", seq, uid) for m in metas)


def request(files: tuple[PendingFile, ...], seq: int) -> TableCommitRequest:
    return TableCommitRequest(TABLE, f"c-{seq}", files, {"0": seq + 1}, {}, 1)


# --- the REST adapter keeps the protocol's promises ----------------------------------------


@pytest.mark.parametrize("stale", ["ref-snapshot-id", "table-uuid", "create"])
def test_a_commit_whose_requirement_fails_is_a_409_and_changes_nothing(
    stale: str, server: RestCatalogServer
) -> None:
    """The spec's commit requirements are enforced: a client whose view is stale gets 409
    (``CommitFailedException``) and the table is what it was."""
    ours, theirs = rest_client(server), rest_client(server)
    create_rows_table(ours, TABLE).append(rows_table([1]))
    loaded = ours.load_table(TABLE)
    foreign_append(theirs)
    before = theirs.load_table(TABLE).metadata
    requirements: dict[str, TableRequirement] = {
        "ref-snapshot-id": AssertRefSnapshotId.model_validate(
            {"ref": "main", "snapshot-id": loaded.metadata.current_snapshot_id}
        ),
        "table-uuid": AssertTableUUID(uuid=uuid.uuid4()),
        "create": AssertCreate(),
    }
    requirement = requirements[stale]
    update = SetPropertiesUpdate(updates={"stale": "yes"})
    with pytest.raises(CommitFailedException):
        ours.commit_table(loaded, (requirement,), (update,))
    after = theirs.load_table(TABLE).metadata
    assert after.current_snapshot_id == before.current_snapshot_id
    assert "stale" not in after.properties
    assert server.conflicts == 1


def test_tables_are_created_listed_and_created_in_a_transaction(server: RestCatalogServer) -> None:
    """What icefloe asks of a catalog besides commits: namespaces, table existence, creating
    a table (``create_table_if_not_exists``, the quarantine table) and a staged create
    committed with its first rows (``create_table_transaction``, auto-created tables)."""
    client = rest_client(server)
    table = create_rows_table(client, TABLE)
    with pytest.raises(TableAlreadyExistsError):
        client.create_table(TABLE, schema=table.schema())
    assert client.create_table_if_not_exists(TABLE, schema=table.schema()).metadata.table_uuid == (
        table.metadata.table_uuid
    )
    tx = client.create_table_transaction("db.staged", schema=table.schema())
    assert not client.table_exists("db.staged")  # nothing is written before the commit
    tx.append(rows_table([7, 8]))
    tx.commit_transaction()
    assert client.list_namespaces() == [("db",)]
    assert sorted(client.list_tables("db")) == [("db", "rows"), ("db", "staged")]
    assert client.namespace_exists("db")
    assert not client.namespace_exists("nope")
    assert data_file_ids(server.catalog.load_table("db.staged")) == [7, 8]


# --- the committer through each catalog ----------------------------------------------------


@pytest.mark.parametrize("through", ["sql", "rest"])
def test_committer_retries_a_foreign_commit_between_its_load_and_its_commit(
    through: str, backing: SqlCatalog
) -> None:
    """A foreign writer appends through the same catalog after the committer loaded the table
    and before it commits: the commit conflicts, is redone on the new head, and every row is
    there once; replaying the request adds nothing."""
    with RestCatalogServer(backing) as server:
        catalog: Catalog = backing if through == "sql" else rest_client(server)
        other: Catalog = backing if through == "sql" else rest_client(server)
        table = create_rows_table(catalog, TABLE)
        foreign: list[int] = []
        committer = IcebergCommitter(
            catalog,
            GROUP,
            before_commit=once(lambda: foreign.extend(foreign_append(other))),
            retry_wait_s=0.001,
        )
        first = request(pending(table, [1, 2, 3], 0), 0)
        result = committer.commit(first)
        assert result.snapshot_id is not None
        assert committer.commit(first).snapshot_id is None  # a replay commits nothing
        if through == "rest":
            assert server.conflicts == 1, "the retry did not go through the REST protocol"
        ids = data_file_ids(backing.load_table(TABLE))  # read past the REST server
    assert ids == sorted([1, 2, 3, *foreign])
    assert len(foreign) == 2


@pytest.mark.parametrize("landed", [False, True], ids=["before-applied", "after-applied"])
def test_a_5xx_commit_answer_is_an_unknown_outcome_resolved_without_a_duplicate(
    landed: bool, server: RestCatalogServer
) -> None:
    """The server fails a commit request with 500, before applying it or after (the answer
    lost): the REST client reports an unknown outcome, and the committer finds out whether
    its snapshot landed instead of committing the files twice or dropping them."""
    catalog = rest_client(server)
    table = create_rows_table(catalog, TABLE)
    failures: list[tuple[str, ...]] = []

    def fail_once(identifier: tuple[str, ...]) -> None:
        if not failures:
            failures.append(identifier)
            raise RuntimeError("the catalog's answer is lost")

    if landed:
        server.after_commit = fail_once
    else:
        server.before_commit = fail_once
    committer = IcebergCommitter(catalog, GROUP, retry_wait_s=0.001)
    result = committer.commit(request(pending(table, [1, 2], 0), 0))
    assert failures == [("db", "rows")]
    assert result.snapshot_id is not None
    assert server.commits == 1  # applied once: retried when it had not landed, else not
    assert data_file_ids(server.catalog.load_table(TABLE)) == [1, 2]


def test_coordinator_through_rest_with_another_writer_before_every_commit(
    server: RestCatalogServer, tmp_path: Path
) -> None:
    """A real coordinator and writer client (reference channel) through the REST client;
    the server lets another REST client append before each of the coordinator's commits is
    applied, so every cycle's first attempt conflicts (409) and is retried. Each published
    row lands once; the other writer's rows all stay."""
    other = rest_client(server)
    foreign: list[int] = []
    busy = threading.Lock()  # held while the other writer commits (in another server thread)

    def slip_in(identifier: tuple[str, ...]) -> None:
        if identifier != tuple(TABLE.split(".")):
            return  # another table's commit (the quarantine's fence, as a leadership starts)
        if len(foreign) >= 2 * 4 or not busy.acquire(blocking=False):
            return  # enough conflicts made, or this is the other writer's own commit
        try:
            foreign.extend(foreign_append(other))
        finally:
            busy.release()

    catalog = rest_client(server)
    source = RowSource.create(catalog, [TABLE], rows_per_table=3)
    server.before_commit = slip_in
    pipe = Pipe.open(
        MemoryBackend(MemoryServer(), GROUP, 5.0),
        catalog,
        GROUP,
        source,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=5.0),
    )
    try:
        results = pipe.commit_each([0, 1, 2, 3])
    finally:
        pipe.writer.close()
    assert all(t.snapshot_id is not None for r in results for t in r.tables), results
    assert server.conflicts >= 4
    expected = sorted(source.expected[TABLE] + foreign)
    assert data_file_ids(server.catalog.load_table(TABLE)) == expected
