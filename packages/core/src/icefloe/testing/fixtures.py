"""Pytest fixtures and helpers for tests that need a real Iceberg catalog and real files.

Load the fixtures with ``pytest_plugins = ["icefloe.testing.fixtures"]`` in the rootdir
``conftest.py``, or import them into any ``conftest.py`` (pytest ignores ``pytest_plugins``
in nested ones): ``from icefloe.testing.fixtures import sqlite_catalog``. The helpers are
plain functions, usable without pytest (e.g. in a child process).

* ``sqlite_catalog``: a pyiceberg ``SqlCatalog`` on SQLite with a ``file://`` warehouse, both
  in the test's ``tmp_path`` (a real catalog: optimistic commits, metadata files, Parquet).
* ``catalog_warehouse``: the warehouse URL of the catalogs below (``file://`` in ``tmp_path``;
  override the fixture to put them on another store).
* ``postgres_catalog_properties``: a pyiceberg ``SqlCatalog`` on the real PostgreSQL (a fresh
  database per test, dropped afterwards), as production users run it.
* ``rest_catalog``: a :class:`icefloe.testing.rest_catalog.RestCatalogServer` over an SQLite
  ``SqlCatalog``; clients reach it with ``rest_catalog.client_properties()``.
* ``memory_server``: a fresh :class:`icefloe.testing.memory.MemoryServer`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NamespaceAlreadyExistsError
from pyiceberg.manifest import DataFileContent
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit.quarantine import QuarantineEntry
from icefloe.events import DataFileMeta
from icefloe.records.datafiles import group_write_uuid, write_data_files
from icefloe.testing.memory import MemoryServer
from icefloe.testing.rest_catalog import RestCatalogServer

GROUP_ID_PROPERTY = "icefloe.group-id"

#: The schema of every test table: one row per published record id, plus who published it.
ROWS_SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "writer", StringType(), required=False),
    NestedField(3, "batch_seq", LongType(), required=False),
)
_ROWS_ARROW = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=True),
        pa.field("writer", pa.string(), nullable=True),
        pa.field("batch_seq", pa.int64(), nullable=True),
    ]
)

#: :data:`ROWS_SCHEMA` keyed by ``id``: an upsert/CDC table (see :func:`commit_changes`).
KEYED_ROWS_SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "writer", StringType(), required=False),
    NestedField(3, "batch_seq", LongType(), required=False),
    identifier_field_ids=[1],
)

#: The end-to-end tests' table for JSON source records ``{"id", "name", "kind"}``; partitioned,
#: so a batch writes several files per table as real pipelines do.
EVENTS_SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "name", StringType(), required=False),
    NestedField(3, "kind", StringType(), required=False),
)
EVENTS_SPEC = PartitionSpec(PartitionField(3, 1000, IdentityTransform(), "kind"))


def sqlite_catalog_properties(path: Path) -> dict[str, str]:
    """Properties of a SqlCatalog living in ``path`` (pass them to a child process)."""
    path.mkdir(parents=True, exist_ok=True)
    return {
        "uri": f"sqlite:///{path / 'catalog.db'}",
        "warehouse": f"file://{path / 'warehouse'}",
    }


#: The PostgreSQL the integration tests use (``ICEFLOE_TEST_POSTGRES_DSN``, a libpq DSN); a
#: catalog database is created there and dropped again, so its role needs CREATEDB.
POSTGRES_ADMIN_DSN = os.environ.get(
    "ICEFLOE_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test"
)


def postgres_url(dsn: str, database: str | None = None) -> str:
    """The SQLAlchemy URL (``postgresql+psycopg://``, what a SqlCatalog's ``uri`` takes) of a
    libpq DSN, key/value (``host=... dbname=...``) or URI form, optionally of another
    database. SQLAlchemy loads psycopg as the driver: core itself imports no backend library."""
    from sqlalchemy.engine import URL, make_url

    if dsn.startswith(("postgres://", "postgresql://")):
        url = make_url(dsn).set(drivername="postgresql+psycopg")
    else:
        params = dict(part.split("=", 1) for part in shlex.split(dsn))
        port = params.get("port")
        url = URL.create(
            "postgresql+psycopg",
            username=params.get("user"),
            password=params.get("password"),
            host=params.get("host"),
            port=int(port) if port else None,
            database=params.get("dbname"),
        )
    if database is not None:
        url = url.set(database=database)
    return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def postgres_catalog_database(admin_dsn: str = POSTGRES_ADMIN_DSN) -> Iterator[str]:
    """A fresh PostgreSQL database for one SqlCatalog, dropped (connections and all) at the
    end; yields its SQLAlchemy URL."""
    from sqlalchemy import create_engine, text

    name = f"icefloe_catalog_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url(admin_dsn), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            # template0 takes no connections, so a session on template1 cannot block the copy
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE template0'))
        try:
            yield postgres_url(admin_dsn, name)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def make_sqlite_catalog(path: Path, name: str = "icefloe_test") -> SqlCatalog:
    """A real SQLite-backed catalog with its warehouse under ``path``."""
    return SqlCatalog(name, **sqlite_catalog_properties(path))


def create_rows_table(
    catalog: Catalog, name: str, partition_spec: PartitionSpec | None = None
) -> Table:
    """Create ``namespace.table`` with :data:`ROWS_SCHEMA` (the namespace too if needed),
    unpartitioned unless ``partition_spec`` is given."""
    namespace = name.rsplit(".", 1)[0]
    with contextlib.suppress(NamespaceAlreadyExistsError):
        catalog.create_namespace(namespace)
    return catalog.create_table(
        name, schema=ROWS_SCHEMA, partition_spec=partition_spec or PartitionSpec()
    )


def quarantine_entry(group: str, table: str, path: str) -> QuarantineEntry:
    """A quarantine entry of ``path`` (announced for ``table`` by ``group``'s writer ``w``)."""
    return QuarantineEntry(
        group_id=group,
        table_name=table,
        file_path=path,
        record_count=3,
        file_size_in_bytes=100,
        writer_id="w",
        batch_seq=7,
        channel_partition="0",
        channel_offset=12,
        table_uuid=None,
        error_type="FileOutsideTableError",
        error_message="outside",
        commit_id="c",
        quarantined_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def rows_table(ids: Iterable[int], writer: str = "w", batch_seq: int = 0) -> pa.Table:
    """Rows of :data:`ROWS_SCHEMA` holding ``ids``, as Arrow."""
    id_list = list(ids)
    return pa.table(
        {
            "id": pa.array(id_list, pa.int64()),
            "writer": pa.array([writer] * len(id_list), pa.string()),
            "batch_seq": pa.array([batch_seq] * len(id_list), pa.int64()),
        },
        schema=_ROWS_ARROW,
    )


def write_rows(
    table: Table, ids: Iterable[int], writer: str, batch_seq: int, group_id: str | None = None
) -> list[DataFileMeta]:
    """Write real Parquet data files holding ``ids`` into the table's location (uncommitted),
    named for pipeline ``group_id`` as its writers name them (untagged without one)."""
    write_uuid = None if group_id is None else group_write_uuid(group_id)
    return write_data_files(table, rows_table(ids, writer, batch_seq), write_uuid)


def commit_changes(
    catalog: Catalog,
    group_id: str,
    name: str,
    upserts: Iterable[int] = (),
    deletes: Iterable[int] = (),
    batch_seq: int = 0,
) -> None:
    """Commit one upsert/CDC batch of pipeline ``group_id`` into a :data:`KEYED_ROWS_SCHEMA`
    table as the coordinator would: rows for ``upserts``, keys for both, so the committer
    writes position deletes for the rows they replace or delete."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    from icefloe.commit.committer import IcebergCommitter
    from icefloe.commit.request import PendingFile, TableCommitRequest
    from icefloe.records.datafiles import write_key_files

    table = catalog.load_table(name)
    rows = rows_table(upserts, "w", batch_seq)
    keys = pa.concat_arrays([rows["id"].combine_chunks(), pa.array(list(deletes), pa.int64())])
    arrow = rows.cast(schema_to_pyarrow(table.schema()))
    metas = write_data_files(table, arrow, group_write_uuid(group_id)) if rows.num_rows else []
    metas += write_key_files(table, pa.table({"id": keys}), group_write_uuid(group_id))
    uid = str(table.metadata.table_uuid)
    files = tuple(PendingFile(m, "w", batch_seq, "0", batch_seq, uid) for m in metas)
    request = TableCommitRequest(name, f"c-{batch_seq}", files, {"0": batch_seq + 1}, {}, 1)
    IcebergCommitter(catalog, group_id).commit(request)


def table_ids(catalog: Catalog, name: str, branch: str = "main") -> list[int]:
    """Every ``id`` in the head of the table's ``branch``, sorted (duplicates kept, so tests
    see them)."""
    table = catalog.load_table(name)
    head = table.snapshot_by_name(branch)
    if head is None:
        return []
    scan = table.scan(selected_fields=("id",), snapshot_id=head.snapshot_id)
    return sorted(int(v) for v in scan.to_arrow()["id"].to_pylist())


def group_snapshots(catalog: Catalog, name: str, group_id: str) -> list[Snapshot]:
    """The table's snapshots made by pipeline ``group_id``, oldest first."""
    table = catalog.load_table(name)
    return [
        s
        for s in table.snapshots()
        if s.summary is not None
        and s.summary.additional_properties.get(GROUP_ID_PROPERTY) == group_id
    ]


def assert_exactly_once(
    catalog: Catalog, name: str, expected: Sequence[int], branch: str = "main"
) -> None:
    """The table's ``branch`` holds each expected id exactly once and nothing else."""
    got = table_ids(catalog, name, branch)
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    dupes = sorted({i for i in got if got.count(i) > 1}) if len(got) != len(set(got)) else []
    ok = not (missing or extra or dupes)
    assert ok, (
        f"{name}: {len(got)} rows for {len(expected)} expected; missing {missing[:10]}, "
        f"unexpected {extra[:10]}, duplicated {dupes[:10]}"
    )


@pytest.fixture
def sqlite_catalog(tmp_path: Path) -> SqlCatalog:
    """A real SqlCatalog (SQLite + file:// warehouse) private to the test."""
    return make_sqlite_catalog(tmp_path / "iceberg")


def data_file_ids(table: Table) -> list[int]:
    """Every ``id`` in the table's current snapshot, sorted, read with pyarrow from the data
    files its manifests list (not through a pyiceberg scan, nor the committer's code). For
    append-only tables: a delete file fails the read rather than being ignored."""
    ids: list[int] = []
    for task in table.scan().plan_files():
        assert not task.delete_files, f"delete files in an append-only table: {task.delete_files}"
        assert task.file.content == DataFileContent.DATA
        with table.io.new_input(task.file.file_path).open() as f:
            ids.extend(int(v) for v in pq.read_table(f, columns=["id"])["id"].to_pylist())
    return sorted(ids)


@pytest.fixture
def catalog_warehouse(tmp_path: Path) -> str:
    """Where the test's catalogs keep their tables: a ``file://`` URL in ``tmp_path``."""
    return f"file://{tmp_path / 'warehouse'}"


@pytest.fixture
def postgres_catalog_properties(catalog_warehouse: str) -> Iterator[dict[str, str]]:
    """pyiceberg properties of a SqlCatalog on the real PostgreSQL, in a database of its own;
    fails (never skips) when PostgreSQL is not there."""
    from sqlalchemy.exc import OperationalError

    try:
        database = postgres_catalog_database()
        uri = database.__enter__()
    except OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is required at {POSTGRES_ADMIN_DSN!r} ({exc}); start it as .ci/run "
            "does or set ICEFLOE_TEST_POSTGRES_DSN"
        )
    try:
        yield {"type": "sql", "uri": uri, "warehouse": catalog_warehouse}
    finally:
        database.__exit__(None, None, None)


@pytest.fixture
def rest_catalog(tmp_path: Path, catalog_warehouse: str) -> Iterator[RestCatalogServer]:
    """An Iceberg REST catalog server over an SQLite SqlCatalog private to the test."""
    backing = SqlCatalog(
        "rest_backing", uri=f"sqlite:///{tmp_path / 'rest-catalog.db'}", warehouse=catalog_warehouse
    )
    with RestCatalogServer(backing) as server:
        yield server
    backing.engine.dispose()


@pytest.fixture
def memory_server() -> MemoryServer:
    """A fresh in-process reference channel server."""
    return MemoryServer()


def kafka_rows(values: list[bytes | None], topic: str = "t", partition: int = 0) -> pa.Table:
    """Rows in Spark's Kafka layout, as the sink receives them (offsets from 100, one
    second apart from 2024-05-01 12:00 UTC)."""
    n = len(values)
    ts = [datetime(2024, 5, 1, 12, 0, i, tzinfo=UTC) for i in range(n)]
    return pa.table(
        {
            "key": pa.array([None] * n, pa.binary()),
            "value": pa.array(values, pa.binary()),
            "topic": pa.array([topic] * n, pa.string()),
            "partition": pa.array([partition] * n, pa.int32()),
            "offset": pa.array(range(100, 100 + n), pa.int64()),
            "timestamp": pa.array(ts, pa.timestamp("us", tz="Etc/UTC")),
            "timestampType": pa.array([0] * n, pa.int32()),
        }
    )
