"""One write task, without Spark: Kafka-layout Arrow in, Parquet files of a real table out."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.config import SourceConfig, TableConfig
from icefloe.convert import RecordConverter, TargetTable
from icefloe.errors import ConfigError, RecordConversionError
from icefloe.events import SourcePosition
from icefloe.testing.fixtures import make_sqlite_catalog
from icefloe_spark.batch import check_columns, source_positions, write_task

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "kind", StringType(), required=False),
)


def kafka_rows(values: list[bytes | None], topic: str = "t", partition: int = 0) -> pa.Table:
    """Rows in Spark's Kafka layout, as the sink receives them."""
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


def json_values(ids: range) -> list[bytes | None]:
    return [json.dumps({"id": i, "kind": "ab"[i % 2]}).encode() for i in ids]


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = make_sqlite_catalog(tmp_path / "iceberg")
    cat.create_namespace("db")
    return cat


def converter(catalog: Catalog, configs: list[TableConfig]) -> RecordConverter:
    targets = [TargetTable.of(c, catalog.load_table(c.name)) for c in configs]
    return RecordConverter.from_config(SourceConfig(topics=["t"]), targets)


def test_positions_per_source_partition() -> None:
    data = pa.concat_tables(
        [
            kafka_rows([b"{}"] * 3, "a", 0),
            kafka_rows([b"{}"] * 5, "a", 1),
            kafka_rows([b"{}"], "b", 0),
        ]
    )
    ms = int(datetime(2024, 5, 1, 12, 0, tzinfo=UTC).timestamp() * 1000)
    assert source_positions(data) == (
        SourcePosition("a", 0, 103, ms + 2000),
        SourcePosition("a", 1, 105, ms + 4000),
        SourcePosition("b", 0, 101, ms),
    )
    assert source_positions(data.slice(0, 0)) == ()
    no_ts = data.drop_columns(["timestamp"])
    assert source_positions(no_ts)[0] == SourcePosition("a", 0, 103, None)
    null_ts = data.set_column(5, "timestamp", pa.nulls(data.num_rows, data["timestamp"].type))
    assert source_positions(null_ts)[2] == SourcePosition("b", 0, 101, None)


def test_input_without_the_kafka_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="offset"):
        check_columns(["key", "value", "topic", "partition"])


def test_task_writes_partitioned_files_and_reports_them(catalog: Catalog) -> None:
    table = catalog.create_table(
        "db.events",
        schema=SCHEMA,
        partition_spec=PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "kind")),
    )
    cfg = [TableConfig(name="db.events")]
    seen: list[str] = []
    out = write_task(
        kafka_rows(json_values(range(10))),
        {"db.events": table},
        converter(catalog, cfg),
        on_file=seen.append,
    )
    files = out.files["db.events"]
    assert len(files) == 2  # one per value of the partition field
    assert sorted(f.path for f in files) == sorted(seen)
    assert sum(f.record_count for f in files) == 10
    assert {f.partition[0].value for f in files} == {"a", "b"}
    assert out.table_uuids == {"db.events": str(table.metadata.table_uuid)}
    assert out.records == 10
    assert out.positions[0].offset == 110
    ids = sorted(
        i for f in files for i in pq.read_table(f.path.removeprefix("file://"))["id"].to_pylist()
    )
    assert ids == list(range(10))
    assert table.current_snapshot() is None  # a task never commits


def test_rows_are_routed_to_their_tables(catalog: Catalog) -> None:
    for name in ("db.a", "db.b"):
        catalog.create_table(name, schema=SCHEMA)
    cfg = [
        TableConfig(name="db.a", route_field="kind", route_values=["a"]),
        TableConfig(name="db.b", route_field="kind", route_values=["b"]),
    ]
    tables = {c.name: catalog.load_table(c.name) for c in cfg}
    out = write_task(kafka_rows(json_values(range(7))), tables, converter(catalog, cfg))
    assert sum(f.record_count for f in out.files["db.a"]) == 4
    assert sum(f.record_count for f in out.files["db.b"]) == 3


def test_a_record_that_does_not_fit_names_where_it_came_from(catalog: Catalog) -> None:
    table = catalog.create_table("db.events", schema=SCHEMA)
    cfg = [TableConfig(name="db.events")]
    values = [*json_values(range(3)), b'{"kind": "a"}']  # id is required
    with pytest.raises(RecordConversionError) as err:
        write_task(kafka_rows(values, "orders", 4), {"db.events": table}, converter(catalog, cfg))
    assert (err.value.topic, err.value.partition, err.value.offset) == ("orders", 4, 103)
