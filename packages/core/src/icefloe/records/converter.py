"""Best-fit conversion of decoded records to an Iceberg table's Arrow schema.

The table schema is the source of truth (as in Iceberg's Kafka Connect sink): each table field
takes the decoded column with its name, else one of its name-mapping aliases, else (optionally)
a case-insensitive match, and is cast to the table's type. Everything runs on whole Arrow
arrays with ``pyarrow.compute``; per-record work happens only after a batch has failed, to
find the first offending record and name it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import MappedField, NameMapping
from pyiceberg.types import IcebergType, ListType, MapType, NestedField, StructType

from icefloe.errors import (
    ConfigError,
    RecordConformError,
    RecordConversionError,
    RecordDecodeError,
    RecordRouteError,
)
from icefloe.hookspecs import DecodeContext, RecordCodec
from icefloe.records.changes import (
    AFTER,
    BEFORE,
    delete_mask,
    interleave_keys,
    key_arrow_schema,
    key_schema,
    last_per_key,
    row_images,
)

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from icefloe.config import SourceConfig, TableConfig
    from icefloe.plugins.manager import Plugins

# Schema metadata a codec may read: the caller matches names case-insensitively, so a codec
# that would drop fields not named in the schema should keep them instead.
CASE_INSENSITIVE_KEY = b"icefloe.case-insensitive"
# Schema metadata asking a codec to decode every field with the types it finds (no schema to
# follow): what schema inference and evolution look at (icefloe.records.evolution).
INFER_ALL_KEY = b"icefloe.infer-all"

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


def _names_of(field: NestedField, names: Mapping[int, tuple[str, ...]]) -> list[str]:
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


# --------------------------------------------------------------------------- casts


def failing_prefix_end(arr: pa.Array, fn: Callable[[pa.Array], Any]) -> int:
    """The last index of the shortest prefix of ``arr`` that ``fn`` rejects (``arr`` as a whole
    is known to fail), by a binary search over prefixes: O(log n) vectorised calls. That element
    is not always at fault itself: it may only conflict with an earlier one."""
    lo, hi = 1, len(arr)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fn(arr.slice(0, mid))
        except _ARROW_ERRORS:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def _first_failing(arr: pa.Array, fn: Callable[[pa.Array], Any]) -> int:
    """Index of the first element ``fn`` rejects: :func:`failing_prefix_end`, checked on the
    element itself, with a linear scan as the fallback for conversions whose failure is not
    monotone in the prefix."""
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


class _Converter:
    """Walks the Iceberg type and the target Arrow type together."""

    def __init__(self, names: Mapping[int, tuple[str, ...]], case_insensitive: bool) -> None:
        self.names = names
        self.case_insensitive = case_insensitive

    def match(self, columns: Sequence[tuple[str, pa.Array]], field: NestedField) -> list[pa.Array]:
        """Source columns for ``field``, best first: its name, its aliases, then (when asked)
        the same names in any letter case."""
        wanted = _names_of(field, self.names)
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


def record_error(
    context: DecodeContext | None,
    row: int,
    field: str | None,
    problem: str,
    error: type[RecordConversionError] = RecordDecodeError,
) -> RecordConversionError:
    """A RecordConversionError (by default a decode error, what codecs raise) for ``row`` of
    the batch ``context`` describes."""
    if context is None or row >= len(context.offsets):
        return error("<batch>", -1, row, field, f"row {row}: {problem}")
    return error(
        str(context.topics[row].as_py()),
        int(context.partitions[row].as_py()),
        int(context.offsets[row].as_py()),
        field,
        problem,
    )


def conform(
    table: pa.Table,
    iceberg_schema: Schema,
    *,
    case_insensitive: bool = False,
    context: DecodeContext | None = None,
    name_mapping: NameMapping | None = None,
) -> pa.Table:
    """``table`` converted to exactly ``schema_to_pyarrow(iceberg_schema)``.

    Columns are matched by field name, then by the aliases of ``name_mapping`` (default: the
    schema's own names; pass :func:`table_name_mapping` to honour the table's
    ``schema.name-mapping.default``), then, with ``case_insensitive``, in any letter case;
    several matches are coalesced in that order. Missing optional fields become nulls; a
    missing or null required field, or a value that does not cast safely, raises
    RecordConversionError for the first such row (``context`` gives its topic, partition,
    offset). Extra columns are dropped.
    """
    target = schema_to_pyarrow(iceberg_schema)
    mapping = name_mapping if name_mapping is not None else iceberg_schema.name_mapping
    conv = _Converter(mapped_names(mapping), case_insensitive)
    batches = []
    base = 0
    for batch in table.to_batches() or [pa.RecordBatch.from_pylist([], table.schema)]:
        columns = list(zip(batch.schema.names, batch.columns, strict=True))
        try:
            arrays = conv.fields(columns, iceberg_schema.fields, list(target), len(batch), None, "")
        except _MisfitError as m:
            raise record_error(
                context, base + m.row, m.path, m.problem, RecordConformError
            ) from None
        batches.append(pa.RecordBatch.from_arrays(arrays, schema=target))
        base += len(batch)
    return pa.Table.from_batches(batches, schema=target)


# --------------------------------------------------------------------------- hints


def _hint_type(ice: IcebergType, target: pa.DataType, names: Mapping[int, tuple[str, ...]]) -> Any:
    """The decode type of a field: the target type with every alias of a nested field added
    as a sibling, so a codec that decodes only named fields keeps aliased ones too."""
    if isinstance(ice, StructType):
        return pa.struct(_hint_fields(ice.fields, list(target), names))
    if isinstance(ice, ListType):
        return pa.list_(_hint_type(ice.element_type, target.value_type, names))
    return target


def _hint_fields(
    fields: Sequence[NestedField], targets: Sequence[pa.Field], names: Mapping[int, tuple[str, ...]]
) -> list[pa.Field]:
    out: list[pa.Field] = []
    for field, target in zip(fields, targets, strict=True):
        t = _hint_type(field.field_type, target.type, names)
        out += [pa.field(n, t) for n in _names_of(field, names)]
    return out


@dataclass(frozen=True)
class TargetTable:
    """One table records are converted for: its config (routing), schema and name mapping."""

    config: TableConfig
    schema: Schema
    name_mapping: NameMapping | None = None

    @classmethod
    def of(cls, config: TableConfig, table: Table) -> TargetTable:
        return cls(config, table.schema(), table_name_mapping(table))


def decode_hint(
    targets: Sequence[TargetTable], case_insensitive: bool = False, extra: Sequence[str] = ()
) -> pa.Schema:
    """The schema a codec decodes into for all ``targets`` at once: every field (and alias)
    of every table, first table's type winning on a clash, plus ``extra`` string columns (route
    fields). Conversion to each table's exact schema is :func:`conform`'s job."""
    fields: dict[str, pa.Field] = {}
    for t in targets:
        arrow = schema_to_pyarrow(t.schema)
        names = mapped_names(t.name_mapping or t.schema.name_mapping)
        hinted = _hint_fields(t.schema.fields, list(arrow), names)
        by_name = {f.name: f for f in hinted}
        for source, column in t.config.rename.items():  # decode the source field as its column
            if column in by_name:
                hinted.append(by_name[column].with_name(source))
        cfg = t.config
        if cfg.mode == "cdc":
            fields.setdefault(cfg.cdc_op_field, pa.field(cfg.cdc_op_field, pa.string()))
        if cfg.mode == "cdc" and cfg.cdc_envelope == "debezium":  # the row is inside
            hinted = [pa.field(BEFORE, pa.struct(hinted)), pa.field(AFTER, pa.struct(hinted))]
        for f in hinted:
            fields.setdefault(f.name, f)
    for name in extra:
        fields.setdefault(name, pa.field(name, pa.string()))
    meta = {CASE_INSENSITIVE_KEY: b"true"} if case_insensitive else None
    return pa.schema(list(fields.values()), metadata=meta)


def renamed(table: pa.Table, rename: Mapping[str, str]) -> pa.Table:
    """``table`` with its top-level columns renamed source field -> column (a table's
    ``rename``); a column already named like the target is dropped in favour of the renamed
    source field."""
    if not rename or not any(n in rename for n in table.column_names):
        return table
    targets = {rename[n] for n in table.column_names if n in rename}
    keep = [i for i, n in enumerate(table.column_names) if n in rename or n not in targets]
    table = table.select(keep)
    return table.rename_columns([rename.get(n, n) for n in table.column_names])


def kafka_context(batch: pa.RecordBatch | pa.Table, locate: bool = True) -> DecodeContext:
    """The DecodeContext of a batch in Spark's Kafka column layout."""

    def col(name: str) -> pa.Array:
        c = batch.column(name)
        return c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c

    return DecodeContext(
        topics=col("topic"), partitions=col("partition"), offsets=col("offset"), locate=locate
    )


def filter_context(context: DecodeContext, mask: pa.Array) -> DecodeContext:
    return DecodeContext(
        topics=context.topics.filter(mask),
        partitions=context.partitions.filter(mask),
        offsets=context.offsets.filter(mask),
        locate=context.locate,
    )


# Options of ``source.format_options`` that belong to conversion, not to the codec.
CONVERTER_OPTIONS = ("tombstones", "case_insensitive")


class RecordConverter:
    """The hot path of a writer task: a batch in Spark's Kafka layout -> one Arrow table per
    target table, in that table's schema. Decode once (vectorised codec), route, conform.

    Tombstones (null values) are skipped by default (``tombstones = "skip"``; ``"error"``
    raises RecordConversionError naming the record) - an append-only sink has no row to
    delete.
    """

    def __init__(
        self,
        codec: RecordCodec,
        targets: Sequence[TargetTable],
        *,
        case_insensitive: bool = False,
        tombstones: Literal["skip", "error"] = "skip",
        route_note: str = "",
    ) -> None:
        self.codec = codec
        self.targets = list(targets)
        self.case_insensitive = case_insensitive
        self.tombstones = tombstones
        self.route_note = route_note  # added to "no table takes the record" errors
        route_fields = [t.config.route_field for t in targets if t.config.route_field]
        self.hint = decode_hint(self.targets, case_insensitive, route_fields)

    @classmethod
    def from_config(
        cls, source: SourceConfig, targets: Sequence[TargetTable], plugins: Plugins | None = None
    ) -> RecordConverter:
        """Build the codec named by ``source.format`` through the plugin manager; the
        converter's own options (:data:`CONVERTER_OPTIONS`) are taken out of
        ``source.format_options`` first."""
        from icefloe.plugins.manager import get_plugins

        options = dict(source.format_options)
        tombstones = options.pop("tombstones", "skip")
        if tombstones not in ("skip", "error"):
            raise ConfigError(
                "source.format_options.tombstones",
                "must be 'skip' or 'error'",
                'set tombstones = "skip" (drop null values) or "error"',
                tombstones,
            )
        case_insensitive = options.pop("case_insensitive", False)
        if not isinstance(case_insensitive, bool):
            raise ConfigError(
                "source.format_options.case_insensitive",
                "must be true or false",
                "write case_insensitive = true",
                case_insensitive,
            )
        codec = (plugins or get_plugins()).codec(source.format).factory(options)
        return cls(codec, targets, case_insensitive=case_insensitive, tombstones=tombstones)

    def decode(
        self, batch: pa.RecordBatch | pa.Table, locate: bool = True
    ) -> tuple[pa.Table, DecodeContext]:
        """Decode the ``value`` column of a Kafka-layout batch (tombstones handled)."""
        context = kafka_context(batch, locate)
        values = batch.column("value")
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if values.null_count:
            if self.tombstones == "error":
                row = _first_true(values.is_null())
                raise record_error(context, row, None, "null value (tombstone)")
            keep = values.is_valid()
            values = values.filter(keep)
            context = filter_context(context, keep)
        decoded = self.codec.decode(values, self.hint, context)
        if decoded.num_rows != len(values):
            raise RecordConversionError(
                "<batch>",
                -1,
                -1,
                None,
                f"codec returned {decoded.num_rows} rows for {len(values)} values",
            )
        return decoded, context

    def decode_parts(self, batch: pa.RecordBatch | pa.Table) -> list[pa.Table]:
        """Every decodable record of ``batch``, each field with the type its values have (not
        the tables'), in parts: a batch with undecodable records is halved around them, as
        :meth:`convert_tolerant` does, and they are left out (conversion reports them)."""
        hint = pa.schema([], metadata={INFER_ALL_KEY: b"true"})
        values = batch.column("value")
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        values = values.filter(values.is_valid())
        parts: list[pa.Table] = []
        stack = [(0, len(values))]
        while stack:
            lo, hi = stack.pop()
            if hi <= lo:
                continue
            part = values.slice(lo, hi - lo)
            # no positions: a failing part is split, not reported (conversion names records)
            context = DecodeContext(
                topics=pa.array([], pa.string()),
                partitions=pa.array([], pa.int32()),
                offsets=pa.array([], pa.int64()),
                locate=False,
            )
            try:
                parts.append(self.codec.decode(part, hint, context))
            except RecordConversionError:
                if hi - lo > 1:
                    mid = (lo + hi) // 2
                    stack += [(mid, hi), (lo, mid)]
        return parts

    def convert(self, batch: pa.RecordBatch | pa.Table, locate: bool = True) -> dict[str, pa.Table]:
        """table name -> rows for it in its exact Arrow schema (tables with no rows included,
        empty); for a keyed table the final row image per key (:meth:`convert_batch`). The
        first record that cannot be decoded (RecordDecodeError), that no table takes
        (RecordRouteError) or that does not fit a table (RecordConformError) fails it.
        ``locate`` False lets the codec skip naming the record (see :meth:`convert_tolerant`)."""
        return self.convert_batch(batch, locate).tables

    def convert_batch(self, batch: pa.RecordBatch | pa.Table, locate: bool = True) -> Conversion:
        """Like :meth:`convert`, with the keys each keyed table's records touched."""
        return _last_changes(*self._convert(batch, locate))

    def _convert(
        self, batch: pa.RecordBatch | pa.Table, locate: bool
    ) -> tuple[dict[str, pa.Table], dict[str, pa.Table]]:
        """Rows per table and, per keyed table, one key row per change (with the delete flag)
        in record order, the last change per key not yet chosen: :meth:`convert_tolerant`
        converts a batch in parts and must choose over all of them."""
        from icefloe.records.routing import route_masks, unrouted_problem

        decoded, context = self.decode(batch, locate)
        configs = [t.config for t in self.targets]
        masks = route_masks(decoded, configs, self.case_insensitive)
        unrouted = unrouted_problem(decoded, masks, configs, self.case_insensitive)
        if unrouted is not None:
            problem = f"{unrouted[1]}{self.route_note}"
            raise record_error(context, unrouted[0], None, problem, RecordRouteError)
        out: dict[str, pa.Table] = {}
        keys: dict[str, pa.Table] = {}
        for t in self.targets:
            mask = masks[t.config.name]
            rows, ctx = decoded, context
            if mask is not None:
                rows, ctx = decoded.filter(mask), filter_context(context, mask)
            try:
                if t.config.keyed:
                    out[t.config.name], keys[t.config.name] = self._changes(t, rows, ctx)
                else:
                    out[t.config.name] = self._conform(t, renamed(rows, t.config.rename), ctx)
            except RecordConversionError as exc:
                raise exc.with_(table=t.config.name) from None
        return out, keys

    def _conform(
        self, t: TargetTable, rows: pa.Table, ctx: DecodeContext, schema: Schema | None = None
    ) -> pa.Table:
        return conform(
            rows,
            t.schema if schema is None else schema,
            case_insensitive=self.case_insensitive,
            context=ctx,
            name_mapping=t.name_mapping,
        )

    def _changes(
        self, t: TargetTable, rows: pa.Table, ctx: DecodeContext
    ) -> tuple[pa.Table, pa.Table]:
        """A keyed table's upserted rows and the keys of all its changes, in record order."""
        cfg = t.config
        deletes = delete_mask(rows, cfg, ctx)
        ups, dels = row_images(rows, cfg, deletes, ctx)
        data = self._conform(t, renamed(ups, cfg.rename), filter_context(ctx, pa.array(~deletes)))
        keys_only = key_schema(t.schema, cfg.id_columns)
        del_ctx = filter_context(ctx, pa.array(deletes))
        del_keys = self._conform(t, renamed(dels, cfg.rename), del_ctx, keys_only)
        target = key_arrow_schema(t.schema, cfg.id_columns)
        up_keys = data.select([f.name for f in keys_only.fields])
        return data, interleave_keys(up_keys, del_keys, deletes, target)

    def convert_tolerant(self, batch: pa.RecordBatch | pa.Table) -> Conversion:
        """Like :meth:`convert`, but a record that fails is set aside (with its error) and the
        batch's other records are converted.

        The whole batch is tried first, so a clean batch costs exactly one :meth:`convert`.
        Only a failing batch is halved, recursively, until each failing part is one record:
        O(k log n) conversions of shrinking parts for k bad records, whatever the codec's own
        locating. Halving (not "drop the named record and retry") keeps a batch with many bad
        records from costing one full pass per bad record, and never depends on the codec
        naming the right record.
        """
        try:
            return self.convert_batch(batch)
        except RecordConversionError as exc:
            if batch.num_rows <= 1:
                return _last_changes(self.empty(), self.empty_keys(), (Rejected(0, exc),))
        parts: list[tuple[dict[str, pa.Table], dict[str, pa.Table]]] = []
        rejected: list[Rejected] = []
        n = batch.num_rows
        stack = [(n // 2, n), (0, n // 2)]  # popped from the end: rows stay in order
        while stack:
            lo, hi = stack.pop()
            try:
                # a part of several records will be split anyway: no need to name one
                parts.append(self._convert(batch.slice(lo, hi - lo), locate=hi - lo == 1))
            except RecordConversionError as exc:
                if hi - lo == 1:
                    rejected.append(Rejected(lo, exc))
                else:
                    mid = (lo + hi) // 2
                    stack += [(mid, hi), (lo, mid)]
        tables = _concat([p[0] for p in parts], self.empty())
        keys = _concat([p[1] for p in parts], self.empty_keys())
        return _last_changes(tables, keys, tuple(rejected))

    def empty(self) -> dict[str, pa.Table]:
        """table name -> no rows, in the table's Arrow schema."""
        return {t.config.name: schema_to_pyarrow(t.schema).empty_table() for t in self.targets}

    def empty_keys(self) -> dict[str, pa.Table]:
        """keyed table name -> no changes, in the key table's Arrow schema."""
        return {
            t.config.name: key_arrow_schema(t.schema, t.config.id_columns).empty_table()
            for t in self.targets
            if t.config.keyed
        }


def _concat(
    parts: Sequence[Mapping[str, pa.Table]], empty: Mapping[str, pa.Table]
) -> dict[str, pa.Table]:
    """Per table, the rows of all ``parts`` in order."""
    return {
        name: pa.concat_tables([part[name] for part in parts if part[name].num_rows] or [e])
        for name, e in empty.items()
    }


def _last_changes(
    tables: dict[str, pa.Table], keys: dict[str, pa.Table], rejected: tuple[Rejected, ...] = ()
) -> Conversion:
    """The Conversion of converted rows: per keyed table, the last change per key chosen."""
    out = dict(tables)
    final_keys: dict[str, pa.Table] = {}
    for name, changes in keys.items():
        out[name], final_keys[name] = last_per_key(tables[name], changes)
    return Conversion(out, rejected, final_keys)


@dataclass(frozen=True)
class Rejected:
    """A record :meth:`RecordConverter.convert_tolerant` set aside: its row in the input batch
    and why (the error's ``kind`` is decode, route or conform; ``table`` the target, when
    known)."""

    row: int
    error: RecordConversionError


@dataclass(frozen=True)
class Conversion:
    """The rows per table of a batch, and the records that could not be written."""

    tables: dict[str, pa.Table]
    rejected: tuple[Rejected, ...] = ()
    # keyed (upsert/cdc) table -> every key its records touched, once, in the table's key
    # columns (field ids kept); ``tables`` then holds the final row image per key
    keys: dict[str, pa.Table] = dataclass_field(default_factory=dict)
