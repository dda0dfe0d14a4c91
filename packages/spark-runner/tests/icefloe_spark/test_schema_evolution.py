"""JSON auto-create, schema evolution, name mapping and dynamic fan-out, without Spark: one
write task's :class:`TableResolver` and ``write_task`` against a real SQLite catalog and real
Parquet files, committed by the real committer; rows are counted with pyiceberg's own scan."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import MappedField, NameMapping
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    DoubleType,
    FloatType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
    StructType,
    TimestamptzType,
)

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.config import ErrorsConfig, PipelineConfig, config_from_dict
from icefloe.errors import RecordConversionError, RecordRouteError
from icefloe.hookspecs import INFER_ALL_KEY
from icefloe.testing.fixtures import kafka_rows, make_sqlite_catalog
from icefloe_spark.sink.tables import TableResolver
from icefloe_spark.sink.task import TaskOutput, write_task


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = make_sqlite_catalog(tmp_path / "iceberg")
    cat.create_namespace("db")
    return cat


def pipeline(tables: list[dict[str, Any]], **extra: Any) -> PipelineConfig:
    return config_from_dict({"name": "p", "source": {"topics": ["t"]}, "tables": tables, **extra})


def encode(records: Sequence[dict[str, Any] | str]) -> list[bytes | None]:
    return [(r if isinstance(r, str) else json.dumps(r)).encode() for r in records]


def run_batch(
    catalog: Catalog,
    config: PipelineConfig,
    records: Sequence[dict[str, Any] | str],
    seq: int,
    commit: bool = True,
) -> TaskOutput:
    """One task's batch: prepare (create/evolve), write, and (like the coordinator) commit."""
    data = kafka_rows(encode(records))
    tables, converter = TableResolver(catalog, config).prepare(data)
    out = write_task(data, tables, converter, errors=config.errors, pipeline=config.name)
    if commit:
        commit_output(catalog, out, seq)
    return out


def commit_output(catalog: Catalog, out: TaskOutput, seq: int) -> None:
    committer = IcebergCommitter(catalog, "p")
    for name, metas in out.files.items():
        files = tuple(PendingFile(m, "w1", seq, "0", seq, out.table_uuids[name]) for m in metas)
        committer.commit(TableCommitRequest(name, str(uuid.uuid4()), files, {"0": seq + 1}, {}, 1))


def scan(catalog: Catalog, name: str) -> list[dict[str, Any]]:
    rows = catalog.load_table(name).scan().to_arrow().to_pylist()
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def test_json_auto_create_infers_the_schema_with_spec_and_identifier(catalog: Catalog) -> None:
    config = pipeline(
        [
            {
                "name": "db.events",
                "auto_create": True,
                "infer_timestamps": True,
                "partition_by": ["region"],
                "id_columns": ["id"],
            }
        ]
    )
    records = [
        {
            "id": i,
            "region": "eu" if i % 2 else "us",
            "price": i + 0.5,
            "at": f"2024-05-01T12:00:0{i}Z",
            "tags": ["a", "b"][: i % 3],
            "user": {"name": f"u{i}", "age": 20 + i},
        }
        for i in range(6)
    ]
    out = run_batch(catalog, config, records, 0)
    table = catalog.load_table("db.events")
    schema = table.schema()
    assert schema.find_field("id").field_type == LongType()
    assert schema.find_field("id").required
    assert schema.identifier_field_names() == {"id"}
    assert schema.find_field("price").field_type == DoubleType()
    assert schema.find_field("at").field_type == TimestamptzType()
    assert isinstance(schema.find_field("tags").field_type, ListType)
    user = schema.find_field("user").field_type
    assert isinstance(user, StructType)
    assert user.field_by_name("age").field_type == LongType()  # type: ignore[union-attr]
    assert not schema.find_field("user").required
    assert not schema.find_field("price").required
    spec = table.spec()
    assert [(f.name, f.transform) for f in spec.fields] == [("region", IdentityTransform())]
    assert len(out.files["db.events"]) == 2  # one file per region
    got = scan(catalog, "db.events")
    assert len(got) == len(records)
    assert [r["id"] for r in sorted(got, key=lambda r: r["id"])] == list(range(6))
    assert {r["user"]["name"] for r in got} == {f"u{i}" for i in range(6)}


def test_without_infer_timestamps_iso_text_stays_a_string(catalog: Catalog) -> None:
    config = pipeline([{"name": "db.events", "auto_create": True}])
    run_batch(catalog, config, [{"at": "2024-05-01T12:00:00Z"}, {"at": "2024-05-02"}], 0)
    assert catalog.load_table("db.events").schema().find_field("at").field_type == StringType()
    assert [r["at"] for r in scan(catalog, "db.events")] == ["2024-05-01T12:00:00Z", "2024-05-02"]


OLD = Schema(
    NestedField(1, "id", IntegerType(), required=True),
    NestedField(2, "score", FloatType(), required=False),
    NestedField(3, "name", StringType(), required=True),
    NestedField(
        4, "user", StructType(NestedField(5, "city", StringType(), required=False)), required=False
    ),
    identifier_field_ids=[1],
)


def test_evolution_adds_widens_relaxes_and_keeps_rows_written_under_the_old_schema(
    catalog: Catalog,
) -> None:
    catalog.create_table("db.events", schema=OLD)
    config = pipeline([{"name": "db.events", "evolve_schema": True}])
    old_rows = [{"id": i, "score": 1.5, "name": f"n{i}", "user": {"city": "x"}} for i in range(3)]
    run_batch(catalog, config, old_rows, 0)
    assert catalog.load_table("db.events").schema() == OLD  # nothing new, nothing changed

    # a writer that loaded the table before the change writes under the old schema...
    stale_table = catalog.load_table("db.events")
    stale = TableResolver(catalog, pipeline([{"name": "db.events"}]))
    stale_data = kafka_rows(encode([{"id": 100, "name": "late"}]))
    _, stale_converter = stale.prepare(stale_data)

    new_rows = [
        {"id": 2**40 + i, "score": 1e300, "user": {"city": "y", "zip": f"z{i}"}, "extra": [i]}
        for i in range(4)
    ]
    run_batch(catalog, config, new_rows, 1)
    schema = catalog.load_table("db.events").schema()
    assert schema.find_field("id").field_type == LongType()
    assert schema.find_field("id").required
    assert schema.find_field("score").field_type == DoubleType()
    assert not schema.find_field("name").required  # the new records omit it
    assert schema.find_field("user.zip").field_type == StringType()
    assert schema.find_field("extra").field_type == ListType(
        schema.find_field("extra.element").field_id, LongType(), element_required=False
    )
    assert schema.find_field("id").field_id == 1  # same column, widened in place

    # ...and its file is committed after the change: its rows must not be lost
    out = write_task(stale_data, {"db.events": stale_table}, stale_converter)
    commit_output(catalog, out, 2)

    got = {r["id"]: r for r in scan(catalog, "db.events")}
    assert sorted(got) == [0, 1, 2, 100, *(2**40 + i for i in range(4))]
    assert got[0]["name"] == "n0"
    assert got[0]["user"] == {"city": "x", "zip": None}
    assert got[0]["extra"] is None
    assert got[100]["name"] == "late"
    assert got[2**40 + 3]["user"] == {"city": "y", "zip": "z3"}
    assert got[2**40 + 3]["extra"] == [3]
    assert got[2**40]["score"] == 1e300


def test_a_replayed_batch_changes_the_schema_once(catalog: Catalog) -> None:
    catalog.create_table("db.events", schema=OLD)
    config = pipeline([{"name": "db.events", "evolve_schema": True}])
    records = [{"id": 1, "name": "a", "added": True}]
    run_batch(catalog, config, records, 0, commit=False)
    first = catalog.load_table("db.events").metadata
    run_batch(catalog, config, records, 0, commit=False)
    again = catalog.load_table("db.events").metadata
    assert again.current_schema_id == first.current_schema_id
    assert len(again.schemas) == 2


def test_an_incompatible_value_goes_to_the_error_policy(catalog: Catalog) -> None:
    catalog.create_table("db.events", schema=OLD)
    catalog.create_namespace("bad")
    errors = {"policy": "dead_letter", "dead_letter_table": "bad.records"}
    config = pipeline([{"name": "db.events", "evolve_schema": True}], errors=errors)
    from icefloe_spark.sink.tables import ensure_dead_letter_table

    ensure_dead_letter_table(catalog, config)
    records: list[dict[str, Any] | str] = [
        {"id": 1, "name": "a"},
        {"id": "not a number", "name": "b"},  # a string into the (int) id column
        {"id": 3, "name": "c", "user": 7},  # a number where a struct is
        {"id": 4, "name": "d", "new": 1},
    ]
    out = run_batch(catalog, config, records, 0)
    assert out.dead_lettered == 2
    assert sorted(r["id"] for r in scan(catalog, "db.events")) == [1, 4]
    dead = scan(catalog, "bad.records")
    assert sorted(r["offset"] for r in dead) == [101, 102]
    assert {r["error_type"] for r in dead} == {"conform"}
    schema = catalog.load_table("db.events").schema()
    assert schema.find_field("id").field_type == IntegerType()  # never changed to a string
    assert schema.find_field("new").field_type == LongType()

    with pytest.raises(RecordConversionError, match="'id'"):  # policy fail: the task fails
        run_batch(catalog, pipeline([{"name": "db.events", "evolve_schema": True}]), records, 1)


def test_rename_map_and_the_tables_name_mapping(catalog: Catalog) -> None:
    mapping = NameMapping(
        [
            MappedField(field_id=1, names=["id"]),  # type: ignore[call-arg]  # by name
            MappedField(field_id=2, names=["user_name", "userName"]),  # type: ignore[call-arg]
        ]
    )
    catalog.create_table(
        "db.events",
        schema=Schema(
            NestedField(1, "id", LongType(), required=False),
            NestedField(2, "user_name", StringType(), required=False),
        ),
        properties={"schema.name-mapping.default": mapping.model_dump_json()},
    )
    config = pipeline([{"name": "db.events", "rename": {"uid": "id"}, "evolve_schema": True}])
    run_batch(
        catalog, config, [{"uid": 7, "userName": "ann"}, {"uid": 8, "userName": "bo", "x": 1}], 0
    )
    table = catalog.load_table("db.events")
    assert table.schema().column_names == ["id", "user_name", "x"]  # no column for aliases
    got = scan(catalog, "db.events")
    assert [(r["id"], r["user_name"], r["x"]) for r in got] == [(7, "ann", None), (8, "bo", 1)]
    # the new column joined the table's name mapping
    names = {f.field_id: f.names for f in table.name_mapping().root}  # type: ignore[union-attr]
    assert names[table.schema().find_field("x").field_id] == ["x"]


def test_dynamic_fan_out_creates_a_table_per_named_value(catalog: Catalog) -> None:
    catalog.create_namespace("bad")
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {
                "route_field": "type",
                "namespace": "ev",
                "auto_create": True,
                "evolve_schema": True,
            },
            "errors": {"policy": "dead_letter", "dead_letter_table": "bad.records"},
        }
    )
    from icefloe_spark.sink.tables import ensure_dead_letter_table

    ensure_dead_letter_table(catalog, config)
    records: list[dict[str, Any] | str] = [
        {"type": "Click", "x": 1},
        {"type": "view", "page": "a"},
        {"type": "click", "x": 2, "y": 3.5},
        {"x": 4},  # no table named
        {"type": "has space", "x": 5},  # not a table name
        {"type": "view", "page": "b"},
    ]
    out = run_batch(catalog, config, records, 0)
    assert sorted(out.files) == ["bad.records", "ev.click", "ev.view"]
    clicks = scan(catalog, "ev.click")
    assert [(r["x"], r["y"]) for r in clicks] == [(1, None), (2, 3.5)]
    assert [r["page"] for r in scan(catalog, "ev.view")] == ["a", "b"]
    assert "page" not in catalog.load_table("ev.click").schema().column_names
    dead = scan(catalog, "bad.records")
    assert sorted(r["offset"] for r in dead) == [103, 104]
    assert all("dynamic_tables" in r["error_message"] for r in dead)
    # the next batch reuses the tables and evolves them
    run_batch(catalog, config, [{"type": "view", "page": "c", "ms": 3}], 1)
    assert {r["page"]: r["ms"] for r in scan(catalog, "ev.view")} == {"a": None, "b": None, "c": 3}


def test_existing_dynamic_tables_are_found_from_the_route_field_alone(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose dynamic tables all exist (nothing to create or evolve) needs only its
    route field to find them: the records were decoded in full, every type inferred, and then
    again by the converter (a third of a task's CPU at 10 dynamic tables). A table to create
    still gets the full decode it is created from; one that cannot be created leaves its
    records unrouted, as before."""
    catalog.create_namespace("bad")
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {"route_field": "type", "namespace": "ev", "auto_create": True},
            "errors": {"policy": "dead_letter", "dead_letter_table": "bad.records"},
        }
    )
    from icefloe_spark.sink.tables import ensure_dead_letter_table

    ensure_dead_letter_table(catalog, config)
    run_batch(catalog, config, [{"type": "click", "x": 1}, {"type": "view", "page": "a"}], 0)
    hints: list[pa.Schema] = []
    codec = type(TableResolver(catalog, config).base.codec)
    original = codec.decode

    def recorded(self: Any, values: pa.Array, schema: pa.Schema, context: Any) -> pa.Table:
        hints.append(schema)
        return original(self, values, schema, context)

    monkeypatch.setattr(codec, "decode", recorded)
    out = run_batch(catalog, config, [{"type": "view", "page": "b"}, {"type": "click", "x": 2}], 1)
    assert sorted(out.files) == ["ev.click", "ev.view"]
    inferred = [h for h in hints if (h.metadata or {}).get(INFER_ALL_KEY) == b"true"]
    assert inferred == [], "the records were decoded in full to find their tables"
    assert hints[0].names == ["type"]
    assert [r["x"] for r in scan(catalog, "ev.click")] == [1, 2]
    assert [r["page"] for r in scan(catalog, "ev.view")] == ["a", "b"]

    hints.clear()  # a new table: created from the fully decoded rows
    run_batch(catalog, config, [{"type": "buy", "sku": "k"}, {"type": "view", "page": "c"}], 2)
    assert any((h.metadata or {}).get(INFER_ALL_KEY) == b"true" for h in hints)
    assert [r["sku"] for r in scan(catalog, "ev.buy")] == ["k"]
    assert [r["page"] for r in scan(catalog, "ev.view")] == ["a", "b", "c"]

    fixed = config.model_copy(
        update={"dynamic_tables": config.dynamic_tables.model_copy(update={"auto_create": False})}  # type: ignore[union-attr]
    )
    out = run_batch(catalog, fixed, [{"type": "new", "z": 1}, {"type": "buy", "sku": "m"}], 3)
    assert sorted(out.files) == ["bad.records", "ev.buy"]
    assert not catalog.table_exists("ev.new")
    assert [r["sku"] for r in scan(catalog, "ev.buy")] == ["k", "m"]


def test_route_regex_routes_static_tables(catalog: Catalog) -> None:
    schema = Schema(NestedField(1, "kind", StringType(), required=False))
    catalog.create_table("db.orders", schema=schema)
    catalog.create_table("db.other", schema=schema)
    config = pipeline(
        [
            {"name": "db.orders", "route_field": "kind", "route_regex": "order[.-].*"},
            {"name": "db.other", "route_field": "kind", "route_values": ["misc"]},
        ]
    )
    records = [{"kind": k} for k in ("order.new", "order-paid", "orders", "misc", "order.x")]
    data = kafka_rows(encode(records))
    tables, converter = TableResolver(catalog, config).prepare(data)
    with pytest.raises(RecordRouteError, match=r"no table takes the record.*'orders'"):
        write_task(data, tables, converter)
    out = run_batch(
        catalog, config.model_copy(update={"errors": ErrorsConfig(policy="skip")}), records, 0
    )
    assert out.skipped == 1
    assert [r["kind"] for r in scan(catalog, "db.orders")] == ["order-paid", "order.new", "order.x"]
    assert [r["kind"] for r in scan(catalog, "db.other")] == ["misc"]


def test_written_files_carry_the_evolved_field_ids(catalog: Catalog) -> None:
    """A file is only written after its schema is in the catalog: its Parquet field ids are
    the table's, so any engine reads it by id."""
    catalog.create_table("db.events", schema=OLD)
    config = pipeline([{"name": "db.events", "evolve_schema": True}])
    out = run_batch(catalog, config, [{"id": 1, "name": "a", "fresh": "v"}], 0, commit=False)
    fresh_id = catalog.load_table("db.events").schema().find_field("fresh").field_id
    path = out.files["db.events"][0].path.removeprefix("file://")
    field = pq.read_schema(path).field("fresh")
    assert field.metadata[b"PARQUET:field_id"] == str(fresh_id).encode()
    assert pa.types.is_string(field.type) or pa.types.is_large_string(field.type)


def test_a_worker_reuses_a_table_version_while_the_catalog_names_it(catalog: Catalog) -> None:
    """Issue 27: a task loads every table it writes; an unchanged one is looked up by its
    metadata location instead of loaded again, and a change committed elsewhere is seen by
    the next task (it fails if the version is reused without asking the catalog)."""
    schema = Schema(NestedField(1, "type", StringType()), NestedField(2, "x", LongType()))
    catalog.create_table("db.click", schema=schema)
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {"route_field": "type", "namespace": "db"},
        }
    )
    resolver = TableResolver(catalog, config)
    data = kafka_rows(encode([{"type": "click", "x": 1, "y": "a"}]))
    first, _ = resolver.prepare(data)
    second, _ = resolver.prepare(data)
    assert second["db.click"] is not first["db.click"]  # a Table of its own per task
    assert second["db.click"].metadata is first["db.click"].metadata  # not loaded again
    with catalog.load_table("db.click").update_schema() as update:  # another writer
        update.add_column("y", StringType())
    third, converter = resolver.prepare(data)
    assert third["db.click"].schema().column_names == ["type", "x", "y"]
    assert converter.convert(data)["db.click"].column("y").to_pylist() == ["a"]
