"""JSON records (one object per Kafka value), parsed a whole batch at a time.

The batch's values are joined with newlines and parsed once by Arrow's JSON reader with an
explicit schema, so no per-record Python object is made. Only when that parse fails does the
codec look for the offending record (binary search over prefixes) to name it.

Options (``source.format_options``): none are required.

* ``unknown_fields``: ``"ignore"`` (default: fields the schema does not name are not decoded)
  or ``"infer"`` (decode them with inferred types; also chosen automatically when the caller
  matches names case-insensitively).

A null value decodes to a row of nulls (the converter drops tombstones before decoding).

A field whose JSON type differs from the declared one (``"42"`` for an int column, epoch
numbers for a timestamp) is decoded with its inferred type and cast by the converter; but
within one batch a field must keep one JSON type: mixing text and numbers is an error naming
the first record that differs.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from icefloe.errors import ConfigError, record_error
from icefloe.hookspecs import (
    CASE_INSENSITIVE_KEY,
    INFER_ALL_KEY,
    DecodeContext,
    failing_prefix_end,
)

_COLUMN = re.compile(r"Column\(/([^)/]*)")
_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)


def parse_type(t: pa.DataType) -> pa.DataType | None:
    """The type Arrow's JSON reader can produce for ``t`` (nullable all the way down), or None
    when it has none (maps: then the field is inferred and converted later)."""
    if pa.types.is_struct(t):
        kids = [(f.name, parse_type(f.type)) for f in t]
        return pa.struct([pa.field(n, k) for n, k in kids if k is not None])
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = parse_type(t.value_type)
        return None if inner is None else pa.list_(inner)
    if pa.types.is_map(t):
        return None
    if (
        pa.types.is_timestamp(t)  # zone handling (naive = UTC) is the converter's
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_fixed_size_binary(t)
        or isinstance(t, pa.BaseExtensionType)
    ):
        return pa.string()  # parsed from text by the converter
    if pa.types.is_decimal(t) and not isinstance(t, pa.Decimal128Type):
        return pa.string()
    return t


def _has_map(t: pa.DataType) -> bool:
    if pa.types.is_map(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_map(f.type) for f in t)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_map(t.value_type)
    return False


class JsonCodec:
    """``format = "json"``."""

    def __init__(self, options: dict[str, Any]) -> None:
        opts = dict(options)
        self.unknown_fields = opts.pop("unknown_fields", "ignore")
        if self.unknown_fields not in ("ignore", "infer"):
            raise ConfigError(
                "source.format_options.unknown_fields",
                "must be 'ignore' or 'infer'",
                'set unknown_fields = "ignore" or "infer"',
                self.unknown_fields,
            )
        if opts:
            raise ConfigError(
                f"source.format_options.{sorted(opts)[0]}",
                "is not an option of the json format",
                "remove it (json knows: unknown_fields, tombstones, case_insensitive)",
            )

    def decode(self, values: pa.Array, schema: pa.Schema, context: DecodeContext) -> pa.Table:
        fields = [(f.name, parse_type(f.type)) for f in schema]
        explicit = pa.schema([pa.field(n, t) for n, t in fields if t is not None])
        infer = (
            self.unknown_fields == "infer"
            or (schema.metadata or {}).get(CASE_INSENSITIVE_KEY) == b"true"
            or (schema.metadata or {}).get(INFER_ALL_KEY) == b"true"
            or any(t is None or _has_map(f.type) for f, (_, t) in zip(schema, fields, strict=True))
        )
        if len(values) == 0:
            return explicit.empty_table()
        if pa.types.is_string(values.type):
            values = values.cast(pa.binary())
        elif pa.types.is_large_string(values.type):
            values = values.cast(pa.large_binary())
        values = pc.fill_null(values, pa.scalar(b"{}", values.type))
        declared = explicit
        # a field whose values do not have its declared JSON type is retried with an inferred
        # type (the converter may still cast it, e.g. "42" into an int column)
        for _ in range(len(explicit) + 1):
            try:
                return _parse(values, explicit, infer)
            except _ERRORS as exc:
                name = _failed_column(exc)
                if name is None or explicit.get_field_index(name) < 0:
                    if not context.locate:
                        raise record_error(
                            context, 0, None, f"a value is not valid: {exc}"
                        ) from None
                    raise _locate(values, explicit, declared, infer, context, exc) from None
                explicit = explicit.remove(explicit.get_field_index(name))
                infer = True
        raise AssertionError("unreachable: each retry removes a field")


def _failed_column(exc: Exception) -> str | None:
    m = _COLUMN.search(str(exc))
    return str(m.group(1)) if m and "changed from" in str(exc) else None


def _parse(values: pa.Array, explicit: pa.Schema, infer: bool) -> pa.Table:
    """One ``read_json`` over the newline-joined values; row count checked against input.

    Arrow splits its blocks at line breaks unless told values may contain them, and telling
    it costs a slower chunker; finding out costs a scan of every byte (two substring searches,
    40% of the decode of one-line values). So the values are parsed as one-line first: a value
    with line breaks inside can then only make that parse fail (a block cut inside an object
    leaves both halves invalid) or miscount rows, never parse wrongly, and only then are they
    scanned and, if they do contain line breaks, parsed again as such."""
    try:
        return _parse_once(values, explicit, infer, multiline=False)
    except _ERRORS:
        if not any(bool(pc.any(pc.match_substring(values, b)).as_py()) for b in ("\n", "\r")):
            raise
    return _parse_once(values, explicit, infer, multiline=True)


def _parse_once(values: pa.Array, explicit: pa.Schema, infer: bool, multiline: bool) -> pa.Table:
    n = len(values)
    one_list = pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), values)
    joined = pc.binary_join(one_list, pa.scalar(b"\n", values.type))
    buf = joined[0].as_buffer()
    longest = pc.max(pc.binary_length(values)).as_py() or 0
    block = max(1 << 20, 2 * longest + 2)
    table = pj.read_json(
        pa.BufferReader(buf),
        # threads only pay off with several blocks; small parts (a bad batch being split, see
        # RecordConverter.convert_tolerant) spent most of their time starting them
        read_options=pj.ReadOptions(block_size=block, use_threads=buf.size > block),
        parse_options=pj.ParseOptions(
            explicit_schema=explicit,
            unexpected_field_behavior="infer" if infer else "ignore",
            newlines_in_values=multiline,
        ),
    )
    if table.num_rows != n:
        raise pa.ArrowInvalid(f"expected one JSON object per value, got {table.num_rows} for {n}")
    return table


def _locate(
    values: pa.Array,
    explicit: pa.Schema,
    declared: pa.Schema,
    infer: bool,
    context: DecodeContext,
    exc: Exception,
) -> Exception:
    """The RecordConversionError naming the value that cannot be parsed.

    The first failing prefix ends at a record that either fails on its own (malformed: blame
    it) or only conflicts with earlier ones: a field whose JSON type changes, as in
    ``"id": "abc"`` first and numbers after. The record at fault is then the first whose field
    does not parse as the declared type, which may come before; blaming the prefix's end named
    the next, good record.
    """
    row = failing_prefix_end(values, lambda v: _parse(v, explicit, infer))
    problem = str(exc)
    try:
        _parse(values.slice(0, row + 1), explicit, infer)
    except _ERRORS as conflict:
        problem = str(conflict)
    try:
        _parse(values.slice(row, 1), explicit, infer)
    except _ERRORS as own:
        problem = str(own)
    else:
        name = _failed_column_any(problem)
        if name is not None and declared.get_field_index(name) >= 0:
            one = pa.schema([declared.field(name)])
            suspects = values.slice(0, row + 1)
            first = failing_prefix_end(suspects, lambda v: _parse(v, one, False))
            try:
                _parse(suspects.slice(first, 1), one, False)
            except _ERRORS as own:
                row, problem = first, str(own)
    field = _failed_column_any(problem) or _field_of(values.slice(row, 1), explicit)
    return record_error(context, row, field, f"not a JSON record of the expected shape: {problem}")


def _failed_column_any(problem: str) -> str | None:
    m = _COLUMN.search(problem)
    return str(m.group(1)) if m and m.group(1) else None


def _field_of(value: pa.Array, explicit: pa.Schema) -> str | None:
    """Which declared field makes this single record fail (each tried alone)."""
    try:
        _parse(value, pa.schema([]), False)
    except _ERRORS:
        return None  # not even an object: no field to blame
    for f in explicit:
        try:
            _parse(value, pa.schema([f]), False)
        except _ERRORS:
            return str(f.name)
    return None
