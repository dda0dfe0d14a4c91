"""Bad records, one at a time: the error names the right record and says what kind of failure
it is (decode, route, conform); the tolerant conversion sets aside exactly the bad records and
converts every good one of the same batch; the ``[errors]`` config section."""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType, TimestamptzType

from icefloe.config import TableConfig, config_from_dict
from icefloe.errors import (
    ConfigError,
    RecordConformError,
    RecordConversionError,
    RecordDecodeError,
    RecordRouteError,
)
from icefloe.hookspecs import DecodeContext, RecordCodec
from icefloe.records.codecs.avro import AvroCodec
from icefloe.records.codecs.json import JsonCodec
from icefloe.records.converter import RecordConverter, TargetTable

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "ts", TimestamptzType(), required=False),
    NestedField(3, "kind", StringType(), required=False),
)
TS = 1_700_000_000_000  # epoch ms, as many producers write timestamps


def batch(values: list[bytes | None], first: int = 1001, topic: str = "orders") -> pa.Table:
    n = len(values)
    return pa.table(
        {
            "value": pa.array(values, pa.binary()),
            "topic": pa.array([topic] * n),
            "partition": pa.array([2] * n, pa.int32()),
            "offset": pa.array(range(first, first + n), pa.int64()),
        }
    )


def records(*recs: dict[str, Any]) -> list[bytes | None]:
    return [json.dumps(r).encode() for r in recs]


def converter(
    codec: RecordCodec | None = None, tables: list[TableConfig] | None = None
) -> RecordConverter:
    configs = tables or [TableConfig(name="db.events")]
    return RecordConverter(codec or JsonCodec({}), [TargetTable(c, SCHEMA) for c in configs])


ROUTED = [
    TableConfig(name="db.a", route_field="kind", route_values=["a"]),
    TableConfig(name="db.b", route_field="kind", route_values=["b"]),
]


# --------------------------------------------------------------------------- naming the record


def test_a_wrong_typed_record_first_in_the_batch_is_blamed_not_the_next_one() -> None:
    """Seen: ``"id": "abc"`` at offset 1001 followed by numbers was reported as
    ``@1002`` (the first record whose JSON type differs from the first one's)."""
    values = records(
        {"id": "abc", "ts": TS, "kind": "a"}, *({"id": i, "ts": TS, "kind": "a"} for i in range(5))
    )
    with pytest.raises(RecordConversionError) as err:
        converter().convert(batch(values))
    assert (err.value.topic, err.value.partition, err.value.offset) == ("orders", 2, 1001)
    assert err.value.field == "id"


def test_a_wrong_typed_record_in_the_middle_is_blamed() -> None:
    values = records(*({"id": i, "ts": TS} for i in range(3)), {"id": "abc", "ts": TS})
    with pytest.raises(RecordConversionError) as err:
        converter().convert(batch(values + records({"id": 9, "ts": TS})))
    assert (err.value.offset, err.value.field) == (1004, "id")


def test_malformed_json_is_a_decode_error_naming_the_record() -> None:
    values = [*records({"id": 1}), b'{"id": ', *records({"id": 3})]
    with pytest.raises(RecordDecodeError) as err:
        converter().convert(batch(values))
    assert err.value.offset == 1002
    assert err.value.kind == "decode"


def test_malformed_avro_is_a_decode_error_naming_the_record() -> None:
    schema = {"type": "record", "name": "E", "fields": [{"name": "id", "type": "long"}]}
    codec = AvroCodec({"schema": json.dumps(schema)})

    def avro(i: int) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), {"id": i})
        return buf.getvalue()

    values: list[bytes | None] = [avro(1), b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", avro(3)]
    with pytest.raises(RecordDecodeError) as err:
        converter(codec).convert(batch(values))
    assert err.value.offset == 1002
    out = converter(codec).convert_tolerant(batch(values))
    assert out.tables["db.events"]["id"].to_pylist() == [1, 3]
    assert [(r.row, r.error.kind) for r in out.rejected] == [(1, "decode")]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"id": None, "kind": "a"}, "required field is null"),
        ({"kind": "a"}, "required field is null"),  # JSON: missing reads as null
        ({"id": 1, "ts": "not a time", "kind": "a"}, "Failed to parse"),
    ],
)
def test_conform_errors_name_record_field_and_table(bad: dict[str, Any], problem: str) -> None:
    values = records({"id": 1, "kind": "a"}, bad, {"id": 3, "kind": "a"})
    with pytest.raises(RecordConformError) as err:
        converter().convert(batch(values))
    assert (err.value.offset, err.value.table, err.value.kind) == (1002, "db.events", "conform")
    assert problem in err.value.problem


@pytest.mark.parametrize(
    ("bad", "shown"),
    [({"id": 2, "kind": "zzz"}, "'kind' = 'zzz'"), ({"id": 2}, "field 'kind' is missing")],
)
def test_a_record_no_table_takes_is_a_route_error(bad: dict[str, Any], shown: str) -> None:
    values = records({"id": 1, "kind": "a"}, bad, {"id": 3, "kind": "b"})
    with pytest.raises(RecordRouteError) as err:
        converter(tables=ROUTED).convert(batch(values))
    assert err.value.offset == 1002
    assert err.value.kind == "route"
    assert shown in str(err.value)


def test_a_table_without_route_takes_what_others_do_not() -> None:
    tables = [ROUTED[0], TableConfig(name="db.all")]
    out = converter(tables=tables).convert(batch(records({"id": 1, "kind": "zzz"})))
    assert out["db.all"]["id"].to_pylist() == [1]


def test_record_errors_survive_pickling_with_kind_table_and_fix() -> None:
    """Spark ships a task's exception to the driver by pickling it."""
    err = RecordConformError("t", 1, 5, "id", "bad", table="db.a").with_(fix="do this")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RecordConformError
    assert (back.table, back.fix, str(back)) == ("db.a", "do this", str(err))
    assert "Fix: do this" in str(back)


# --------------------------------------------------------------------------- per record


def test_tolerant_conversion_sets_aside_exactly_the_bad_records() -> None:
    good = [{"id": i, "ts": TS, "kind": "ab"[i % 2]} for i in range(40)]
    bad_at = {
        3: b'{"id": 3, "kind": ',  # malformed: decode
        11: json.dumps({"id": "abc", "kind": "a"}).encode(),  # wrong type: conform
        12: json.dumps({"id": None, "kind": "b"}).encode(),  # null in required: conform
        20: json.dumps({"ts": TS, "kind": "a"}).encode(),  # missing required: conform
        27: json.dumps({"id": 27, "kind": "c"}).encode(),  # no table takes it: route
        39: json.dumps({"id": 39}).encode(),  # no route field: route
    }
    values: list[bytes | None] = [bad_at.get(i, json.dumps(r).encode()) for i, r in enumerate(good)]
    out = converter(tables=ROUTED).convert_tolerant(batch(values))
    kinds = {r.row: r.error.kind for r in out.rejected}
    assert kinds == {
        3: "decode",
        11: "conform",
        12: "conform",
        20: "conform",
        27: "route",
        39: "route",
    }
    assert {r.row: r.error.offset for r in out.rejected} == {i: 1001 + i for i in bad_at}
    assert {r.error.table for r in out.rejected if r.error.kind == "conform"} <= {"db.a", "db.b"}
    ids = out.tables["db.a"]["id"].to_pylist() + out.tables["db.b"]["id"].to_pylist()
    assert sorted(ids) == [i for i in range(40) if i not in bad_at]
    assert out.tables["db.a"]["id"].to_pylist() == [i for i in range(0, 40, 2) if i not in bad_at]


def test_tolerant_conversion_of_a_batch_of_only_bad_records() -> None:
    values: list[bytes | None] = [b"nope", b"{", b"[]x"]
    out = converter().convert_tolerant(batch(values))
    assert [r.row for r in out.rejected] == [0, 1, 2]
    assert out.tables["db.events"].num_rows == 0
    assert out.tables["db.events"].schema.names == ["id", "ts", "kind"]


class CountingCodec:
    """Counts decode calls of the wrapped codec."""

    def __init__(self, inner: RecordCodec) -> None:
        self.inner = inner
        self.calls = 0

    def decode(self, values: pa.Array, schema: pa.Schema, context: DecodeContext) -> pa.Table:
        self.calls += 1
        return self.inner.decode(values, schema, context)


def test_a_clean_batch_is_decoded_once_in_tolerant_mode() -> None:
    codec = CountingCodec(JsonCodec({}))
    out = converter(codec).convert_tolerant(batch(records(*({"id": i} for i in range(1000)))))
    assert codec.calls == 1
    assert not out.rejected
    assert out.tables["db.events"].num_rows == 1000


def test_one_bad_record_costs_a_logarithmic_number_of_conversions() -> None:
    codec = CountingCodec(JsonCodec({}))
    values = records(*({"id": i} for i in range(1024)))
    values[700] = b"{"
    out = converter(codec).convert_tolerant(batch(values))
    assert [r.row for r in out.rejected] == [700]
    assert out.tables["db.events"].num_rows == 1023
    assert codec.calls <= 1 + 2 * 11  # whole batch, then two halves per level


# --------------------------------------------------------------------------- config


BASE: dict[str, Any] = {"name": "p", "source": {"topics": ["t"]}, "tables": [{"name": "db.a"}]}


def test_errors_policy_defaults_to_fail() -> None:
    errors = config_from_dict(BASE).errors
    assert (errors.policy, errors.dead_letter_table) == ("fail", None)


def test_dead_letter_needs_its_table_named_by_key() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "errors": {"policy": "dead_letter"}})
    assert err.value.key == "errors.dead_letter_table"
    assert 'dead_letter_table = "namespace.table"' in err.value.fix
    ok = config_from_dict({**BASE, "errors": {"policy": "dead_letter", "dead_letter_table": "x.y"}})
    assert ok.errors.dead_letter_table == "x.y"


@pytest.mark.parametrize(
    ("errors", "key"),
    [
        ({"policy": "ignore"}, "errors.policy"),
        ({"policy": "skip", "dead_letter_table": "nodot"}, "errors.dead_letter_table"),
        ({"policy": "dead_letter", "dead_letter_table": "db.a"}, "errors"),
        ({"policy": "skip", "tolerance": "all"}, "errors.tolerance"),
    ],
)
def test_bad_errors_section_names_the_key(errors: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "errors": errors})
    assert err.value.key == key
