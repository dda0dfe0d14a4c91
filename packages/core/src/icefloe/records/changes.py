"""Upsert and CDC records as row images and keys (docs/upsert.md).

A keyed table (``mode = "upsert"`` or ``"cdc"``) gets, per write task, the final row image of
every key the task's records touched (the last change per key wins; a key whose last change is
a delete gets no row) and the distinct keys themselves. The coordinator turns the keys into
deletes of the rows they replace, so the final images are the only live rows per key.

Why keys and not equality deletes read by readers: pyiceberg 0.12 cannot read equality deletes;
the keys are resolved to position deletes at commit time. All work here is columnar: ops are
matched with ``pc.is_in``, the last change per key is a ``group_by`` over row numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema

from icefloe.errors import RecordConformError, record_error

if TYPE_CHECKING:
    from icefloe.config import ChangeOptions
    from icefloe.hookspecs import DecodeContext

# A key table's flag column between conversion and :func:`last_per_key`: the change is a delete.
DELETE_FLAG = "__icefloe_delete"
BEFORE, AFTER = "before", "after"


def key_schema(schema: Schema, id_columns: Sequence[str]) -> Schema:
    """The identifier columns of ``schema``, keeping their field ids (what key files hold)."""
    return schema.select(*id_columns, case_sensitive=True)


def key_arrow_schema(schema: Schema, id_columns: Sequence[str]) -> pa.Schema:
    """Arrow schema of a key table as conversion hands it on: the keys and the delete flag."""
    keys = schema_to_pyarrow(key_schema(schema, id_columns))
    return keys.append(pa.field(DELETE_FLAG, pa.bool_(), nullable=False))


def _error(context: DecodeContext | None, row: int, field: str, problem: str) -> Exception:
    return record_error(context, row, field, problem, RecordConformError)


def delete_mask(
    rows: pa.Table, options: ChangeOptions, context: DecodeContext | None = None
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Per row, whether its change is a delete. ``upsert`` tables have no deletes; ``cdc``
    tables read the op field. A missing, null or unknown op raises RecordConformError for the
    first such row, so it meets the ``[errors]`` policy like any bad record."""
    n = rows.num_rows
    if options.mode != "cdc":
        return np.zeros(n, dtype=bool)
    field = options.cdc_op_field
    if n == 0:  # (an empty column may have no chunks: no first bad op to point at)
        return np.zeros(0, dtype=bool)
    if field not in rows.column_names:
        raise _error(context, 0, field, f"the record has no op field '{field}'")
    try:
        ops = pc.cast(rows[field], pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise _error(context, 0, field, f"the op field is not text ({exc})") from None
    upsert = pc.is_in(ops, value_set=pa.array(options.cdc_upsert_ops, pa.string()))
    delete = pc.is_in(ops, value_set=pa.array(options.cdc_delete_ops, pa.string()))
    known = pc.fill_null(pc.or_(upsert, delete), False)
    if not pc.all(known).as_py():
        row = int(pc.index(known, False).as_py())
        value = ops[row].as_py()
        raise _error(
            context,
            row,
            field,
            f"op {value!r} is none of cdc_upsert_ops {options.cdc_upsert_ops} and "
            f"cdc_delete_ops {options.cdc_delete_ops}; add it to one of them",
        )
    mask = pc.fill_null(delete, False).combine_chunks()
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)


def _struct_rows(rows: pa.Table, name: str) -> tuple[pa.Table, np.ndarray[Any, Any]]:
    """The fields of struct column ``name`` as a table, and per row whether it is present."""
    n = rows.num_rows
    if name not in rows.column_names:
        return pa.table({}).take(pa.array([], pa.int64())), np.zeros(n, dtype=bool)
    col = rows[name].combine_chunks()
    if not pa.types.is_struct(col.type):
        return pa.table({}).take(pa.array([], pa.int64())), np.zeros(n, dtype=bool)
    present = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    names = [col.type.field(i).name for i in range(col.type.num_fields)]
    return pa.Table.from_arrays(col.flatten(), names=names), present


def row_images(
    rows: pa.Table,
    options: ChangeOptions,
    deletes: np.ndarray[Any, np.dtype[np.bool_]],
    context: DecodeContext | None = None,
) -> tuple[pa.Table, pa.Table]:
    """(images of the upserted rows, images that name the deleted keys), each in record order.

    Under the Debezium envelope a record's row is its ``after`` and a delete's key comes from
    its ``before``; otherwise the record itself is the row (its op field is dropped when the
    table is converted, as any extra field is). A change without the image it needs raises
    RecordConformError for that record.
    """
    keep = pa.array(~deletes)
    drop = pa.array(deletes)
    if options.mode != "cdc" or options.cdc_envelope == "none":
        return rows.filter(keep), rows.filter(drop)
    if rows.num_rows == 0:
        return rows, rows
    after, has_after = _struct_rows(rows, AFTER)
    before, has_before = _struct_rows(rows, BEFORE)
    for wanted, present, name, what in (
        (~deletes, has_after, AFTER, "an insert or update"),
        (deletes, has_before, BEFORE, "a delete"),
    ):
        missing = np.flatnonzero(wanted & ~present)
        if len(missing):
            raise _error(
                context,
                int(missing[0]),
                name,
                f"{what} without its '{name}' row image (cdc_envelope = \"debezium\"); "
                'set cdc_envelope = "none" if records are not Debezium envelopes',
            )
    ups = after.filter(keep) if after.num_columns else after
    dels = before.filter(drop) if before.num_columns else before
    return ups, dels


def schema_rows(rows: pa.Table, options: ChangeOptions) -> pa.Table:
    """The rows a keyed table's schema is inferred from: the ``after`` images under the
    Debezium envelope (records without one add nothing), else the records without their op
    field."""
    if options.mode != "cdc":
        return rows
    if options.cdc_envelope == "none":
        names = [n for n in rows.column_names if n != options.cdc_op_field]
        return rows.select(names)
    after, present = _struct_rows(rows, AFTER)
    return after.filter(pa.array(present)) if after.num_columns else after


def row_schema(schema: pa.Schema, options: ChangeOptions) -> pa.Schema:
    """The row columns of a record schema a format declares (Avro's writer schema), what a
    keyed table is created with: the fields of ``after`` under the Debezium envelope, else the
    record's fields without the op field (as :func:`schema_rows` does for inferred rows)."""
    if options.mode != "cdc":
        return schema
    if options.cdc_envelope == "none":
        return pa.schema([f for f in schema if f.name != options.cdc_op_field])
    index = schema.get_field_index(AFTER)
    after = schema.field(index).type if index >= 0 else None
    if not isinstance(after, pa.StructType):
        return pa.schema([])  # nothing to create the table from (creation says so)
    return pa.schema([after.field(i) for i in range(after.num_fields)])


def interleave_keys(
    upsert_keys: pa.Table,
    delete_keys: pa.Table,
    deletes: np.ndarray[Any, np.dtype[np.bool_]],
    target: pa.Schema,
) -> pa.Table:
    """One key table in record order from the keys of the upserts and of the deletes (each in
    record order), with the delete flag; ``target`` is :func:`key_arrow_schema`."""
    keys = target.remove(target.get_field_index(DELETE_FLAG))
    both = pa.concat_tables([upsert_keys.cast(keys), delete_keys.cast(keys)])
    where = np.concatenate([np.flatnonzero(~deletes), np.flatnonzero(deletes)])
    ordered = both.take(pa.array(np.argsort(where, kind="stable")))
    return ordered.append_column(target.field(DELETE_FLAG), pa.array(deletes, pa.bool_()))


def comparable_type(arrow_type: pa.DataType) -> pa.DataType:
    """The type key values are grouped, matched and joined as: an extension type's storage.
    Arrow's hash kernels (``group_by``, ``is_in``) have none for extension types (``uuid``,
    read as ``extension<arrow.uuid>``), and equal storage means equal keys."""
    if isinstance(arrow_type, pa.BaseExtensionType):
        return arrow_type.storage_type
    return arrow_type


def leaf_fields(schema: pa.Schema) -> list[tuple[list[str], pa.Field]]:
    """The primitive fields of ``schema``, depth first, each with its names from the
    top-level column down (identifier fields are primitives, nested in structs at most)."""
    found: list[tuple[list[str], pa.Field]] = []

    def walk(column: pa.Field, path: list[str]) -> None:
        if pa.types.is_struct(column.type):
            for child in column.type:
                walk(child, [*path, child.name])
        else:
            found.append((path, column))

    for column in schema:
        walk(column, [column.name])
    return found


def key_leaves(keys: pa.Table) -> list[pa.ChunkedArray]:
    """The primitive key columns of ``keys``, depth first: identifier fields nested in structs
    (which Iceberg allows) come out of their structs, and each column has its
    :func:`comparable_type`. Arrow groups and matches no struct columns."""
    leaves: list[pa.ChunkedArray] = []

    def walk(column: pa.ChunkedArray) -> None:
        if pa.types.is_struct(column.type):
            for child in column.flatten():
                walk(child)
        else:
            leaves.append(column.cast(comparable_type(column.type)))

    for column in keys.columns:
        walk(column)
    return leaves


def last_per_key(rows: pa.Table, keys: pa.Table) -> tuple[pa.Table, pa.Table]:
    """(final row images, distinct keys) from a task's changes in record order.

    ``keys`` has one row per change (the key columns and :data:`DELETE_FLAG`); ``rows`` one
    row per non-delete change, in the same order. Per key the last change wins: its row image
    is kept unless it is a delete. Both results are in the order of each key's last change.
    """
    names = [n for n in keys.column_names if n != DELETE_FLAG]
    n = keys.num_rows
    if n == 0:
        return rows, keys.select(names)
    deleted = np.asarray(keys[DELETE_FLAG].to_numpy(), dtype=bool)
    columns = {f"k{i}": leaf for i, leaf in enumerate(key_leaves(keys.select(names)))}
    columns["row"] = pa.chunked_array([pa.array(np.arange(n, dtype=np.int64))])
    grouped = pa.table(columns).group_by(list(columns)[:-1], use_threads=False)
    last = np.sort(grouped.aggregate([("row", "max")])["row_max"].to_numpy())
    row_of_change = np.cumsum(~deleted) - 1  # the change's row in ``rows`` (when not a delete)
    kept = last[~deleted[last]]
    return rows.take(pa.array(row_of_change[kept])), keys.select(names).take(pa.array(last))
