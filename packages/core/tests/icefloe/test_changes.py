"""Upsert and CDC conversion: op extraction, the Debezium envelope, the last change per key,
and bad change records meeting the ``[errors]`` policy like any bad record."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.config import TableConfig, config_from_dict
from icefloe.errors import ConfigError, RecordConformError
from icefloe.records.changes import (
    DELETE_FLAG,
    delete_mask,
    key_arrow_schema,
    last_per_key,
    row_images,
    schema_rows,
)
from icefloe.records.codecs.json import JsonCodec
from icefloe.records.converter import RecordConverter, TargetTable

SCHEMA = Schema(
    NestedField(1, "tenant", StringType(), required=True),
    NestedField(2, "id", LongType(), required=True),
    NestedField(3, "name", StringType(), required=True),
    NestedField(4, "note", StringType(), required=False),
    identifier_field_ids=[1, 2],
)
CDC = TableConfig(name="db.users", mode="cdc", id_columns=["id", "tenant"])
FLAT = CDC.model_copy(update={"cdc_envelope": "none", "cdc_op_field": "kind"})
UPSERT = TableConfig(name="db.users", mode="upsert", id_columns=["tenant", "id"])


def batch(recs: list[dict[str, Any]], first: int = 500) -> pa.Table:
    n = len(recs)
    return pa.table(
        {
            "value": pa.array([json.dumps(r).encode() for r in recs], pa.binary()),
            "topic": pa.array(["users"] * n),
            "partition": pa.array([0] * n, pa.int32()),
            "offset": pa.array(range(first, first + n), pa.int64()),
        }
    )


def converter(config: TableConfig) -> RecordConverter:
    return RecordConverter(JsonCodec({}), [TargetTable(config, SCHEMA)])


def row(tenant: str, id_: int, name: str, note: str | None = None) -> dict[str, Any]:
    return {"tenant": tenant, "id": id_, "name": name, "note": note}


def ins(r: dict[str, Any], op: str = "c") -> dict[str, Any]:
    return {"op": op, "before": None, "after": r, "source": {"lsn": 1}}


def upd(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {"op": "u", "before": old, "after": new}


def dele(old: dict[str, Any]) -> dict[str, Any]:
    return {"op": "d", "before": old, "after": None}


# --------------------------------------------------------------------------- pure pieces


def test_ops_map_to_deletes_with_debezium_defaults() -> None:
    rows = pa.table({"op": ["c", "r", "u", "d", "u", "d"]})
    assert delete_mask(rows, CDC).tolist() == [False, False, False, True, False, True]
    assert delete_mask(rows, UPSERT).tolist() == [False] * 6  # upsert reads no op


def test_an_unknown_or_missing_op_is_a_conform_error_naming_the_field_and_fix() -> None:
    with pytest.raises(RecordConformError, match=r"op 'x' is none of .*add it") as err:
        delete_mask(pa.table({"op": ["c", "x", "y"]}), CDC)
    assert err.value.field == "op"
    with pytest.raises(RecordConformError, match="op None"):
        delete_mask(pa.table({"op": pa.array(["c", None], pa.string())}), CDC)
    with pytest.raises(RecordConformError, match="no op field 'op'"):
        delete_mask(pa.table({"kind": ["c"]}), CDC)


def test_a_task_without_records_for_a_cdc_table_has_no_deletes() -> None:
    """A write task whose records all went elsewhere hands the table an empty slice whose
    op column has no chunks at all (seen: IndexError from reading the 'first bad op')."""
    empty = pa.table({"op": pa.chunked_array([], pa.string())})
    assert delete_mask(empty, CDC).tolist() == []
    assert delete_mask(pa.table({"op": pa.array([], pa.string())}), CDC).tolist() == []


def test_configured_op_values_replace_the_debezium_ones() -> None:
    custom = FLAT.model_copy(
        update={"cdc_upsert_ops": ["INSERT", "UPDATE"], "cdc_delete_ops": ["DELETE"]}
    )
    rows = pa.table({"kind": ["INSERT", "DELETE", "UPDATE"]})
    assert delete_mask(rows, custom).tolist() == [False, True, False]
    with pytest.raises(RecordConformError, match="op 'c'"):
        delete_mask(pa.table({"kind": ["c"]}), custom)


def test_envelope_rows_come_from_after_and_deleted_keys_from_before() -> None:
    image = pa.struct([("id", pa.int64()), ("name", pa.string())])
    rows = pa.table(
        {
            "op": ["c", "d", "u"],
            "before": pa.array([None, {"id": 2, "name": "old"}, {"id": 3, "name": "x"}], image),
            "after": pa.array([{"id": 1, "name": "a"}, None, {"id": 3, "name": "y"}], image),
        }
    )
    deletes = delete_mask(rows, CDC)
    ups, dels = row_images(rows, CDC, deletes)
    assert ups.to_pylist() == [{"id": 1, "name": "a"}, {"id": 3, "name": "y"}]
    assert dels.to_pylist() == [{"id": 2, "name": "old"}]
    assert schema_rows(rows, CDC).to_pylist() == ups.to_pylist()
    # a flat record is its own row; its op field is not a column to infer
    assert schema_rows(pa.table({"kind": ["c"], "id": [1]}), FLAT).column_names == ["id"]


def test_a_delete_without_before_or_an_insert_without_after_is_refused() -> None:
    image = pa.struct([("id", pa.int64())])
    rows = pa.table(
        {
            "op": ["c", "d"],
            "before": pa.array([None, None], image),
            "after": pa.array([{"id": 1}, None], image),
        }
    )
    with pytest.raises(RecordConformError, match="a delete without its 'before' row image"):
        row_images(rows, CDC, delete_mask(rows, CDC))
    no_after = pa.table({"op": ["u"], "before": pa.array([{"id": 1}], image)})
    with pytest.raises(RecordConformError, match="an insert or update without its 'after'"):
        row_images(no_after, CDC, delete_mask(no_after, CDC))


def test_last_change_per_key_wins_and_a_final_delete_leaves_no_row() -> None:
    # changes in record order: key, delete?, and (for non-deletes) the row image
    changes = [
        (1, False, "a1"),
        (2, False, "b1"),
        (1, False, "a2"),
        (3, False, "c1"),
        (2, True, None),
        (3, True, None),
        (3, False, "c2"),
        (4, True, None),
    ]
    keys = pa.table(
        {
            "id": pa.array([k for k, _, _ in changes], pa.int64()),
            DELETE_FLAG: pa.array([d for _, d, _ in changes]),
        }
    )
    rows = pa.table(
        {
            "id": pa.array([k for k, d, _ in changes if not d], pa.int64()),
            "v": [v for _, d, v in changes if not d],
        }
    )
    final, touched = last_per_key(rows, keys)
    assert final.to_pylist() == [{"id": 1, "v": "a2"}, {"id": 3, "v": "c2"}]
    assert touched.column_names == ["id"]
    assert sorted(touched["id"].to_pylist()) == [1, 2, 3, 4]


def test_last_per_key_on_a_compound_key_at_scale_matches_a_dictionary() -> None:
    rng = np.random.default_rng(7)
    n = 20_000
    tenants = rng.choice(np.array(["a", "b", "c"]), n)
    ids = rng.integers(0, 500, n)
    deleted = rng.random(n) < 0.2
    keys = pa.table({"tenant": tenants, "id": ids, DELETE_FLAG: deleted})
    up = np.flatnonzero(~deleted)
    rows = pa.table({"tenant": tenants[up], "id": ids[up], "seq": up})
    expected: dict[tuple[str, int], int | None] = {}
    for i in range(n):
        expected[(str(tenants[i]), int(ids[i]))] = None if deleted[i] else i
    final, touched = last_per_key(rows, keys)
    got = {(r["tenant"], r["id"]): r["seq"] for r in final.to_pylist()}
    assert got == {k: v for k, v in expected.items() if v is not None}
    pairs = zip(touched["tenant"].to_pylist(), touched["id"].to_pylist(), strict=True)
    assert sorted(pairs) == sorted(expected)


# --------------------------------------------------------------------------- the converter


def test_debezium_changes_convert_to_final_rows_and_touched_keys() -> None:
    a1, a2 = row("t1", 1, "ann"), row("t1", 1, "anna", "renamed")
    b1 = row("t1", 2, "bob")
    c1 = row("t2", 1, "cy")
    recs = [ins(a1), ins(b1, "r"), upd(a1, a2), ins(c1), dele({"tenant": "t1", "id": 2})]
    out = converter(CDC).convert_batch(batch(recs))
    assert out.tables["db.users"].to_pylist() == [a2, c1]
    keys = out.keys["db.users"]
    # the table's key columns in schema order, with their field ids
    assert keys.schema.names == ["tenant", "id"]
    assert keys.schema.field("id").metadata == {b"PARQUET:field_id": b"2"}
    assert sorted(keys.to_pylist(), key=lambda k: (k["tenant"], k["id"])) == [
        {"tenant": "t1", "id": 1},
        {"tenant": "t1", "id": 2},
        {"tenant": "t2", "id": 1},
    ]
    assert keys.schema == key_arrow_schema(SCHEMA, ["tenant", "id"]).remove(2)


def test_upsert_mode_keeps_the_last_record_per_key_and_renames() -> None:
    config = UPSERT.model_copy(update={"rename": {"user": "name"}})
    recs = [
        {"tenant": "t", "id": 1, "user": "a"},
        {"tenant": "t", "id": 1, "user": "b"},
        {"tenant": "u", "id": 1, "user": "c"},
    ]
    out = converter(config).convert_batch(batch(recs))
    assert out.tables["db.users"].to_pylist() == [row("t", 1, "b"), row("u", 1, "c")]
    assert out.keys["db.users"].num_rows == 2


def test_flat_records_with_a_custom_op_field() -> None:
    recs = [
        {"kind": "c", **row("t", 1, "a")},
        {"kind": "d", "tenant": "t", "id": 1},
        {"kind": "u", **row("t", 2, "b")},
    ]
    out = converter(FLAT).convert_batch(batch(recs))
    assert out.tables["db.users"].to_pylist() == [row("t", 2, "b")]
    assert out.keys["db.users"].num_rows == 2


def test_bad_change_records_are_set_aside_and_the_last_change_is_chosen_across_parts() -> None:
    a1, a2, b1 = row("t", 1, "a"), row("t", 1, "a2"), row("t", 2, "b")
    recs = [
        ins(a1),
        {"op": "x", "after": b1},  # unknown op
        ins(b1),
        dele({"tenant": "t"}),  # a delete without the whole key
        {"op": "u", "before": a1, "after": {"tenant": "t", "id": 1}},  # required name missing
        upd(a1, a2),
    ]
    out = converter(CDC).convert_tolerant(batch(recs))
    assert [(r.row, r.error.kind, r.error.offset) for r in out.rejected] == [
        (1, "conform", 501),
        (3, "conform", 503),
        (4, "conform", 504),
    ]
    assert all(r.error.table == "db.users" for r in out.rejected)
    assert "op 'x'" in str(out.rejected[0].error)
    assert out.tables["db.users"].to_pylist() == [b1, a2]
    assert sorted(out.keys["db.users"]["id"].to_pylist()) == [1, 2]
    with pytest.raises(RecordConformError, match=r"users\[0\]@501"):
        converter(CDC).convert(batch(recs))


# --------------------------------------------------------------------------- config


def pipeline(**table: Any) -> dict[str, Any]:
    return {"name": "p", "source": {"topics": ["t"]}, "tables": [{"name": "db.t", **table}]}


def test_keyed_modes_need_id_columns_and_say_how() -> None:
    assert config_from_dict(pipeline()).tables[0].mode == "append"
    with pytest.raises(ConfigError) as err:
        config_from_dict(pipeline(mode="upsert"))
    assert err.value.key == "tables.0.id_columns"
    assert "set id_columns" in err.value.fix
    with pytest.raises(ConfigError, match="use one of"):
        config_from_dict(pipeline(mode="merge", id_columns=["id"]))


def test_an_op_value_in_both_lists_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(pipeline(mode="cdc", id_columns=["id"], cdc_delete_ops=["d", "u"]))
    assert err.value.key == "tables.0.cdc_delete_ops"
    assert "['u']" in err.value.problem


def test_dynamic_tables_pass_their_change_options_on() -> None:
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "dynamic_tables": {
                "route_field": "tbl",
                "mode": "cdc",
                "id_columns": ["id"],
                "cdc_op_field": "kind",
                "cdc_envelope": "none",
                "cdc_delete_ops": ["D"],
                "cdc_upsert_ops": ["I", "U"],
            },
        }
    )
    assert config.dynamic_tables is not None
    entry = config.dynamic_tables.table_config("db.x", ["x"])
    assert (entry.mode, entry.id_columns, entry.cdc_op_field, entry.cdc_envelope) == (
        "cdc",
        ["id"],
        "kind",
        "none",
    )
    assert (entry.cdc_upsert_ops, entry.cdc_delete_ops) == (["I", "U"], ["D"])
