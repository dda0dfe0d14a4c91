"""One write task, without Spark: Kafka-layout Arrow in, Parquet files of a real table out."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.config import ErrorsConfig, SourceConfig, TableConfig, config_from_dict
from icefloe.errors import ConfigError, RecordConversionError
from icefloe.events import SourcePosition
from icefloe.records.converter import RecordConverter, TargetTable
from icefloe.testing.fixtures import kafka_rows, make_sqlite_catalog
from icefloe_spark.sink.tables import DEAD_LETTER_SCHEMA, ensure_tables
from icefloe_spark.sink.task import check_columns, source_positions, write_task

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "kind", StringType(), required=False),
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


BAD_VALUES: dict[int, bytes] = {
    2: b'{"id": 2, "kind": ',  # malformed JSON
    5: b'{"id": "abc", "kind": "b"}',  # wrong type for a long column
    7: b'{"kind": "b"}',  # required id missing
}


def mixed_values(n: int = 10) -> list[bytes | None]:
    return [BAD_VALUES.get(i, v) for i, v in enumerate(json_values(range(n)))]


def written_ids(files: tuple[Any, ...]) -> list[int]:
    return sorted(
        i for f in files for i in pq.read_table(f.path.removeprefix("file://"))["id"].to_pylist()
    )


def test_policy_fail_names_the_record_and_the_fix(catalog: Catalog) -> None:
    table = catalog.create_table("db.events", schema=SCHEMA)
    cfg = [TableConfig(name="db.events")]
    with pytest.raises(RecordConversionError) as err:
        write_task(
            kafka_rows(mixed_values(), "orders", 4),
            {"db.events": table},
            converter(catalog, cfg),
            errors=ErrorsConfig(),
        )
    assert (err.value.topic, err.value.partition, err.value.offset) == ("orders", 4, 102)
    assert "[errors] policy" in str(err.value)


def test_policy_skip_writes_the_good_records_and_counts_the_bad(catalog: Catalog) -> None:
    table = catalog.create_table("db.events", schema=SCHEMA)
    cfg = [TableConfig(name="db.events")]
    out = write_task(
        kafka_rows(mixed_values()),
        {"db.events": table},
        converter(catalog, cfg),
        errors=ErrorsConfig(policy="skip"),
    )
    assert written_ids(out.files["db.events"]) == [0, 1, 3, 4, 6, 8, 9]
    assert (out.skipped, out.dead_lettered, out.records) == (3, 0, 10)
    assert out.positions[0].offset == 110  # bad records are consumed too


def test_policy_dead_letter_writes_bad_records_to_the_dead_letter_table(
    catalog: Catalog,
) -> None:
    table = catalog.create_table("db.events", schema=SCHEMA)
    dead = catalog.create_table("db.dead", schema=DEAD_LETTER_SCHEMA)
    cfg = [TableConfig(name="db.events")]
    values = mixed_values()
    data = kafka_rows(values, "orders", 4)
    keys = pa.array([f"k{i}".encode() for i in range(10)], pa.binary())
    data = data.set_column(0, "key", keys)
    out = write_task(
        data,
        {"db.events": table, "db.dead": dead},
        converter(catalog, cfg),
        errors=ErrorsConfig(policy="dead_letter", dead_letter_table="db.dead"),
        pipeline="pipe",
    )
    assert written_ids(out.files["db.events"]) == [0, 1, 3, 4, 6, 8, 9]
    assert (out.skipped, out.dead_lettered) == (0, 3)
    assert out.table_uuids["db.dead"] == str(dead.metadata.table_uuid)
    rows = pa.concat_tables(
        pq.read_table(f.path.removeprefix("file://")) for f in out.files["db.dead"]
    ).sort_by("offset")
    got = rows.select(["pipeline", "topic", "partition", "offset", "key", "value"]).to_pylist()
    assert got == [
        {
            "pipeline": "pipe",
            "topic": "orders",
            "partition": 4,
            "offset": 100 + i,
            "key": f"k{i}".encode(),
            "value": values[i],
        }
        for i in sorted(BAD_VALUES)
    ]
    assert rows["error_type"].to_pylist() == ["decode", "conform", "conform"]
    assert rows["target_table"].to_pylist() == [None, "db.events", "db.events"]
    assert "@105" in rows["error_message"][1].as_py()
    assert rows["timestamp"][0].as_py() == datetime(2024, 5, 1, 12, 0, 2, tzinfo=UTC)
    assert None not in rows["failed_at"].to_pylist()
    assert dead.current_snapshot() is None  # written, never committed by a task


def test_dead_letter_table_is_created_once_with_its_schema(catalog: Catalog) -> None:
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "tables": [{"name": "db.events"}],
            "errors": {"policy": "dead_letter", "dead_letter_table": "bad.records"},
        }
    )
    catalog.create_table("db.events", schema=SCHEMA)
    assert ensure_tables(catalog, config) == ["bad.records"]
    assert ensure_tables(catalog, config) == []
    schema = catalog.load_table("bad.records").schema()
    assert schema.column_names == DEAD_LETTER_SCHEMA.column_names
    catalog.create_table("bad.other", schema=SCHEMA)
    other = config.model_copy(
        update={"errors": ErrorsConfig(policy="dead_letter", dead_letter_table="bad.other")}
    )
    with pytest.raises(ConfigError) as err:
        ensure_tables(catalog, other)
    assert err.value.key == "errors.dead_letter_table"
