"""Conforming decoded records to an Iceberg table's Arrow schema: names, aliases, casts.

The table schema is the source of truth (as in Iceberg's Kafka Connect sink): each table field
takes the decoded column with its name, else one of its name-mapping aliases, else (optionally)
a case-insensitive match, and is cast to the table's type. Everything runs on whole Arrow
arrays with ``pyarrow.compute``; per-record work happens only after a batch has failed, to
find the first offending record and name it. The record converter
(:mod:`icefloe.records.converter`) runs the codec and calls :func:`conform` per table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from cachetools import LRUCache, cached
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import MappedField, NameMapping
from pyiceberg.types import IcebergType, ListType, MapType, NestedField, StructType

from icefloe.errors import RecordConformError, record_error
from icefloe.hookspecs import failing_prefix_end

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from icefloe.hookspecs import DecodeContext

# what a failed conversion raises (icefloe.hookspecs.failing_prefix_end counts the same)
_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError)
_ZONED = r"[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([zZ]|[+-]\d{2}(:?\d{2})?)$"


class _MisfitError(Exception):
    """A value that does not fit, at ``row`` of the array being converted (internal)."""

    def __init__(self, row: int, path: str, problem: str) -> None:
        super().__init__(problem)
        self.row = row
        self.path = path
        self.problem = problem


# --------------------------------------------------------------------------- names


def mapped_names(mapping: NameMapping | None) -> dict[int, tuple[str, ...]]:
    """field id -> every name the mapping gives it (aliases included)."""
    out: dict[int, tuple[str, ...]] = {}

    def walk(fields: Iterable[MappedField]) -> None:
        for mf in fields:
            if mf.field_id is not None:
                out[mf.field_id] = out.get(mf.field_id, ()) + tuple(mf.names)
            walk(mf.fields)

    if mapping is not None:
        walk(mapping.root)
    return out


def names_of(field: NestedField, names: Mapping[int, tuple[str, ...]]) -> list[str]:
    """The field's own name first, then its aliases in mapping order."""
    out = [field.name]
    for n in names.get(field.field_id, ()):
        if n not in out:
            out.append(n)
    return out


def table_name_mapping(table: Table) -> NameMapping | None:
    """The table's ``schema.name-mapping.default`` (with aliases), if it has one."""
    mapping: NameMapping | None = table.name_mapping()
    return mapping


@dataclass(frozen=True)
class ConformTarget:
    """What conforming to a schema needs besides the rows: the schema in Arrow and every name
    (aliases included) of each field. Derived once per table version (:func:`table_target`):
    a task of a stream fanned out to 1,000 tables conforms a small share per table, and
    deriving these per call was about half of its conform CPU (issue 27)."""

    arrow: pa.Schema
    names: Mapping[int, tuple[str, ...]]
    name_mapping: NameMapping | None = None


def conform_target(schema: Schema, name_mapping: NameMapping | None = None) -> ConformTarget:
    """The target for ``schema`` with ``name_mapping`` (default: the schema's own names)."""
    mapping = name_mapping if name_mapping is not None else schema.name_mapping
    return ConformTarget(schema_to_pyarrow(schema), mapped_names(mapping), name_mapping)


def _target_key(table: Table) -> tuple[Any, ...]:
    from pyiceberg.table import TableProperties

    meta = table.metadata
    mapping_json = meta.properties.get(TableProperties.DEFAULT_NAME_MAPPING)
    return (meta.table_uuid, meta.current_schema_id, mapping_json)


# a worker writing for 1,000 tables keeps one target each
@cached(LRUCache(4096), key=_target_key, lock=threading.Lock())
def table_target(table: Table) -> ConformTarget:
    """The table's current schema and name mapping as a :class:`ConformTarget`, kept per
    (table uuid, schema id, name-mapping property): a table never reuses a schema id for
    another schema, so a new version of either makes a new target."""
    return conform_target(table.schema(), table_name_mapping(table))


# --------------------------------------------------------------------------- casts


def _first_failing(arr: pa.Array, fn: Callable[[pa.Array], Any]) -> int:
    """Index of the first element ``fn`` rejects: :func:`~icefloe.hookspecs.failing_prefix_end`,
    checked on the element itself, with a linear scan as the fallback for conversions whose
    failure is not monotone in the prefix."""
    candidates: list[int] = [failing_prefix_end(arr, fn), *range(len(arr))]
    for i in candidates:
        try:
            fn(arr.slice(i, 1))
        except _ARROW_ERRORS:
            return i
    return 0


def _first_true(mask: pa.Array) -> int:
    return int(pc.index(mask, True).as_py())


def _first_valid(arr: pa.Array) -> int:
    return max(_first_true(arr.is_valid()), 0) if len(arr) else 0


def _str_to_timestamp(arr: pa.Array, target: pa.TimestampType) -> pa.Array:
    """ISO-8601 strings; a string without a zone offset is taken as UTC (Arrow refuses to
    guess, Kafka Connect's converter assumes UTC)."""
    zoned = pc.match_substring_regex(arr, _ZONED)
    utc_text = pc.if_else(zoned, arr, pc.binary_join_element_wise(arr, "Z", ""))
    utc = pc.cast(utc_text, pa.timestamp(target.unit, "UTC"))
    return pc.cast(utc, target)


def _int_to_timestamp(arr: pa.Array, target: pa.TimestampType) -> pa.Array:
    """Integers are epoch milliseconds (Kafka's own timestamp unit)."""
    factor = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}[target.unit]
    ms = pc.cast(arr, pa.int64())
    if factor is None:
        raise pa.ArrowNotImplementedError("epoch milliseconds do not fit a seconds timestamp")
    raw = pc.multiply_checked(ms, factor) if factor != 1 else ms
    return pc.cast(pc.cast(raw, pa.timestamp(target.unit)), target)


def _str_to_time(arr: pa.Array, target: pa.DataType) -> pa.Array:
    """Arrow has no string->time cast; parse as a time on the epoch day instead."""
    day = pc.binary_join_element_wise("1970-01-01T", arr, "")
    return pc.cast(pc.cast(day, pa.timestamp("ns")), target)


def _float_to_decimal(arr: pa.Array, target: pa.DataType) -> pa.Array:
    """Through the shortest decimal text, so 0.1 stays 0.1 and a lossy rescale fails
    (Arrow's direct float->decimal cast rounds silently)."""
    return pc.cast(pc.cast(arr, pa.string()), target)


def _int_to_decimal(arr: pa.Array, target: pa.Decimal128Type) -> pa.Array:
    wide = pa.decimal128(38, min(target.scale, 18))
    return pc.cast(pc.cast(arr, wide), target)


_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _str_to_uuid_bytes(arr: pa.Array) -> pa.Array:
    """Canonical or bare hex UUID text -> 16 bytes, by a numpy lookup (no per-value objects)."""
    bare = pc.replace_substring(pc.cast(arr, pa.string()), "-", "")
    fixed = pc.cast(bare, pa.binary(32))  # fails unless every value has 32 hex digits
    n = len(fixed)
    data = np.frombuffer(fixed.buffers()[1], dtype=np.uint8, count=(fixed.offset + n) * 32)
    nibbles = _HEX[data[fixed.offset * 32 :]].reshape(n, 32)
    valid = np.asarray(fixed.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if (nibbles[valid] == 255).any():
        raise pa.ArrowInvalid("not a UUID: expected 32 hexadecimal digits")
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]
    validity = None if fixed.null_count == 0 else pa.array(valid).buffers()[1]
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(16), n, [validity, pa.py_buffer(packed.tobytes())], fixed.null_count
    )


def _to_uuid(arr: pa.Array, target: pa.DataType) -> pa.Array:
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        storage = _str_to_uuid_bytes(arr)
    else:
        storage = pc.cast(arr, pa.binary(16))
    if isinstance(target, pa.BaseExtensionType):
        return pa.ExtensionArray.from_storage(target, storage)
    return storage


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _cast_fn(source: pa.DataType, target: pa.DataType) -> Callable[[pa.Array], pa.Array]:
    """The vectorised conversion from ``source`` to ``target`` values."""
    if isinstance(target, pa.BaseExtensionType):  # pyiceberg maps Iceberg uuid to arrow.uuid
        return lambda a: _to_uuid(a, target)
    if pa.types.is_timestamp(target):
        if _is_text(source):
            return lambda a: _str_to_timestamp(a, target)
        if pa.types.is_integer(source):
            return lambda a: _int_to_timestamp(a, target)
    if pa.types.is_time(target) and _is_text(source):
        return lambda a: _str_to_time(a, target)
    if pa.types.is_decimal(target):
        if pa.types.is_floating(source):
            return lambda a: _float_to_decimal(a, target)
        if pa.types.is_integer(source) and isinstance(target, pa.Decimal128Type):
            return lambda a: _int_to_decimal(a, target)
    return lambda a: pc.cast(a, target, safe=True)


# --------------------------------------------------------------------------- the walk


def _list_parts(arr: pa.Array) -> tuple[np.ndarray[Any, Any], pa.Array]:
    """Offsets rebased to 0 and the child values of exactly this (possibly sliced) array."""
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    values = arr.values if not isinstance(arr, pa.MapArray) else None
    if values is None:
        values = pa.StructArray.from_arrays([arr.keys, arr.items], names=["key", "value"])
    return offsets - start, values.slice(start, end - start)


def _parent_row(offsets: np.ndarray[Any, Any], child_row: int) -> int:
    return int(np.searchsorted(offsets, child_row, side="right")) - 1


def _null_mask(arr: pa.Array) -> pa.Array | None:
    return arr.is_null() if arr.null_count else None


# at most this many rows are put in one chunk before conforming (see conform)
_COMBINE_ROWS = 65_536


class _Conformer:
    """Walks the Iceberg type and the target Arrow type together."""

    def __init__(self, names: Mapping[int, tuple[str, ...]], case_insensitive: bool) -> None:
        self.names = names
        self.case_insensitive = case_insensitive

    def match(self, columns: Sequence[tuple[str, pa.Array]], field: NestedField) -> list[pa.Array]:
        """Source columns for ``field``, best first: its name, its aliases, then (when asked)
        the same names in any letter case."""
        wanted = names_of(field, self.names)
        found: list[int] = []
        for name in wanted:
            found += [i for i, (col, _) in enumerate(columns) if col == name and i not in found]
        if self.case_insensitive:
            folded = {n.casefold() for n in wanted}
            found += [
                i
                for i, (col, _) in enumerate(columns)
                if col.casefold() in folded and i not in found
            ]
        return [columns[i][1] for i in found]

    def fields(
        self,
        columns: Sequence[tuple[str, pa.Array]],
        fields: Sequence[NestedField],
        targets: Sequence[pa.Field],
        n: int,
        parent_valid: pa.Array | None,
        path: str,
    ) -> list[pa.Array]:
        out = []
        for field, target in zip(fields, targets, strict=True):
            where = f"{path}{field.name}"
            sources = self.match(columns, field)
            if not sources:
                arr = pa.nulls(n, target.type)
            else:
                converted = [self.value(s, field.field_type, target.type, where) for s in sources]
                arr = converted[0] if len(converted) == 1 else _coalesce(converted)
            if field.required:
                _check_required(arr, parent_valid, where, missing=not sources)
            out.append(arr)
        return out

    def value(self, arr: pa.Array, ice: IcebergType, target: pa.DataType, path: str) -> pa.Array:
        if arr.type == target:
            return arr
        if pa.types.is_null(arr.type):
            return pa.nulls(len(arr), target)
        if isinstance(arr, pa.DictionaryArray):
            arr = arr.dictionary_decode()
        if isinstance(ice, StructType):
            return self.struct(arr, ice, target, path)
        if isinstance(ice, ListType):
            return self.list(arr, ice, target, path)
        if isinstance(ice, MapType):
            return self.map(arr, ice, target, path)
        return _primitive(arr, target, path)

    def struct(self, arr: pa.Array, ice: StructType, target: pa.DataType, path: str) -> pa.Array:
        if not isinstance(arr, pa.StructArray):
            raise _MisfitError(_first_valid(arr), path, f"expected a record/object, got {arr.type}")
        columns = [(arr.type.field(i).name, c) for i, c in enumerate(arr.flatten())]
        valid = arr.is_valid() if arr.null_count else None
        targets = [target.field(i) for i in range(target.num_fields)]
        kids = self.fields(columns, ice.fields, targets, len(arr), valid, path + ".")
        return pa.StructArray.from_arrays(kids, fields=targets, mask=_null_mask(arr))

    def list(self, arr: pa.Array, ice: ListType, target: pa.DataType, path: str) -> pa.Array:
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            raise _MisfitError(_first_valid(arr), path, f"expected a list, got {arr.type}")
        offsets, values = _list_parts(arr)
        where = f"{path}.element"
        try:
            converted = self.value(values, ice.element_type, target.value_type, where)
            if ice.element_required:
                _check_required(converted, None, where)
        except _MisfitError as m:
            raise _MisfitError(_parent_row(offsets, m.row), m.path, m.problem) from None
        cls = pa.LargeListArray if pa.types.is_large_list(target) else pa.ListArray
        off_type = pa.int64() if cls is pa.LargeListArray else pa.int32()
        return cls.from_arrays(
            pa.array(offsets, off_type), converted, type=target, mask=_null_mask(arr)
        )

    def map(self, arr: pa.Array, ice: MapType, target: pa.MapType, path: str) -> pa.Array:
        if isinstance(arr, pa.StructArray):
            offsets, keys, items = _struct_entries(arr, path)
        elif isinstance(arr, pa.MapArray) or (
            (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type))
            and pa.types.is_struct(arr.type.value_type)
            and {"key", "value"} <= {f.name for f in arr.type.value_type}
        ):
            offsets, entries = _list_parts(arr)
            keys, items = entries.field("key"), entries.field("value")
        else:
            raise _MisfitError(_first_valid(arr), path, f"expected a map/object, got {arr.type}")
        try:
            k = self.value(keys, ice.key_type, target.key_type, f"{path}.key")
            _check_required(k, None, f"{path}.key")
            v = self.value(items, ice.value_type, target.item_type, f"{path}.value")
            if ice.value_required:
                _check_required(v, None, f"{path}.value")
        except _MisfitError as m:
            raise _MisfitError(_parent_row(offsets, m.row), m.path, m.problem) from None
        return pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()), k, v, type=target, mask=_null_mask(arr)
        )


def _valid_np(arr: pa.Array) -> np.ndarray[Any, Any]:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _coalesce(arrays: Sequence[pa.Array]) -> pa.Array:
    """Per row, the first non-null of ``arrays`` (same type). ``pc.coalesce`` where Arrow has a
    kernel; otherwise (extension types such as uuid) one ``take`` over their concatenation."""
    try:
        return pc.coalesce(*arrays)
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
        n = len(arrays[0])
        valid = np.stack([_valid_np(a) for a in arrays])  # (k, n)
        first = valid.argmax(axis=0)  # rows valid nowhere take arrays[0]'s null
        return pa.concat_arrays(list(arrays)).take(pa.array(first * n + np.arange(n)))


def _struct_entries(
    arr: pa.StructArray, path: str
) -> tuple[np.ndarray[Any, Any], pa.Array, pa.Array]:
    """A JSON object decoded as a struct (one child per key seen) as map entries: per row, the
    keys whose value is present, in field order. Built with numpy index arithmetic."""
    n, k = len(arr), arr.type.num_fields
    children = arr.flatten()
    if k == 0:
        empty = pa.array([], pa.string())
        return np.zeros(n + 1, dtype=np.int64), empty, pa.nulls(0)
    present = np.stack([_valid_np(c) for c in children], axis=1)  # (n, k): row r has key i
    counts = present.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows, cols = np.nonzero(present)  # row-major: per row, keys in field order
    names = pa.array([arr.type.field(i).name for i in range(k)], pa.string())
    keys = names.take(pa.array(cols))
    # values under different keys may have been inferred with different JSON types
    kinds = {c.type for c in children if not pa.types.is_null(c.type)}
    common = next(iter(kinds)) if len(kinds) == 1 else pa.string()
    try:
        same = [c if c.type == common else pc.cast(c, common) for c in children]
    except _ARROW_ERRORS:
        shown = ", ".join(sorted(str(t) for t in kinds))
        raise _MisfitError(
            _first_valid(arr), path, f"map values of different kinds ({shown})"
        ) from None
    items_all = pa.concat_arrays(same)
    items = items_all.take(pa.array(cols * n + rows))
    return offsets, keys, items


def _primitive(arr: pa.Array, target: pa.DataType, path: str) -> pa.Array:
    fn = _cast_fn(arr.type, target)
    try:
        return fn(arr)
    except pa.ArrowNotImplementedError as exc:
        raise _MisfitError(
            _first_valid(arr), path, f"cannot convert {arr.type} to {target} ({exc})"
        ) from None
    except _ARROW_ERRORS as exc:
        raise _MisfitError(_first_failing(arr, fn), path, str(exc)) from None


def _check_required(
    arr: pa.Array, parent_valid: pa.Array | None, path: str, missing: bool = False
) -> None:
    if arr.null_count == 0:
        return
    mask = arr.is_null()
    if parent_valid is not None:
        mask = pc.and_(mask, parent_valid)
    row = _first_true(mask)
    if row >= 0:
        problem = "required field is missing" if missing else "required field is null"
        raise _MisfitError(row, path, problem)


# --------------------------------------------------------------------------- public API


def conform(
    table: pa.Table,
    iceberg_schema: Schema,
    *,
    case_insensitive: bool = False,
    context: DecodeContext | None = None,
    name_mapping: NameMapping | None = None,
    target: ConformTarget | None = None,
) -> pa.Table:
    """``table`` converted to exactly ``schema_to_pyarrow(iceberg_schema)``.

    Columns are matched by field name, then by the aliases of ``name_mapping`` (default: the
    schema's own names; pass :func:`table_name_mapping` to honour the table's
    ``schema.name-mapping.default``), then, with ``case_insensitive``, in any letter case;
    several matches are coalesced in that order. Missing optional fields become nulls; a
    missing or null required field, or a value that does not cast safely, raises
    RecordConversionError for the first such row (``context`` gives its topic, partition,
    offset). Extra columns are dropped. ``target``, when given, is
    ``conform_target(iceberg_schema, name_mapping)`` derived before (:func:`table_target`).
    """
    if target is None:
        target = conform_target(iceberg_schema, name_mapping)
    conv = _Conformer(target.names, case_insensitive)
    arrow = target.arrow
    if table.num_rows <= _COMBINE_ROWS and len(table.to_batches()) > 1:
        # one table's share of a batch routed to many keeps the decoder's chunking (a chunk
        # per ~1 MB of JSON), and every chunk costs a round of per-field work: at 200 tables
        # 29 rounds per table made conforming 10 ms a table; a copy of so few rows is cheap
        table = table.combine_chunks()
    batches = []
    base = 0
    for batch in table.to_batches() or [pa.RecordBatch.from_pylist([], table.schema)]:
        columns = list(zip(batch.schema.names, batch.columns, strict=True))
        try:
            arrays = conv.fields(columns, iceberg_schema.fields, list(arrow), len(batch), None, "")
        except _MisfitError as m:
            raise record_error(
                context, base + m.row, m.path, m.problem, RecordConformError
            ) from None
        batches.append(pa.RecordBatch.from_arrays(arrays, schema=arrow))
        base += len(batch)
    return pa.Table.from_batches(batches, schema=arrow)
