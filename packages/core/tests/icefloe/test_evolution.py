"""Schema inference and evolution (icefloe.records.evolution), field renames, regex and dynamic
routes.

Inference runs on records decoded by the real JSON codec; evolution is applied to tables of a
real SQLite catalog."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.name_mapping import MappedField, NameMapping
from pyiceberg.types import (
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    StructType,
)

from icefloe.config import SourceConfig, TableConfig, config_from_dict
from icefloe.errors import ConfigError, RecordRouteError
from icefloe.records.converter import RecordConverter, TargetTable, renamed
from icefloe.records.evolution import evolve_table, infer_fields, infer_schema, plan_evolution
from icefloe.records.routing import dynamic_values, route_masks
from icefloe.testing.fixtures import kafka_rows, make_sqlite_catalog


def decoded(*records: dict[str, Any] | str) -> list[pa.Table]:
    """Records as the writer's inference sees them: decoded by the JSON codec, every field
    with its own type."""
    values = [(r if isinstance(r, str) else json.dumps(r)).encode() for r in records]
    converter = RecordConverter.from_config(SourceConfig(topics=["t"]), [])
    return converter.decode_parts(kafka_rows(list(values)))


def fields(*records: dict[str, Any] | str, **kw: Any) -> dict[str, pa.Field]:
    (part,) = decoded(*records)
    return {f.name: f for f in infer_fields(part, **kw)}


# --------------------------------------------------------------------------- inference


def test_json_types_are_inferred_as_iceberg_wants_them() -> None:
    got = fields(
        {"i": 1, "f": 1.5, "b": True, "s": "x", "o": {"a": 1, "n": {"z": "q"}}, "l": [1, 2]},
        {"i": 2**40, "f": 2, "b": False, "s": "y", "o": {"a": 2, "c": [{"k": 1.0}]}, "l": []},
    )
    assert got["i"].type == pa.int64()
    assert got["f"].type == pa.float64()  # an integer among fractions: still double
    assert got["b"].type == pa.bool_()
    assert got["s"].type == pa.string()
    o = got["o"].type
    assert o.field("a").type == pa.int64()
    assert not o.field("a").nullable  # every object has it
    assert o.field("n").nullable  # the second object has none
    assert o.field("c").type.value_type.field("k").type == pa.float64()
    assert got["l"].type == pa.list_(pa.int64())


def test_null_only_and_empty_values_add_nothing() -> None:
    got = fields({"a": None, "o": {}, "l": [], "x": 1}, {"a": None, "o": {}, "l": [], "x": 2})
    assert sorted(got) == ["x"]


def test_iso_timestamps_only_when_asked_for() -> None:
    records = ({"t": "2024-05-01T12:00:00Z"}, {"t": "2024-05-01T12:00:01"})
    assert fields(*records)["t"].type == pa.string()
    assert fields(*records, timestamps=True)["t"].type == pa.timestamp("us", "UTC")


def test_a_created_tables_columns_are_all_optional() -> None:
    schema = infer_schema(decoded({"a": 1, "o": {"b": "x"}}, {"a": 2.5, "o": {"b": "y"}}))
    assert schema.field("a").type == pa.float64()  # parts unify: int and double give double
    assert schema.field("a").nullable
    assert schema.field("o").type.field("b").nullable


# --------------------------------------------------------------------------- planning

TABLE = Schema(
    NestedField(1, "id", IntegerType(), required=True),
    NestedField(2, "score", FloatType(), required=False),
    NestedField(3, "name", StringType(), required=True),
    NestedField(4, "user", StructType(NestedField(5, "age", IntegerType(), required=True))),
    NestedField(6, "total", LongType(), required=False),
    identifier_field_ids=[1],
)


def plan(*records: dict[str, Any] | str, schema: Schema = TABLE, **kw: Any) -> Any:
    (part,) = decoded(*records)
    return plan_evolution(schema, infer_fields(part), **kw)


def test_records_that_fit_change_nothing() -> None:
    ev = plan({"id": 1, "score": 0.5, "name": "a", "user": {"age": 3}, "total": 2**40})
    assert not ev
    assert ev.changes == []


def test_new_fields_become_optional_columns_nested_too() -> None:
    ev = plan({"id": 1, "name": "a", "user": {"age": 3, "city": "x"}, "tags": ["t"]})
    assert ev.changes == [
        "add optional column user.city string",
        "add optional column tags list<item: string>",
    ]
    by_name = {f.name: f for f in ev.delta}
    assert by_name["user"].type.field("city").nullable
    assert by_name["tags"].nullable
    # a new struct's own fields are optional too, even when every record has them: the rows
    # of other batches hold no struct at all (a required child there failed the Parquet write)
    (meta,) = plan({"id": 1, "name": "a", "user": {"age": 3}, "meta": {"src": "x"}}).delta
    assert meta.nullable
    assert meta.type.field("src").nullable


def test_values_too_wide_widen_int_to_long_and_float_to_double() -> None:
    ev = plan({"id": 2**40, "name": "a", "user": {"age": 2**33}, "score": 1e300})
    assert ev.changes == [
        "widen id from int to long",
        "widen user.age from int to long",
        "widen score from float to double",
    ]
    by_name = {f.name: f for f in ev.delta}
    assert not by_name["id"].nullable  # still required (an identifier field)
    # a value that fits the column needs no widening
    assert not plan({"id": 5, "score": 0.5, "name": "a", "user": {"age": 1}})


def test_omitted_or_null_required_fields_become_optional_but_identifiers_never() -> None:
    ev = plan({"id": 1, "user": {"age": None}}, {"id": None, "name": None, "user": {"age": 1}})
    assert "make name optional (records omit it)" in ev.changes  # null in all: no type
    assert "make user.age optional (records leave it null)" in ev.changes
    assert not any("make id" in c for c in ev.changes)
    assert plan({"id": 1, "user": {"age": 1}}).changes == ["make name optional (records omit it)"]


def test_incompatible_values_change_nothing_and_are_reported() -> None:
    ev = plan({"id": 1, "name": "a", "user": 7, "total": "many", "score": {"x": 1}})
    assert not ev
    assert ev.conflicts == [
        "user: column is struct<5: age: required int>, records have int64",
        "total: column is long, records have string",
        "score: column is float, records have struct<x: int64 not null>",
    ]


def test_aliases_and_letter_case_find_existing_columns() -> None:
    mapping = NameMapping(
        [
            MappedField(field_id=3, names=["name", "fullName"]),  # type: ignore[call-arg]
            MappedField(field_id=1, names=["id"]),  # type: ignore[call-arg]
        ]
    )
    records = {"id": 1, "fullName": "a", "user": {"age": 1}}
    assert not plan(records, name_mapping=mapping)
    assert plan(records).changes[0] == "add optional column fullName string"
    assert not plan({"ID": 1, "Name": "a", "User": {"AGE": 1}}, case_insensitive=True)


# --------------------------------------------------------------------------- applying


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = make_sqlite_catalog(tmp_path / "iceberg")
    cat.create_namespace("db")
    return cat


def evolve(table: Table, *records: dict[str, Any]) -> Table:
    (part,) = decoded(*records)
    found = infer_fields(part)
    return evolve_table(table, lambda t: plan_evolution(t.schema(), found))


def test_evolution_is_applied_once_and_keeps_field_ids(catalog: Catalog) -> None:
    table = catalog.create_table("db.t", schema=TABLE)
    evolve(table, {"id": 2**40, "name": None, "user": {"age": 1, "city": "x"}})
    schema = catalog.load_table("db.t").schema()
    assert schema.find_field("id") == NestedField(1, "id", LongType(), required=True)
    assert not schema.find_field("name").required
    assert schema.find_field("user.city").field_type == StringType()
    assert schema.identifier_field_ids == [1]
    schemas = len(catalog.load_table("db.t").metadata.schemas)
    evolve(catalog.load_table("db.t"), {"id": 2**40, "name": None, "user": {"age": 1, "city": "y"}})
    assert len(catalog.load_table("db.t").metadata.schemas) == schemas  # nothing new


def test_concurrent_writers_each_add_their_column_once(catalog: Catalog) -> None:
    """Writers holding the same table version race; the loser re-plans on the new schema."""
    catalog.create_table("db.t", schema=TABLE)
    stale = [catalog.load_table("db.t") for _ in range(4)]
    barrier = threading.Barrier(len(stale))
    records: list[dict[str, Any]] = [{"a": 1}, {"b": "x"}, {"a": 2, "c": 1.5}, {"b": "y"}]

    def run(i: int) -> None:
        barrier.wait()
        evolve(stale[i], {"id": 1, "name": "n", "user": {"age": 1}, **records[i]})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stale))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    schema = catalog.load_table("db.t").schema()
    names = [f.name for f in schema.fields]
    assert sorted(names) == ["a", "b", "c", "id", "name", "score", "total", "user"]
    assert schema.find_field("c").field_type == DoubleType()


def test_the_tables_name_mapping_follows_new_columns(catalog: Catalog) -> None:
    mapping = NameMapping(
        [
            MappedField(field_id=i, names=[n])  # type: ignore[call-arg]  # by name, not alias
            for i, n in ((1, "id"), (2, "score"), (3, "name"), (4, "user"), (6, "total"))
        ]
    )
    table = catalog.create_table(
        "db.t", schema=TABLE, properties={"schema.name-mapping.default": mapping.model_dump_json()}
    )
    table = evolve(table, {"id": 1, "name": "n", "user": {"age": 1}, "fresh": 1})
    names = {f.field_id: f.names for f in table.name_mapping().root}  # type: ignore[union-attr]
    assert names[table.schema().find_field("fresh").field_id] == ["fresh"]


# --------------------------------------------------------------------------- renames, routes


def test_rename_maps_source_fields_to_columns_and_is_decoded() -> None:
    schema = Schema(NestedField(1, "id", LongType()), NestedField(2, "city", StringType()))
    target = TargetTable(TableConfig(name="db.t", rename={"uid": "id", "town": "city"}), schema)
    converter = RecordConverter.from_config(SourceConfig(topics=["t"]), [target])
    values = [json.dumps({"uid": 7, "town": "Oslo", "id": 99}).encode()]
    out = converter.convert(kafka_rows(list(values)))["db.t"]
    assert out.to_pylist() == [{"id": 7, "city": "Oslo"}]  # the renamed field wins
    assert renamed(pa.table({"a": [1]}), {}).column_names == ["a"]


def test_route_regex_matches_whole_values() -> None:
    data = pa.table({"k": ["order.new", "order", "xorder.new", None, "refund"]})
    tables = [
        TableConfig(name="db.o", route_field="k", route_regex=r"order\..*"),
        TableConfig(name="db.r", route_field="k", route_values=["refund"], route_regex="x.*"),
    ]
    masks: dict[str, Any] = route_masks(data, tables)
    assert masks["db.o"].to_pylist() == [True, False, False, False, False]
    assert masks["db.r"].to_pylist() == [False, False, True, False, True]


def test_route_regex_is_checked_when_the_config_loads() -> None:
    base = {"name": "p", "source": {"topics": ["t"]}}
    with pytest.raises(ConfigError, match=r"tables\.0\.route_regex") as info:
        config_from_dict(
            {**base, "tables": [{"name": "a.b", "route_field": "k", "route_regex": "(?=x)"}]}
        )
    assert "RE2" in str(info.value)
    with pytest.raises(ConfigError, match="route_regex but no route_field"):
        config_from_dict({**base, "tables": [{"name": "a.b", "route_regex": "x"}]})


def test_dynamic_tables_are_named_by_the_route_field() -> None:
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {"route_field": "m.kind", "namespace": "ev"},
        }
    )
    assert config.tables == []
    dynamic = config.dynamic_tables
    assert dynamic is not None
    data = pa.table(
        {"m": [{"kind": "Click"}, {"kind": "click"}, {"kind": "a b"}, None, {"kind": ""}]}
    )
    assert dynamic_values(data, dynamic) == {"ev.click": ["Click", "click"]}
    entry = dynamic.table_config("ev.click", ["Click", "click"])
    masks: dict[str, Any] = route_masks(data, [entry])
    assert masks["ev.click"].to_pylist() == [True, True, False, False, False]


def test_a_pipeline_needs_some_table() -> None:
    with pytest.raises(ConfigError, match=r"'tables'.*\[dynamic_tables\]"):
        config_from_dict({"name": "p", "source": {"topics": ["t"]}})


def test_records_no_dynamic_table_takes_are_route_errors() -> None:
    converter = RecordConverter.from_config(SourceConfig(topics=["t"]), [])
    converter.route_note = "; see [dynamic_tables]"
    with pytest.raises(RecordRouteError, match=r"no table takes the record.*dynamic_tables"):
        converter.convert(kafka_rows([b'{"kind": "a b"}']))


def test_a_writer_with_an_old_table_version_replans_on_the_new_schema(catalog: Catalog) -> None:
    """Deterministic form of the race: the second writer's update conflicts (its table
    version is old), is re-planned on the refreshed table and adds only what is missing."""
    catalog.create_table("db.t", schema=TABLE)
    first, second = catalog.load_table("db.t"), catalog.load_table("db.t")
    base = {"id": 1, "name": "n", "user": {"age": 1}}
    evolve(first, {**base, "a": 1})
    evolved = evolve(second, {**base, "a": 2, "b": "x"})
    names = [f.name for f in evolved.schema().fields]
    assert names == ["id", "score", "name", "user", "total", "a", "b"]
    assert len(catalog.load_table("db.t").metadata.schemas) == 3
