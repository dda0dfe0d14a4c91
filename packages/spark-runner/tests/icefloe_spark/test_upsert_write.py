"""One write task for upsert/CDC tables, without Spark: real SQLite catalog, real Parquet files.

The files are read back with pyarrow.parquet (not the code under test): data files hold the final
row image per key, key files the touched keys under the table's identifier field ids."""

from __future__ import annotations

import io
import json
import tomllib
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType, StructType

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.config import ErrorsConfig, PipelineConfig, config_from_dict
from icefloe.errors import KeyedTableError, RecordConversionError
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import written_for
from icefloe.testing.fixtures import kafka_rows, make_sqlite_catalog
from icefloe_spark.sink.tables import TableResolver, ensure_tables
from icefloe_spark.sink.task import TaskOutput, write_task

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "region", StringType(), required=True),
    NestedField(3, "name", StringType(), required=False),
    identifier_field_ids=[1],
)


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = make_sqlite_catalog(tmp_path / "iceberg")
    cat.create_namespace("db")
    return cat


def pipeline(**table: Any) -> PipelineConfig:
    entry = {"name": "db.users", "mode": "cdc", "id_columns": ["id"], **table}
    return config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "tables": [entry],
            "errors": {"policy": "skip"},
        }
    )


def debezium(changes: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]) -> pa.Table:
    values = [json.dumps({"op": op, "before": b, "after": a}).encode() for op, b, a in changes]
    return kafka_rows(values)  # type: ignore[arg-type]


def run(catalog: Catalog, config: PipelineConfig, data: pa.Table) -> TaskOutput:
    ensure_tables(catalog, config)
    tables, converter = TableResolver(catalog, config).prepare(data)
    return write_task(data, tables, converter, errors=config.errors, pipeline=config.name)


def split(files: tuple[DataFileMeta, ...]) -> tuple[list[DataFileMeta], list[DataFileMeta]]:
    data = [f for f in files if f.content == FileContent.DATA]
    keys = [f for f in files if f.content == FileContent.EQUALITY_DELETES]
    assert len(data) + len(keys) == len(files)
    return data, keys


def read(metas: list[DataFileMeta]) -> list[dict[str, Any]]:
    rows = [r for m in metas for r in pq.read_table(m.path.removeprefix("file://")).to_pylist()]
    return sorted(rows, key=lambda r: tuple(str(v) for v in r.values()))


def field_ids(meta: DataFileMeta) -> dict[str, int]:
    schema = pq.read_schema(meta.path.removeprefix("file://"))
    return {f.name: int((f.metadata or {})[b"PARQUET:field_id"]) for f in schema}


CHANGES: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = [
    ("r", None, {"id": 1, "region": "eu", "name": "ann"}),
    ("c", None, {"id": 2, "region": "us", "name": "bob"}),
    ("u", {"id": 1}, {"id": 1, "region": "eu", "name": "anna"}),
    ("d", {"id": 2, "region": "us", "name": "bob"}, None),
    ("c", None, {"id": 3, "region": "us", "name": "cy"}),
    ("d", {"id": 4}, None),  # a row written by an earlier cycle
    ("u", {"id": 3}, {"id": 3, "region": "eu", "name": "cy"}),  # moves partition
]


def test_a_cdc_task_writes_final_rows_and_a_key_file(catalog: Catalog) -> None:
    catalog.create_table("db.users", schema=SCHEMA)
    out = run(catalog, pipeline(), debezium(CHANGES))
    data, keys = split(out.files["db.users"])
    assert read(data) == [
        {"id": 1, "region": "eu", "name": "anna"},
        {"id": 3, "region": "eu", "name": "cy"},
    ]
    assert sum(f.record_count for f in data) == 2
    assert len(keys) == 1
    key = keys[0]
    assert read(keys) == [{"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}]
    assert key.record_count == 4
    assert field_ids(key) == {"id": 1}
    assert key.equality_ids == (1,)
    assert key.partition == ()
    assert key.file_format == "PARQUET"
    assert key.file_size_in_bytes == Path(key.path.removeprefix("file://")).stat().st_size
    assert key.lower_bounds[1] == (1).to_bytes(8, "little")
    assert key.upper_bounds[1] == (4).to_bytes(8, "little")
    # next to the data files, in the table's data directory
    assert Path(key.path).parent == Path(data[0].path).parent
    # named for the pipeline: merge_small_files may delete the data files once merged, the
    # committer the key file once applied (it is never merged: its content is no data)
    name = pipeline().name
    assert all(written_for(f.path, name) for f in data)
    assert written_for(key.path, name)
    assert catalog.load_table("db.users").current_snapshot() is None  # a task never commits


def test_a_partitioned_table_gets_partitioned_rows_and_one_unpartitioned_key_file(
    catalog: Catalog,
) -> None:
    spec = PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "region"))
    catalog.create_table("db.users", schema=SCHEMA, partition_spec=spec)
    out = run(catalog, pipeline(), debezium(CHANGES))
    data, keys = split(out.files["db.users"])
    assert [f.partition[0].value for f in data] == ["eu"]  # both final rows are in "eu"
    assert [(k.partition, k.equality_ids) for k in keys] == [((), (1,))]
    assert read(keys) == [{"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}]


def test_only_deletes_write_only_a_key_file(catalog: Catalog) -> None:
    catalog.create_table("db.users", schema=SCHEMA)
    out = run(catalog, pipeline(), debezium([("d", {"id": 7}, None), ("d", {"id": 7}, None)]))
    data, keys = split(out.files["db.users"])
    assert data == []
    assert read(keys) == [{"id": 7}]


def test_bad_change_records_meet_the_error_policy(catalog: Catalog) -> None:
    catalog.create_table("db.users", schema=SCHEMA)
    changes = [*CHANGES[:2], ("t", None, {"id": 9, "region": "eu"}), ("d", {"region": "x"}, None)]
    out = run(catalog, pipeline(), debezium(changes))
    assert out.skipped == 2
    data, keys = split(out.files["db.users"])
    assert [r["id"] for r in read(data)] == [1, 2]
    assert read(keys) == [{"id": 1}, {"id": 2}]
    failing = pipeline().model_copy(update={"errors": ErrorsConfig(policy="fail")})
    with pytest.raises(RecordConversionError, match="op 't'") as err:
        run(catalog, failing, debezium(changes))
    assert err.value.offset == 102


def test_upsert_tables_auto_created_from_records_are_v2_with_identifier_fields(
    catalog: Catalog,
) -> None:
    config = pipeline(mode="upsert", id_columns=["region", "id"], auto_create=True)
    values = [json.dumps({"id": i % 3, "region": "eu", "name": f"n{i}"}).encode() for i in range(7)]
    out = run(catalog, config, kafka_rows(values))  # type: ignore[arg-type]
    table = catalog.load_table("db.users")
    assert table.format_version == 2
    assert table.schema().identifier_field_names() == {"region", "id"}
    assert all(table.schema().find_field(c).required for c in ("region", "id"))
    data, keys = split(out.files["db.users"])
    assert read(data) == [
        {"id": 0, "region": "eu", "name": "n6"},
        {"id": 1, "region": "eu", "name": "n4"},
        {"id": 2, "region": "eu", "name": "n5"},
    ]
    ids = field_ids(keys[0])
    assert ids == {n: table.schema().find_field(n).field_id for n in ("id", "region")}
    assert set(keys[0].equality_ids or ()) == set(ids.values())


def test_a_cdc_table_auto_created_from_debezium_envelopes_has_the_row_columns(
    catalog: Catalog,
) -> None:
    out = run(catalog, pipeline(auto_create=True), debezium(CHANGES))
    table = catalog.load_table("db.users")
    assert sorted(table.schema().column_names) == ["id", "name", "region"]
    assert table.schema().identifier_field_names() == {"id"}
    assert [r["id"] for r in read(split(out.files["db.users"])[0])] == [1, 3]


def test_an_existing_table_without_matching_identifier_fields_is_refused(
    catalog: Catalog,
) -> None:
    catalog.create_table(
        "db.users", schema=Schema(*SCHEMA.fields), properties={"format-version": "2"}
    )
    with pytest.raises(KeyedTableError) as err:
        ensure_tables(catalog, pipeline())
    assert err.value.key == "tables.id_columns"
    assert "identifier fields []" in err.value.problem
    assert "set_identifier_fields('id')" in err.value.fix
    assert "SET IDENTIFIER FIELDS id" in err.value.fix
    with pytest.raises(KeyedTableError, match="identifier fields"):
        TableResolver(catalog, pipeline()).prepare(debezium(CHANGES))
    with pytest.raises(KeyedTableError, match=r"has no column\(s\) \['uid'\]"):
        ensure_tables(catalog, pipeline(id_columns=["uid"]))


def test_a_format_version_1_table_is_refused_for_cdc(catalog: Catalog) -> None:
    catalog.create_table("db.users", schema=SCHEMA, properties={"format-version": "1"})
    with pytest.raises(KeyedTableError, match="format version 1") as err:
        ensure_tables(catalog, pipeline())
    assert "upgrade_table_version(2)" in err.value.fix
    ensure_tables(catalog, pipeline(mode="append"))  # an append table may stay version 1


def test_the_documented_debezium_example_writes_what_the_docs_say(tmp_path: Path) -> None:
    """docs/upsert.md: its first TOML example and its three sample events."""
    doc = (Path(__file__).parents[4] / "docs" / "upsert.md").read_text()
    block = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    events = doc.split("```json\n", 1)[1].split("```", 1)[0].strip().splitlines()
    data = tomllib.loads(block)
    data["catalog"]["properties"] = {
        "type": "sql",
        "uri": f"sqlite:///{tmp_path}/catalog.db",
        "warehouse": f"file://{tmp_path}/warehouse",
    }
    config = config_from_dict(data)
    catalog = load_catalog("docs", **config.catalog.properties)
    catalog.create_namespace("crm")
    out = run(catalog, config, kafka_rows([e.encode() for e in events]))
    table = catalog.load_table("crm.customers")
    assert (table.format_version, table.schema().identifier_field_names()) == (2, {"id"})
    rows, keys = split(out.files["crm.customers"])
    assert read(rows) == [{"id": 1001, "email": "sally@example.org", "tier": "gold"}]
    assert read(keys) == [{"id": 1001}, {"id": 1002}]


ENVELOPE = {
    "type": "record",
    "name": "Envelope",
    "fields": [
        {
            "name": "before",
            "type": [
                "null",
                {
                    "type": "record",
                    "name": "Value",
                    "fields": [
                        {"name": "id", "type": "long"},
                        {"name": "email", "type": ["null", "string"]},
                    ],
                },
            ],
        },
        {"name": "after", "type": ["null", "Value"]},
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"]},
    ],
}


def test_a_table_created_from_a_declared_debezium_schema_takes_the_row_columns(
    catalog: Catalog,
) -> None:
    source = {"topics": ["t"], "format": "avro", "format_options": {"schema": json.dumps(ENVELOPE)}}
    entry = {"name": "db.users", "mode": "cdc", "id_columns": ["id"], "auto_create": True}
    config = config_from_dict({"name": "p", "source": source, "tables": [entry]})
    assert ensure_tables(catalog, config) == ["db.users"]
    table = catalog.load_table("db.users")
    assert table.schema().column_names == ["id", "email"]
    assert table.schema().identifier_field_names() == {"id"}
    assert table.format_version == 2
    parsed = fastavro.parse_schema(ENVELOPE)
    events = [
        {"op": "c", "before": None, "after": {"id": 5, "email": "a@x"}, "ts_ms": 1},
        {"op": "u", "before": None, "after": {"id": 5, "email": "b@x"}, "ts_ms": 2},
        {"op": "d", "before": {"id": 6, "email": None}, "after": None, "ts_ms": 3},
    ]
    values = []
    for event in events:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, event)
        values.append(buf.getvalue())
    out = run(catalog, config, kafka_rows(values))  # type: ignore[arg-type]
    rows, keys = split(out.files["db.users"])
    assert read(rows) == [{"id": 5, "email": "b@x"}]
    assert read(keys) == [{"id": 5}, {"id": 6}]


# identifier fields nested in a struct (Iceberg allows them in required structs); the struct
# holds a field that is not part of the key
NESTED = Schema(
    NestedField(
        1,
        "key",
        StructType(
            NestedField(2, "tenant", StringType(), required=True),
            NestedField(3, "id", LongType(), required=True),
            NestedField(4, "label", StringType(), required=False),
        ),
        required=True,
    ),
    NestedField(5, "name", StringType(), required=False),
    identifier_field_ids=[2, 3],
)


def _key(tenant: str, id_: int, name: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"key": {"tenant": tenant, "id": id_, "label": f"{tenant}{id_}"}}
    return row if name is None else {**row, "name": name}


@pytest.mark.parametrize("created_by", ["catalog", "auto_create"])
def test_a_table_keyed_by_fields_nested_in_a_struct_takes_upserts_and_deletes(
    catalog: Catalog, created_by: str
) -> None:
    if created_by == "catalog":
        catalog.create_table("db.users", schema=NESTED)
    config = pipeline(id_columns=["key.tenant", "key.id"], auto_create=created_by != "catalog")
    committer = IcebergCommitter(catalog, config.name)

    def cycle(seq: int, changes: list[tuple[str, Any, Any]]) -> None:
        out = run(catalog, config, debezium(changes))
        uid = str(catalog.load_table("db.users").metadata.table_uuid)
        files = tuple(PendingFile(m, "w", seq, "0", seq, uid) for m in out.files["db.users"])
        request = TableCommitRequest("db.users", f"c{seq}", files, {"0": seq + 1}, {}, 1)
        assert committer.commit(request).snapshot_id is not None

    cycle(0, [("c", None, _key("a", 1, "ann")), ("c", None, _key("b", 1, "bob"))])
    cycle(1, [("u", _key("a", 1), _key("a", 1, "anna")), ("c", None, _key("a", 2, "al"))])
    cycle(2, [("d", _key("b", 1), None), ("u", _key("a", 2), _key("a", 2, "alf"))])

    table = catalog.load_table("db.users")
    tenant, id_ = (table.schema().find_field(n) for n in ("key.tenant", "key.id"))
    assert table.schema().identifier_field_ids == [tenant.field_id, id_.field_id]
    assert [f.required for f in (tenant, id_, table.schema().find_field("key"))] == [True] * 3
    rows = table.scan().to_arrow().to_pylist()  # pyiceberg applies the position deletes
    assert sorted((r["key"]["tenant"], r["key"]["id"], r["name"]) for r in rows) == [
        ("a", 1, "anna"),
        ("a", 2, "alf"),
    ]


@pytest.mark.parametrize("evolve", [False, True], ids=["fixed-schema", "evolve-schema"])
def test_a_dynamic_cdc_table_takes_a_batch_of_only_deletes(catalog: Catalog, evolve: bool) -> None:
    """An existing dynamic table whose records in a batch are all deletes: Debezium's delete
    has no ``after`` image, so the rows its table would be created or evolved from are none.
    The table was then left out of the task's tables and its deletes failed as unrouted; the
    table exists, so it takes them, whether it evolves its schema or not."""
    catalog.create_table("db.users", schema=SCHEMA)
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {
                "route_field": "tenant",
                "namespace": "db",
                "mode": "cdc",
                "id_columns": ["id"],
                "evolve_schema": evolve,
            },
        }
    )
    values = [
        json.dumps({"op": "d", "before": {"id": 7}, "after": None, "tenant": "users"}).encode()
    ]
    out = run(catalog, config, kafka_rows(values))  # type: ignore[arg-type]
    data, keys = split(out.files["db.users"])
    assert data == []
    assert read(keys) == [{"id": 7}]
