"""Best-fit conversion to an Iceberg schema (icefloe.records.conform.conform)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import parse_mapping_from_json
from pyiceberg.types import (
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestampType,
    TimestamptzType,
    TimeType,
    UUIDType,
)

from icefloe.errors import RecordConversionError
from icefloe.hookspecs import DecodeContext
from icefloe.records.conform import conform, table_name_mapping

UTC = dt.UTC


def ctx(
    n: int, first_offset: int = 100, topic: str = "events", partition: int = 3
) -> DecodeContext:
    return DecodeContext(
        topics=pa.array([topic] * n),
        partitions=pa.array([partition] * n, pa.int32()),
        offsets=pa.array(range(first_offset, first_offset + n), pa.int64()),
    )


def schema(*fields: NestedField) -> Schema:
    return Schema(*fields)


def one(ice_type: Any, values: list[Any], arrow_type: pa.DataType | None = None) -> list[Any]:
    """Convert one column ``v`` of ``values`` to ``ice_type``; the converted Python values."""
    table = pa.table({"v": pa.array(values, arrow_type)})
    out = conform(table, schema(NestedField(1, "v", ice_type)), context=ctx(len(values)))
    return list(out.column("v").to_pylist())


def test_output_is_exactly_the_tables_arrow_schema() -> None:
    s = schema(
        NestedField(1, "id", LongType(), required=True),
        NestedField(2, "name", StringType()),
        NestedField(3, "tags", ListType(4, StringType(), element_required=True)),
    )
    table = pa.table({"name": ["a", None], "id": pa.array([1, 2], pa.int32()), "extra": [1, 2]})
    out = conform(table, s, context=ctx(2))
    assert out.schema.equals(schema_to_pyarrow(s), check_metadata=True)
    assert out.to_pylist() == [
        {"id": 1, "name": "a", "tags": None},
        {"id": 2, "name": None, "tags": None},
    ]


def test_matching_columns_are_not_copied() -> None:
    s = schema(NestedField(1, "id", LongType()), NestedField(2, "s", StringType()))
    arr = pa.array([1, 2, 3], pa.int64())
    out = conform(pa.table({"id": arr, "s": pa.array(["a", "b", "c"], pa.large_string())}), s)
    assert out.column("id").chunk(0).buffers()[1].address == arr.buffers()[1].address


def test_name_mapping_aliases_and_case_insensitive() -> None:
    s = schema(
        NestedField(1, "user_id", LongType(), required=True),
        NestedField(2, "info", StructType(NestedField(3, "city", StringType()))),
    )
    mapping = parse_mapping_from_json(
        json.dumps(
            [
                {"field-id": 1, "names": ["user_id", "userId", "uid"]},
                {"field-id": 2, "names": ["info"], "fields": [{"field-id": 3, "names": ["town"]}]},
            ]
        )
    )
    table = pa.table(
        {
            "user_id": pa.array([1, None, None], pa.int64()),
            "uid": pa.array([9, 2, None], pa.int64()),
            "USERID": pa.array([8, 8, 3], pa.int64()),
            "info": pa.array([{"town": "Oslo"}, {"town": None}, None]),
        }
    )
    with pytest.raises(RecordConversionError) as err:
        conform(table, s, name_mapping=mapping, context=ctx(3))
    assert err.value.field == "user_id"
    assert err.value.offset == 102  # only the case-insensitive column has a value there

    out = conform(table, s, name_mapping=mapping, case_insensitive=True, context=ctx(3))
    # own name first, then aliases in mapping order, then other letter cases
    assert out.column("user_id").to_pylist() == [1, 2, 3]
    assert out.column("info").to_pylist() == [{"city": "Oslo"}, {"city": None}, None]


def test_int_widening_and_narrowing() -> None:
    assert one(LongType(), [1, None, -5], pa.int8()) == [1, None, -5]
    assert one(IntegerType(), [1, 2], pa.int64()) == [1, 2]
    assert one(DoubleType(), [1, 2], pa.int32()) == [1.0, 2.0]
    with pytest.raises(RecordConversionError) as err:
        one(IntegerType(), [1, 2, 2**40, 3], pa.int64())
    assert (err.value.offset, err.value.field, err.value.topic, err.value.partition) == (
        102,
        "v",
        "events",
        3,
    )
    with pytest.raises(RecordConversionError, match="truncated"):
        one(LongType(), [1.0, 1.5])


def test_text_to_temporal_and_decimal() -> None:
    assert one(TimestamptzType(), ["2024-01-02T03:04:05Z", "2024-01-02T05:04:05.5+02:00"]) == [
        dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        dt.datetime(2024, 1, 2, 3, 4, 5, 500000, tzinfo=UTC),
    ]
    # no zone: UTC; a zoned value into a zone-less column: its UTC wall clock
    assert one(TimestamptzType(), ["2024-01-02 03:04:05"])[0].hour == 3
    assert one(TimestampType(), ["2024-01-02T03:04:05+01:00", "2024-01-02T03:04:05"]) == [
        dt.datetime(2024, 1, 2, 2, 4, 5),
        dt.datetime(2024, 1, 2, 3, 4, 5),
    ]
    assert one(TimestamptzType(), [1_700_000_000_123]) == [
        dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    ]
    assert one(DateType(), ["2024-02-29", None]) == [dt.date(2024, 2, 29), None]
    assert one(TimeType(), ["12:01:02.5"]) == [dt.time(12, 1, 2, 500000)]
    assert one(DecimalType(10, 2), ["12.3", "-1"]) == [Decimal("12.30"), Decimal("-1.00")]
    assert one(DecimalType(10, 2), [0.1, 12.25]) == [Decimal("0.10"), Decimal("12.25")]
    assert one(DecimalType(10, 2), [7], pa.int64()) == [Decimal("7.00")]
    assert one(BooleanType(), ["true", "false"]) == [True, False]
    assert one(StringType(), [5, 6], pa.int64()) == ["5", "6"]
    with pytest.raises(RecordConversionError) as err:
        one(DecimalType(10, 2), [0.5, 12.345])  # would lose a digit: refused, not rounded
    assert err.value.offset == 101
    with pytest.raises(RecordConversionError) as err:
        one(DateType(), ["2024-01-01", "2024-13-01"])
    assert err.value.offset == 101


def test_uuid_from_text_and_bytes() -> None:
    u = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0")
    assert one(UUIDType(), [str(u), u.hex.upper(), None]) == [u, u, None]
    assert one(UUIDType(), [u.bytes], pa.binary()) == [u]
    with pytest.raises(RecordConversionError) as err:
        one(UUIDType(), [str(u), "not-a-uuid-at-all-xxxxxxxxxxxxxxxx"])
    assert err.value.offset == 101


@given(st.lists(st.uuids(), min_size=1, max_size=50), st.integers(0, 5))
def test_uuid_text_round_trip(uuids: list[uuid.UUID], skip: int) -> None:
    table = pa.table({"v": pa.array([str(u) for u in uuids])}).slice(min(skip, len(uuids) - 1))
    out = conform(table, schema(NestedField(1, "v", UUIDType())))
    assert out.column("v").to_pylist() == uuids[min(skip, len(uuids) - 1) :]


@settings(max_examples=60)
@given(st.lists(st.one_of(st.none(), st.integers(-(2**40), 2**40)), min_size=1, max_size=60))
def test_narrowing_fails_exactly_at_the_first_value_out_of_range(values: list[int | None]) -> None:
    bad = [i for i, v in enumerate(values) if v is not None and not -(2**31) <= v < 2**31]
    table = pa.table({"v": pa.array(values, pa.int64())})
    if not bad:
        out = conform(table, schema(NestedField(1, "v", IntegerType())), context=ctx(len(values)))
        assert out.column("v").to_pylist() == values
        return
    with pytest.raises(RecordConversionError) as err:
        conform(table, schema(NestedField(1, "v", IntegerType())), context=ctx(len(values)))
    assert err.value.offset == 100 + bad[0]


def test_required_fields() -> None:
    s = schema(
        NestedField(1, "id", LongType(), required=True),
        NestedField(
            2,
            "addr",
            StructType(NestedField(3, "zip", StringType(), required=True)),
            required=False,
        ),
    )
    with pytest.raises(RecordConversionError, match="missing") as err:
        conform(pa.table({"x": [1, 2]}), s, context=ctx(2))
    assert (err.value.field, err.value.offset) == ("id", 100)
    with pytest.raises(RecordConversionError, match="null") as err:
        conform(pa.table({"id": [1, None, None]}), s, context=ctx(3))
    assert (err.value.field, err.value.offset) == ("id", 101)
    # a required field inside a null optional struct is fine; inside a present one it is not
    ok = pa.table({"id": [1, 2], "addr": pa.array([None, {"zip": "0150"}])})
    assert conform(ok, s).column("addr").to_pylist() == [None, {"zip": "0150"}]
    bad = pa.table({"id": [1, 2, 3], "addr": pa.array([None, {"zip": "1"}, {"zip": None}])})
    with pytest.raises(RecordConversionError) as err:
        conform(bad, s, context=ctx(3))
    assert (err.value.field, err.value.offset) == ("addr.zip", 102)


def test_nested_lists_maps_and_structs() -> None:
    s = schema(
        NestedField(1, "scores", ListType(2, LongType(), element_required=False)),
        NestedField(3, "attrs", MapType(4, StringType(), 5, LongType(), value_required=False)),
        NestedField(
            6,
            "items",
            ListType(
                7,
                StructType(NestedField(8, "sku", StringType()), NestedField(9, "n", IntegerType())),
            ),
        ),
        NestedField(10, "labels", MapType(11, StringType(), 12, StringType())),
    )
    table = pa.table(
        {
            "scores": pa.array([[1, 2], None, [3]], pa.list_(pa.int32())),
            # a JSON object decoded as a struct becomes map entries of the keys present
            "attrs": pa.array([{"a": 1, "b": None}, {"a": None, "b": 2}, None]),
            "items": pa.array([[{"n": 1, "sku": "x", "extra": True}], [], None]),
            "labels": pa.array([[("k", "v")], None, []], pa.map_(pa.string(), pa.string())),
        }
    ).slice(0)
    out = conform(table, s, context=ctx(3))
    assert out.schema.equals(schema_to_pyarrow(s))
    assert out.to_pylist() == [
        {
            "scores": [1, 2],
            "attrs": [("a", 1)],
            "items": [{"sku": "x", "n": 1}],
            "labels": [("k", "v")],
        },
        {"scores": None, "attrs": [("b", 2)], "items": [], "labels": None},
        {"scores": [3], "attrs": None, "items": None, "labels": []},
    ]
    # an element that does not fit names the record it belongs to
    bad = pa.table({"scores": pa.array([["1"], ["2", "3"], ["4", "x"]], pa.list_(pa.string()))})
    with pytest.raises(RecordConversionError) as err:
        conform(bad, s, context=ctx(3))
    assert (err.value.offset, err.value.field) == (102, "scores.element")
    # map values are required here: a null one names its record
    labels = pa.array(
        [[("a", "1")], [], [("b", "2"), ("c", None)]], pa.map_(pa.string(), pa.string())
    )
    with pytest.raises(RecordConversionError) as err:
        conform(pa.table({"labels": labels}), s, context=ctx(3))
    assert (err.value.offset, err.value.field) == (102, "labels.value")


def test_aliases_coalesce_for_every_type() -> None:
    u1, u2 = uuid.uuid4(), uuid.uuid4()
    s = schema(NestedField(1, "u", UUIDType()))
    mapping = parse_mapping_from_json(json.dumps([{"field-id": 1, "names": ["u", "uid"]}]))
    table = pa.table({"u": [str(u1), None, None], "uid": [str(u2), str(u2), None]})
    out = conform(table, s, name_mapping=mapping)
    assert out.column("u").to_pylist() == [u1, u2, None]


def test_objects_as_maps_with_mixed_value_kinds() -> None:
    s = schema(NestedField(1, "m", MapType(2, StringType(), 3, StringType())))
    table = pa.table(
        {"m": pa.array([{"a": 1, "b": "x", "c": None}, {"a": 2, "b": None, "c": None}])}
    )
    assert conform(table, s).column("m").to_pylist() == [[("a", "1"), ("b", "x")], [("a", "2")]]
    nested = pa.table({"m": pa.array([{"a": 1, "b": {"deep": 1}}])})
    with pytest.raises(RecordConversionError, match="map values of different kinds") as err:
        conform(nested, s, context=ctx(1))
    assert err.value.field == "m"


def test_empty_input() -> None:
    s = schema(NestedField(1, "id", LongType(), required=True))
    out = conform(pa.table({"id": pa.array([], pa.int32())}), s)
    assert out.num_rows == 0
    assert out.schema.equals(schema_to_pyarrow(s))


def test_shape_mismatch_is_a_record_error() -> None:
    s = schema(NestedField(1, "pos", StructType(NestedField(2, "x", DoubleType()))))
    with pytest.raises(RecordConversionError, match="record/object") as err:
        conform(pa.table({"pos": [None, "1,2"]}), s, context=ctx(2))
    assert (err.value.offset, err.value.field) == (101, "pos")


def test_chunked_input_and_error_row_across_chunks() -> None:
    s = schema(NestedField(1, "v", IntegerType()))
    table = pa.Table.from_batches(
        [
            pa.record_batch({"v": pa.array([1, 2], pa.int64())}),
            pa.record_batch({"v": pa.array([3, 2**33], pa.int64())}),
        ]
    )
    with pytest.raises(RecordConversionError) as err:
        conform(table, s, context=ctx(4))
    assert err.value.offset == 103
    assert conform(table.slice(0, 3), s).column("v").to_pylist() == [1, 2, 3]


def test_without_context_the_row_is_named() -> None:
    with pytest.raises(RecordConversionError, match="row 1"):
        conform(pa.table({"v": [1, None]}), schema(NestedField(1, "v", LongType(), required=True)))


def test_conformed_rows_append_to_a_real_table(tmp_path: Path) -> None:
    """The output is what pyiceberg's writer accepts for the table, name mapping included."""
    catalog = SqlCatalog(
        "c", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=f"file://{tmp_path / 'wh'}"
    )
    catalog.create_namespace("db")
    table = catalog.create_table(
        "db.t",
        schema(
            NestedField(1, "id", LongType(), required=True),
            NestedField(2, "at", TimestamptzType()),
            NestedField(3, "tags", MapType(4, StringType(), 5, StringType())),
        ),
        properties={
            "schema.name-mapping.default": json.dumps(
                [
                    {"field-id": 1, "names": ["id", "ID"]},
                    {"field-id": 2, "names": ["at", "when"]},
                    {"field-id": 3, "names": ["tags"], "fields": []},
                ]
            )
        },
    )
    rows = pa.table(
        {"ID": [1, 2], "when": ["2024-01-01T00:00:00Z", None], "tags": [{"a": "b"}, None]}
    )
    out = conform(rows, table.schema(), name_mapping=table_name_mapping(table))
    table.append(out)
    back = catalog.load_table("db.t").scan().to_arrow().sort_by("id").to_pylist()
    assert back == [
        {"id": 1, "at": dt.datetime(2024, 1, 1, tzinfo=UTC), "tags": [("a", "b")]},
        {"id": 2, "at": None, "tags": None},
    ]
