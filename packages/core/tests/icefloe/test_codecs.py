"""The built-in record codecs (json, avro) and the converter that drives them."""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import parse_mapping_from_json
from pyiceberg.types import (
    DecimalType,
    DoubleType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestamptzType,
    UUIDType,
)

from icefloe.config import SourceConfig, TableConfig
from icefloe.errors import ConfigError, RecordConversionError
from icefloe.hookspecs import DecodeContext
from icefloe.plugins.manager import new_plugins
from icefloe.records.codecs.avro import AvroCodec
from icefloe.records.codecs.json import JsonCodec
from icefloe.records.conform import conform
from icefloe.records.converter import RecordConverter, TargetTable, decode_hint

UTC = dt.UTC

EVENTS = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "kind", StringType()),
    NestedField(3, "at", TimestamptzType()),
    NestedField(4, "amount", DecimalType(10, 2)),
    NestedField(5, "tags", ListType(6, StringType())),
    NestedField(7, "attrs", MapType(8, StringType(), 9, LongType(), value_required=False)),
    NestedField(10, "geo", StructType(NestedField(11, "lat", DoubleType()))),
)


def ctx(n: int, first: int = 0) -> DecodeContext:
    return DecodeContext(
        topics=pa.array(["in"] * n),
        partitions=pa.array([1] * n, pa.int32()),
        offsets=pa.array(range(first, first + n), pa.int64()),
    )


def raw(values: Sequence[bytes | None]) -> pa.Array:
    return pa.array(values, pa.binary())


def kafka_batch(values: list[bytes | None], first: int = 0) -> pa.RecordBatch:
    n = len(values)
    return pa.record_batch(
        {
            "key": pa.nulls(n, pa.binary()),
            "value": raw(values),
            "topic": pa.array(["in"] * n),
            "partition": pa.array([1] * n, pa.int32()),
            "offset": pa.array(range(first, first + n), pa.int64()),
        }
    )


def hint(schema: Schema = EVENTS) -> pa.Schema:
    return decode_hint([TargetTable(TableConfig(name="db.events"), schema)])


def test_builtin_codecs_are_registered_through_the_entry_point() -> None:
    codecs = new_plugins(autoload=True).codecs()
    assert {"json", "avro"} <= set(codecs)
    assert isinstance(codecs["json"].factory({}), JsonCodec)


# --------------------------------------------------------------------------- json


def test_json_batch_to_table_schema() -> None:
    records = [
        {
            "id": 1,
            "kind": "a",
            "at": "2024-05-01T10:00:00Z",
            "amount": "19.99",
            "tags": ["x"],
            "attrs": {"n": 1, "m": 2},
            "geo": {"lat": 1.5},
            "ignored": {"deep": [1]},
        },
        {"id": 2, "at": "2024-05-01T12:00:00+02:00", "amount": 5, "attrs": {}},
        None,  # a null value decodes to a row of nulls
    ]
    values = raw([None if r is None else json.dumps(r).encode() for r in records])
    decoded = JsonCodec({}).decode(values, hint(), ctx(3))
    assert decoded.num_rows == 3
    out = conform(decoded.slice(0, 2), EVENTS, context=ctx(2))
    assert out.to_pylist() == [
        {
            "id": 1,
            "kind": "a",
            "at": dt.datetime(2024, 5, 1, 10, tzinfo=UTC),
            "amount": Decimal("19.99"),
            "tags": ["x"],
            "attrs": [("n", 1), ("m", 2)],
            "geo": {"lat": 1.5},
        },
        {
            "id": 2,
            "kind": None,
            "at": dt.datetime(2024, 5, 1, 10, tzinfo=UTC),
            "amount": Decimal("5.00"),
            "tags": None,
            "attrs": [],
            "geo": None,
        },
    ]


def test_json_other_json_types_are_cast_by_the_converter() -> None:
    """Text where the table has numbers, epoch milliseconds where it has timestamps."""
    values = raw([b'{"id": "7", "at": 1714557600000, "kind": 12}'] * 2)
    out = conform(JsonCodec({}).decode(values, hint(), ctx(2)), EVENTS, context=ctx(2))
    assert (
        out.select(["id", "at", "kind"]).to_pylist()
        == [{"id": 7, "at": dt.datetime(2024, 5, 1, 10, tzinfo=UTC), "kind": "12"}] * 2
    )
    mixed = raw([b'{"id": 1, "at": "2024-05-01T10:00:00Z"}', b'{"id": 2, "at": 1714557600000}'])
    with pytest.raises(RecordConversionError) as err:
        JsonCodec({}).decode(mixed, hint(), ctx(2, first=30))
    assert (err.value.offset, err.value.field) == (31, "at")


def test_json_values_spanning_lines_and_unknown_fields() -> None:
    flat = Schema(NestedField(1, "id", LongType()), NestedField(2, "kind", StringType()))
    pretty = json.dumps({"id": 7, "kind": "k", "new": 1}, indent=2).encode()
    decoded = JsonCodec({}).decode(raw([pretty, b'{"id": 8}']), hint(flat), ctx(2))
    assert decoded.column_names == ["id", "kind"]  # fields the tables do not have: skipped
    assert decoded.column("id").to_pylist() == [7, 8]
    inferred = JsonCodec({"unknown_fields": "infer"}).decode(raw([pretty]), hint(flat), ctx(1))
    assert inferred.column("new").to_pylist() == [1]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (b'{"id": 1, "kind": ', None),  # truncated
        (b"", None),  # empty
        (b'{"id": 1}{"id": 2}', None),  # two records in one value
        (b"[1, 2]", None),  # not an object
        (b'{"id": 1, "amount": 1.234}', "amount"),  # decimal would lose a digit
        (b'{"id": 1, "geo": {"lat": "north"}}', "geo"),  # shape differs from the others
    ],
)
def test_json_bad_record_is_named(bad: bytes, field: str | None) -> None:
    good = [json.dumps({"id": i, "geo": {"lat": 1.0}}).encode() for i in range(6)]
    values = raw([*good[:4], bad, *good[4:]])
    context = ctx(len(values), first=500)
    with pytest.raises(RecordConversionError) as err:
        conform(JsonCodec({}).decode(values, hint(), context), EVENTS, context=context)
    assert (err.value.topic, err.value.partition, err.value.offset) == ("in", 1, 504)
    if field is not None:
        assert err.value.field is not None
        assert err.value.field.split(".")[0] == field


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_json_error_names_the_exact_offset(n: int, data: st.DataObject) -> None:
    bad_at = data.draw(st.integers(0, n - 1))
    values = [json.dumps({"id": i, "kind": f"k{i}"}).encode() for i in range(n)]
    values[bad_at] = data.draw(st.sampled_from([b"{", b"nope", b'{"id": 1,}', b"   "]))
    with pytest.raises(RecordConversionError) as err:
        JsonCodec({}).decode(raw(values), hint(), ctx(n, first=1000))
    assert err.value.offset == 1000 + bad_at


@pytest.mark.parametrize(
    "arrow_type", [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]
)
def test_json_accepts_any_binary_or_text_column(arrow_type: pa.DataType) -> None:
    """Spark may hand values over as large types; a sliced array must decode its slice."""
    texts = ['{"id": 1}', '{"id": 2}', None, '{"id": 4}']
    items = [t if t is None or "string" in str(arrow_type) else t.encode() for t in texts]
    values = pa.array(items, arrow_type).slice(1)
    assert JsonCodec({}).decode(values, hint(), ctx(3)).column("id").to_pylist() == [2, None, 4]


ROUND_TRIP = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "name", StringType()),
    NestedField(3, "tags", ListType(4, StringType())),
    NestedField(5, "geo", StructType(NestedField(6, "lat", DoubleType()))),
)
json_records = st.lists(
    st.fixed_dictionaries(
        {"id": st.integers(-(2**62), 2**62)},
        optional={
            "name": st.one_of(st.none(), st.text()),
            "tags": st.one_of(st.none(), st.lists(st.text(max_size=5), max_size=3)),
            "geo": st.one_of(
                st.none(), st.fixed_dictionaries({"lat": st.floats(allow_nan=False, width=32)})
            ),
        },
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(records=json_records, indent=st.sampled_from([None, 1]))
def test_json_round_trip(records: list[dict[str, Any]], indent: int | None) -> None:
    """Any text (escapes, unicode, line breaks), nesting and nulls survive the batch parse."""
    values = raw([json.dumps(r, indent=indent, ensure_ascii=False).encode() for r in records])
    context = ctx(len(records))
    out = conform(
        JsonCodec({}).decode(values, hint(ROUND_TRIP), context), ROUND_TRIP, context=context
    )
    expected = [
        {"id": r["id"], "name": r.get("name"), "tags": r.get("tags"), "geo": r.get("geo")}
        for r in records
    ]
    assert out.to_pylist() == expected


def test_json_line_breaks_inside_values_across_blocks() -> None:
    """More than one parser block (1 MiB) of values that contain line breaks."""
    records = [{"id": i, "name": "n" * 300, "tags": ["a", "b"]} for i in range(5000)]
    values = raw([json.dumps(r, indent=2).replace("\n", "\r\n").encode() for r in records])
    assert sum(len(v) for v in values.to_pylist()) > 1 << 20
    out = JsonCodec({}).decode(values, hint(ROUND_TRIP), ctx(len(records)))
    assert out.column("id").to_pylist() == list(range(5000))


@pytest.mark.parametrize("brk", ["\n", "\r", "\r\n"])
def test_json_line_breaks_found_after_the_one_line_parse(brk: str) -> None:
    """Values are first parsed as one-line (no scan for line breaks): a batch over several
    blocks whose values break lines with ``brk``, all of them or one in the middle, still
    decodes every record, in order."""
    records = [{"id": i, "name": "n" * 500} for i in range(5000)]
    every = [json.dumps(r, indent=2).replace("\n", brk).encode() for r in records]
    one = [json.dumps(r).encode() for r in records]
    one[2500] = every[2500]
    for values in (raw(every), raw(one)):
        assert sum(len(v) for v in values.to_pylist()) > 2 << 20  # blocks are 1 MiB
        out = JsonCodec({}).decode(values, hint(ROUND_TRIP), ctx(len(records)))
        assert out.column("id").to_pylist() == list(range(5000))
        assert out.column("name").to_pylist() == ["n" * 500] * 5000


def test_json_errors_in_values_with_line_breaks() -> None:
    """The parse that knows of the line breaks, not the one-line attempt, decides: a field
    whose JSON type differs is still inferred (and cast by the converter), and a bad record
    is still named."""
    flat = Schema(NestedField(1, "id", LongType()), NestedField(2, "kind", StringType()))
    pretty = [json.dumps({"id": i, "kind": 7}, indent=2).encode() for i in range(3000)]
    decoded = JsonCodec({}).decode(raw(pretty), hint(flat), ctx(len(pretty)))
    assert decoded.column("kind").to_pylist() == [7] * 3000
    pretty[1700] = b'{\n  "id": 1700,\n  "kind": \n}'
    with pytest.raises(RecordConversionError) as err:
        JsonCodec({}).decode(raw(pretty), hint(flat), ctx(len(pretty), first=100))
    assert err.value.offset == 1800


def test_json_option_errors() -> None:
    with pytest.raises(ConfigError, match="unknown_fields"):
        JsonCodec({"unknown_fields": "keep"})
    with pytest.raises(ConfigError, match="not an option of the json format"):
        JsonCodec({"schema": "x"})


# --------------------------------------------------------------------------- avro

AVRO_SCHEMA = {
    "type": "record",
    "name": "Event",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "kind", "type": ["null", {"type": "enum", "name": "K", "symbols": ["A", "B"]}]},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
        },
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {
            "name": "geo",
            "type": [
                "null",
                {"type": "record", "name": "Geo", "fields": [{"name": "lat", "type": "double"}]},
            ],
        },
        {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
    ],
}
REF = uuid.UUID("00000000-0000-0000-0000-00000000abcd")


def avro_bytes(record: dict[str, Any], schema: Any = AVRO_SCHEMA) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def event(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "kind": "A" if i % 2 else None,
        "at": dt.datetime(2024, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=i),
        "amount": Decimal("1.25") * i,
        "tags": [f"t{i}"],
        "attrs": {"n": i},
        "geo": {"lat": float(i)} if i % 3 else None,
        "ref": REF,
    }


def test_avro_inline_schema_and_file(tmp_path: Path) -> None:
    path = tmp_path / "event.avsc"
    path.write_text(json.dumps(AVRO_SCHEMA))
    values = raw([avro_bytes(event(1)), avro_bytes(event(2)), None])
    for codec in (AvroCodec({"schema_file": str(path)}), AvroCodec({"schema": AVRO_SCHEMA})):
        decoded = codec.decode(values, hint(), ctx(3))
        schema = Schema(*EVENTS.fields, NestedField(12, "ref", UUIDType()))
        out = conform(decoded.slice(0, 2), schema, context=ctx(2))
        first = out.to_pylist()[0]
        assert first == {
            "id": 1,
            "kind": "A",
            "at": dt.datetime(2024, 1, 1, 0, 0, 1, tzinfo=UTC),
            "amount": Decimal("1.25"),
            "tags": ["t1"],
            "attrs": [("n", 1)],
            "geo": {"lat": 1.0},
            "ref": REF,
        }
        assert decoded.column("id").to_pylist() == [1, 2, None]


def test_avro_confluent_wire_format() -> None:
    header = b"\x00" + (42).to_bytes(4, "big")
    codec = AvroCodec(
        {"schema": json.dumps(AVRO_SCHEMA), "wire_format": "confluent", "schema_id": 42}
    )
    decoded = codec.decode(raw([header + avro_bytes(event(3))]), hint(), ctx(1))
    assert decoded.column("id").to_pylist() == [3]
    for bad in (avro_bytes(event(3)), b"\x00" + (7).to_bytes(4, "big") + avro_bytes(event(3))):
        with pytest.raises(RecordConversionError) as err:
            codec.decode(raw([header + avro_bytes(event(1)), bad]), hint(), ctx(2, first=9))
        assert err.value.offset == 10


def test_avro_corrupt_record_is_named() -> None:
    good = avro_bytes(event(1))
    codec = AvroCodec({"schema": AVRO_SCHEMA})
    for bad in (good[:5], good + b"\x01\x02"):
        with pytest.raises(RecordConversionError) as err:
            codec.decode(raw([good, good, bad]), hint(), ctx(3, first=70))
        assert err.value.offset == 72


def test_avro_option_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="schema_file"):
        AvroCodec({})
    with pytest.raises(ConfigError, match="schema_file"):
        AvroCodec({"schema_file": str(tmp_path / "missing.avsc")})
    with pytest.raises(ConfigError, match="not a valid Avro schema"):
        AvroCodec({"schema": '{"type": "record"}'})
    with pytest.raises(ConfigError, match="wire_format"):
        AvroCodec({"schema": AVRO_SCHEMA, "wire_format": "magic"})
    with pytest.raises(ConfigError, match="several non-null branches"):
        AvroCodec(
            {
                "schema": {
                    "type": "record",
                    "name": "R",
                    "fields": [{"name": "x", "type": ["int", "string"]}],
                }
            }
        )


# --------------------------------------------------------------------------- converter


def targets() -> list[TargetTable]:
    clicks = Schema(
        NestedField(1, "id", LongType(), required=True), NestedField(2, "page", StringType())
    )
    everything = Schema(
        NestedField(1, "id", LongType(), required=True), NestedField(2, "kind", StringType())
    )
    mapping = parse_mapping_from_json(json.dumps([{"field-id": 2, "names": ["page", "url"]}]))
    return [
        TargetTable(
            TableConfig(name="db.clicks", route_field="kind", route_values=["click"]),
            clicks,
            mapping,
        ),
        TargetTable(TableConfig(name="db.all"), everything),
    ]


def test_converter_decodes_routes_and_conforms() -> None:
    source = SourceConfig(topics=["in"], format="json", format_options={})
    conv = RecordConverter.from_config(source, targets(), plugins=new_plugins(autoload=True))
    values = [
        b'{"id": 1, "kind": "click", "url": "/a"}',
        None,  # tombstone: skipped
        b'{"id": 2, "kind": "view"}',
        b'{"id": 3, "kind": "click", "page": "/b"}',
    ]
    out = conv.convert(kafka_batch(values))
    assert out["db.clicks"].to_pylist() == [{"id": 1, "page": "/a"}, {"id": 3, "page": "/b"}]
    assert out["db.all"].column("id").to_pylist() == [1, 2, 3]


def test_converter_errors_name_the_source_record() -> None:
    source = SourceConfig(topics=["in"], format="json", format_options={"tombstones": "error"})
    conv = RecordConverter.from_config(source, targets(), plugins=new_plugins(autoload=True))
    with pytest.raises(RecordConversionError, match="tombstone") as err:
        conv.convert(kafka_batch([b'{"id": 1}', None], first=40))
    assert err.value.offset == 41

    lenient = RecordConverter.from_config(
        SourceConfig(topics=["in"]), targets(), plugins=new_plugins(autoload=True)
    )
    # after tombstones were dropped and rows routed, the offending row is still named right
    values = [None, b'{"id": 1, "kind": "view"}', None, b'{"kind": "click", "url": "/x"}']
    with pytest.raises(RecordConversionError) as err:
        lenient.convert(kafka_batch(values, first=40))
    assert (err.value.offset, err.value.field) == (43, "id")


def test_converter_options_are_validated() -> None:
    plugins = new_plugins(autoload=True)
    with pytest.raises(ConfigError, match="tombstones"):
        RecordConverter.from_config(
            SourceConfig(topics=["t"], format_options={"tombstones": "keep"}), targets(), plugins
        )
    with pytest.raises(ConfigError, match="case_insensitive"):
        RecordConverter.from_config(
            SourceConfig(topics=["t"], format_options={"case_insensitive": "yes"}),
            targets(),
            plugins,
        )


def test_case_insensitive_json_end_to_end() -> None:
    source = SourceConfig(topics=["in"], format_options={"case_insensitive": True})
    conv = RecordConverter.from_config(source, targets(), plugins=new_plugins(autoload=True))
    out = conv.convert(kafka_batch([b'{"ID": 5, "Kind": "click", "URL": "/c"}']))
    assert out["db.clicks"].to_pylist() == [{"id": 5, "page": "/c"}]
