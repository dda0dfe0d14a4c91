"""Pytest fixtures and helpers for tests that need a real Iceberg catalog and real files.

Load the fixtures with ``pytest_plugins = ["icefloe.testing.fixtures"]`` in the rootdir
``conftest.py``, or import them into any ``conftest.py`` (pytest ignores ``pytest_plugins``
in nested ones): ``from icefloe.testing.fixtures import sqlite_catalog``. The helpers are
plain functions, usable without pytest (e.g. in a child process).

* ``sqlite_catalog``: a pyiceberg ``SqlCatalog`` on SQLite with a ``file://`` warehouse, both
  in the test's ``tmp_path`` (a real catalog: optimistic commits, metadata files, Parquet).
* ``memory_server``: a fresh :class:`icefloe.testing.memory.MemoryServer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NamespaceAlreadyExistsError
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.events import DataFileMeta
from icefloe.records.datafiles import group_write_uuid, write_data_files
from icefloe.testing.memory import MemoryServer

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
