"""Write plans (icefloe.records.writeplan) and conform targets: what pyiceberg's writer and the
converter derive per table version is kept, and changes nothing written. Real SQLite catalog,
real Parquet files, compared byte for byte with pyiceberg's own writer."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.io import pyarrow as pyiceberg_writer
from pyiceberg.io.pyarrow import _dataframe_to_data_files, schema_to_pyarrow
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import DayTransform, IdentityTransform
from pyiceberg.types import (
    DoubleType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestampType,
)

from icefloe.events import DataFileMeta
from icefloe.records import writeplan
from icefloe.records.conform import conform, table_target
from icefloe.records.datafiles import to_meta, write_data_files

pytestmark = pytest.mark.unit

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "region", StringType(), required=False),
    NestedField(3, "ts", TimestampType(), required=False),
    NestedField(
        4,
        "device",
        StructType(
            NestedField(5, "name", StringType(), required=False),
            NestedField(6, "score", DoubleType(), required=False),
        ),
        required=False,
    ),
    NestedField(7, "tags", ListType(8, StringType(), element_required=False), required=False),
    NestedField(
        9,
        "counts",
        MapType(10, StringType(), 11, LongType(), value_required=False),
        required=False,
    ),
)
SPEC = PartitionSpec(
    PartitionField(2, 1000, IdentityTransform(), "region"),
    PartitionField(3, 1001, DayTransform(), "ts_day"),
)


def _rows(n: int = 40) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "region": None if i % 7 == 6 else ("eu", "us")[i % 2],
            "ts": datetime.datetime(2024, 3, 1 + i % 2, i % 24, 30),
            "device": None if i % 5 == 4 else {"name": f"d{i % 3}", "score": i / 3},
            "tags": [f"t{i % 4}", None] if i % 3 else None,
            "counts": [("a", i), ("b", None)] if i % 2 else [],
        }
        for i in range(n)
    ]


def _data(schema: Schema, rows: list[dict[str, Any]] | None = None) -> pa.Table:
    """Rows in ``schema`` (a table's: the catalog assigns the nested fields' ids)."""
    return pa.Table.from_pylist(_rows() if rows is None else rows, schema=schema_to_pyarrow(schema))


@pytest.fixture(autouse=True)
def fresh_plans() -> Iterator[None]:
    writeplan.clear()
    yield
    writeplan.clear()


@pytest.fixture(params=["unpartitioned", "partitioned"])
def table(request: pytest.FixtureRequest, sqlite_catalog: Catalog) -> Table:
    sqlite_catalog.create_namespace("shop")
    spec = SPEC if request.param == "partitioned" else PartitionSpec()
    return sqlite_catalog.create_table("shop.sales", schema=SCHEMA, partition_spec=spec)


def _leaf_ids(schema: Schema, name: str) -> set[int]:
    """The field ids of a map column's key and value."""
    kind = schema.find_field(name).field_type
    assert isinstance(kind, MapType)
    return {kind.key_id, kind.value_id}


def _local(path: str) -> Path:
    return Path(urlparse(path).path)


def _plain(table: Table, data: pa.Table) -> list[DataFileMeta]:
    """pyiceberg's writer on the table's own metadata: no plan answers any of its calls."""
    files = _dataframe_to_data_files(
        table_metadata=table.metadata, df=data, io=table.io, write_uuid=uuid.uuid4()
    )
    return [to_meta(f, table.metadata) for f in files]


def _by_partition(metas: list[DataFileMeta]) -> dict[Any, DataFileMeta]:
    return {m.partition: m for m in metas}


def _same_files(planned: list[DataFileMeta], plain: list[DataFileMeta]) -> None:
    """Same partitions, the same bytes, and the same metadata but for the file name."""
    a, b = _by_partition(planned), _by_partition(plain)
    assert a.keys() == b.keys()
    for key, meta in a.items():
        other = b[key]
        assert _local(meta.path).read_bytes() == _local(other.path).read_bytes()
        assert replace(meta, path=other.path) == other
        # the field ids inside the file, as pyiceberg wrote them
        ids = [f.metadata for f in pq.read_schema(_local(meta.path))]
        assert ids == [f.metadata for f in pq.read_schema(_local(other.path))]


def test_planned_files_and_metadata_are_the_plain_writers(table: Table) -> None:
    data = _data(table.schema())
    first = write_data_files(table, data)  # fills the plan
    second = write_data_files(table, data)  # answered from it
    plain = _plain(table, data)
    assert plain
    assert len(plain) == (1 if table.spec().is_unpartitioned() else len(first))
    _same_files(first, plain)
    _same_files(second, plain)
    for m in second:  # stats, bounds, counts, sizes: compared above; they exist
        assert m.lower_bounds
        assert m.upper_bounds
        assert m.value_counts
        assert m.column_sizes
    assert sum(m.record_count for m in second) == data.num_rows


def test_the_plan_answers_pyiceberg_s_per_file_calls(table: Table) -> None:
    """Fails when a pyiceberg release renames what the plans wrap (they then do nothing)."""
    data = _data(table.schema())
    write_data_files(table, data)
    write_data_files(table, data)
    assert set(writeplan._installed) == set(writeplan._WRAPPERS)
    plan = writeplan.plan_for(table.metadata, data.schema)
    assert writeplan.plan_for(table.metadata, data.schema) is plan
    kinds = {k if isinstance(k, str) else k[0] for k in plan.derived}
    assert kinds == {
        "pyarrow_to_schema",
        "sanitize_column_names",
        "compute_statistics_plan",
        "parquet_path_to_id_mapping",
        "writer_kwargs",
    }


def test_a_new_schema_gets_a_new_plan(table: Table) -> None:
    write_data_files(table, _data(table.schema()))
    old = writeplan.plan_for(table.metadata, _data(table.schema()).schema)
    with table.update_schema() as update:
        update.add_column("note", StringType())
    schema = table.schema()
    rows = [{**r, "note": f"n{r['id']}"} for r in _rows()]
    metas = write_data_files(table, _data(schema, rows))
    assert writeplan.plan_for(table.metadata, _data(schema).schema) is not old
    note = schema.find_field("note").field_id
    for m in metas:  # the new column is in each file, with its statistics
        assert m.value_counts[note] == m.record_count
        assert "note" in pq.read_schema(_local(m.path)).names
    _same_files(metas, _plain(table, _data(schema, rows)))


def test_a_column_dropped_and_added_again_is_written_with_its_new_field_ids(table: Table) -> None:
    """The rows' Arrow schema is the same as before (names, types, order: Arrow's equality
    leaves out the field ids), so only the schema id tells the plans apart."""
    write_data_files(table, _data(table.schema()))
    old_ids = _leaf_ids(table.schema(), "counts")
    with table.update_schema() as update:
        update.delete_column("counts")
    with table.update_schema() as update:
        update.add_column("counts", MapType(0, StringType(), 0, LongType(), value_required=False))
    schema = table.schema()
    new_ids = _leaf_ids(schema, "counts")
    assert not new_ids & old_ids
    assert _data(schema).schema == _data(SCHEMA).schema  # the same, but for field ids
    metas = write_data_files(table, _data(schema))
    for m in metas:  # the map's key and value columns under their new ids
        assert new_ids <= set(m.value_counts)
        assert not old_ids & set(m.value_counts)
    _same_files(metas, _plain(table, _data(schema)))


def test_a_new_spec_or_new_properties_get_a_new_plan(table: Table) -> None:
    data = _data(table.schema())
    write_data_files(table, data)
    old = writeplan.plan_for(table.metadata, data.schema)
    with table.update_spec() as update:
        update.add_field("id", IdentityTransform(), "id_part")
    assert writeplan.plan_for(table.metadata, data.schema) is not old
    metas = write_data_files(table, data)
    assert {m.spec_id for m in metas} == {table.spec().spec_id}
    assert len(metas) == data.num_rows  # one file per id now
    _same_files(metas, _plain(table, data))
    # properties: counts only for every column from now on
    before = writeplan.plan_for(table.metadata, data.schema)
    with table.transaction() as tx:
        tx.set_properties({"write.metadata.metrics.default": "counts"})
    metas = write_data_files(table, data)
    assert writeplan.plan_for(table.metadata, data.schema) is not before
    assert all(not m.lower_bounds and not m.upper_bounds for m in metas)
    _same_files(metas, _plain(table, data))


def test_pyiceberg_s_configuration_is_read_afresh_outside_icefloe_s_writes() -> None:
    writeplan.install()
    config = vars(pyiceberg_writer)["Config"]  # the name pyiceberg's writer calls
    assert config() is not config()
    with writeplan.writing():
        assert config() is config()


def test_conform_targets_follow_schema_and_name_mapping_changes(sqlite_catalog: Catalog) -> None:
    sqlite_catalog.create_namespace("shop")
    table = sqlite_catalog.create_table("shop.plain", schema=SCHEMA)
    rows = pa.Table.from_pylist([{"id": 1, "region": "eu", "extra": "x"}])
    first = table_target(table)
    assert table_target(sqlite_catalog.load_table("shop.plain")) is first  # per version
    with table.update_schema() as update:
        update.add_column("extra", StringType())
    table = sqlite_catalog.load_table("shop.plain")
    assert "extra" in table_target(table).arrow.names
    out = conform(rows, table.schema(), target=table_target(table))
    assert out.column("extra").to_pylist() == ["x"]
    # an alias in the name mapping: a new mapping property, a new target
    aliased = table.schema().name_mapping.model_dump(mode="json")
    for field in aliased:
        if field["names"] == ["region"]:
            field["names"] = ["region", "area"]
    with table.transaction() as tx:
        tx.set_properties({"schema.name-mapping.default": json.dumps(aliased)})
    table = sqlite_catalog.load_table("shop.plain")
    target = table_target(table)
    assert target.names[2] == ("region", "area")
    out = conform(pa.Table.from_pylist([{"id": 2, "area": "us"}]), table.schema(), target=target)
    assert out.column("region").to_pylist() == ["us"]
