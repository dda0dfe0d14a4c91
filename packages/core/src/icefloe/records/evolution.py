"""Table schemas from records: inference for auto-created tables, and schema evolution.

Why here and not in pyiceberg: pyiceberg converts a *declared* Arrow schema to an Iceberg one
and merges schemas (``UpdateSchema.union_by_name``), but it has no notion of what a batch of
decoded records implies (which fields carry values, which are null where their parent is not)
and its union refuses, rather than skips, a change Iceberg does not allow. The walk below
decides *what* to change; pyiceberg applies it: the Arrow schema :func:`infer_schema` returns
goes to ``create_table`` as is, and the partial schema of :func:`plan_evolution` goes to
``union_by_name``, which assigns field ids, adds columns, promotes types, makes columns
optional and keeps the table's ``schema.name-mapping.default`` in step.

Rules (docs/schema.md): records add optional columns (nested too); int -> long and
float -> double widen; a required column becomes optional when records leave it null or
omit it (identifier fields excepted). Anything else (a string into a long column, an object
where a column is a number) changes nothing: those records fail conversion and go to the
``[errors]`` policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException, ValidationError
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.name_mapping import NameMapping
from pyiceberg.types import (
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StructType,
)

from icefloe.records.conform import mapped_names

log = logging.getLogger("icefloe.evolution")

# Field metadata of an inferred long/double whose values all fit an int/float: such records
# need no widening of an int/float column (JSON has one number type, so every JSON integer is
# inferred as long and every fraction as double).
FITS_NARROW = b"icefloe.fits-narrow"

TIMESTAMP = pa.timestamp("us", "UTC")
"""What an inferred ISO-8601 field becomes (Iceberg ``timestamptz``); text without a zone is
taken as UTC when converted."""


# --------------------------------------------------------------------------- inference


def _valid(arr: pa.Array, parent_valid: pa.Array | None) -> pa.Array:
    valid = arr.is_valid()
    return valid if parent_valid is None else pc.and_(valid, parent_valid)


def _has_nulls(arr: pa.Array, parent_valid: pa.Array | None) -> bool:
    if arr.null_count == 0:
        return False
    if parent_valid is None:
        return True
    return bool(pc.any(pc.and_(arr.is_null(), parent_valid)).as_py())


def _infer(
    arr: pa.Array, parent_valid: pa.Array | None, widen: bool, timestamps: bool
) -> pa.DataType | None:
    """The column type ``arr``'s values call for, or None when they carry no type (all null,
    empty objects, empty lists)."""
    t = arr.type
    if isinstance(arr, pa.DictionaryArray):
        return _infer(arr.dictionary_decode(), parent_valid, widen, timestamps)
    if pa.types.is_null(t) or len(arr) == arr.null_count:
        return None
    if pa.types.is_struct(t):
        valid = _valid(arr, parent_valid)
        kids = []
        for i, child in enumerate(arr.flatten()):
            kt = _infer(child, valid, widen, timestamps)
            if kt is not None:
                kids.append(_field(t.field(i).name, kt, child, valid))
        return pa.struct(kids) if kids else None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = _infer(arr.flatten(), None, widen, timestamps)
        return None if inner is None else pa.list_(inner)
    if pa.types.is_map(t):
        return t
    if pa.types.is_integer(t):
        return pa.int64() if widen or t.bit_width == 64 else pa.int32()
    if pa.types.is_floating(t):
        return pa.float64() if widen or t.bit_width == 64 else pa.float32()
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_timestamp(t):
        if widen:  # a JSON reader's guess from text: a timestamp only when asked for
            return TIMESTAMP if timestamps else pa.string()
        return pa.timestamp("us", t.tz)
    return t


def _fits_narrow(arr: pa.Array) -> bool:
    """Whether every value of a long/double array fits an int/float exactly."""
    narrow = pa.int32() if pa.types.is_integer(arr.type) else pa.float32()
    try:
        back = pc.cast(pc.cast(arr, narrow, safe=True), arr.type)
    except (pa.ArrowInvalid, OverflowError):
        return False
    if pa.types.is_floating(arr.type):  # float32 casts round silently: compare
        return bool(pc.all(pc.equal(back, arr)).as_py() in (True, None))
    return True


def _field(name: str, t: pa.DataType, arr: pa.Array, parent_valid: pa.Array | None) -> pa.Field:
    meta = None
    if (pa.types.is_integer(t) or pa.types.is_floating(t)) and _fits_narrow(arr):
        meta = {FITS_NARROW: b"true"}
    return pa.field(name, t, nullable=_has_nulls(arr, parent_valid), metadata=meta)


def infer_fields(
    records: pa.Table, *, widen: bool = True, timestamps: bool = False
) -> list[pa.Field]:
    """One field per column of ``records`` that carries values; nullable unless every record
    has a value. ``widen``: integers become long and floats double (types a JSON reader
    guessed; False keeps a declared schema's own widths). ``timestamps``: text a JSON reader
    recognised as ISO-8601 timestamps becomes ``timestamptz``, else it stays a string."""
    out = []
    for name, col in zip(records.column_names, records.columns, strict=True):
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        t = _infer(arr, None, widen, timestamps)
        if t is not None:
            out.append(_field(name, t, arr, None))
    return out


def infer_schema(
    parts: Sequence[pa.Table], *, widen: bool = True, timestamps: bool = False
) -> pa.Schema:
    """The schema of a new table for the decoded ``parts`` (a batch, possibly decoded in
    several pieces): their fields unified (int and double give double, struct fields merge),
    all optional; the caller makes identifier fields required."""
    schemas = [
        pa.schema([_optional(f) for f in infer_fields(p, widen=widen, timestamps=timestamps)])
        for p in parts
    ]
    if not schemas:
        return pa.schema([])
    return pa.unify_schemas(schemas, promote_options="permissive")


def _optional(f: pa.Field) -> pa.Field:
    """``f`` nullable all the way down (a created table's columns are optional, as Kafka
    Connect's are: a later record may omit any of them)."""
    t = f.type
    if pa.types.is_struct(t):
        t = pa.struct([_optional(k) for k in t])
    elif pa.types.is_list(t):
        t = pa.list_(_optional(t.value_field))
    return f.with_type(t).with_nullable(True)


# --------------------------------------------------------------------------- evolution


@dataclass
class Evolution:
    """What records call for in a table's schema: ``delta`` is a partial schema (only the
    fields that change, and the structs leading to them) for ``union_by_name``; ``changes``
    and ``conflicts`` say what in words, for logs and errors."""

    delta: list[pa.Field] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.delta)


@dataclass(frozen=True)
class _Walk:
    names: Mapping[int, tuple[str, ...]]
    case_insensitive: bool
    identifiers: frozenset[int]

    def find(self, fields: Sequence[NestedField], name: str) -> NestedField | None:
        """The table field a record field ``name`` fills: by name, alias, or (when asked)
        letter case."""
        for f in fields:
            if name == f.name or name in self.names.get(f.field_id, ()):
                return f
        if self.case_insensitive:
            folded = name.casefold()
            for f in fields:
                if folded in {n.casefold() for n in (f.name, *self.names.get(f.field_id, ()))}:
                    return f
        return None


def _widened(ice: IcebergType, rf: pa.Field) -> pa.DataType | None:
    """The wider type a column takes for the values of ``rf`` (int -> long, float -> double),
    or None when they fit it as it is."""
    if (rf.metadata or {}).get(FITS_NARROW) == b"true":
        return None
    records = rf.type
    if isinstance(ice, IntegerType) and pa.types.is_integer(records) and records.bit_width == 64:
        return pa.int64()
    if isinstance(ice, FloatType) and pa.types.is_floating(records) and records.bit_width == 64:
        return pa.float64()
    return None


def _fits_kind(ice: IcebergType, records: pa.DataType) -> bool:
    if isinstance(ice, StructType):
        return bool(pa.types.is_struct(records))
    if isinstance(ice, ListType):
        return bool(pa.types.is_list(records))
    return not (pa.types.is_struct(records) or pa.types.is_list(records))


def _struct_delta(
    walk: _Walk,
    fields: Sequence[NestedField],
    records: Sequence[pa.Field],
    path: str,
    ev: Evolution,
) -> list[pa.Field]:
    out: list[pa.Field] = []
    seen: set[int] = set()
    for rf in records:
        f = walk.find(fields, rf.name)
        if f is None:
            ev.changes.append(f"add optional column {path}{rf.name} {rf.type}")
            out.append(_optional(rf))  # nested fields too: rows without the struct hold nulls
            continue
        seen.add(f.field_id)
        d = _field_delta(walk, f, rf, path, ev)
        if d is not None:
            out.append(d)
    for f in fields:  # required columns the records omit
        if f.field_id not in seen and f.required and f.field_id not in walk.identifiers:
            ev.changes.append(f"make {path}{f.name} optional (records omit it)")
            out.append(pa.field(f.name, _shell(f.field_type), nullable=True))
    return out


def _shell(ice: IcebergType) -> pa.DataType:
    """A partial-schema stand-in for an unchanged column: a struct without fields (the union
    adds nothing to it), a primitive or list as it is."""
    if isinstance(ice, StructType):
        return pa.struct([])
    return schema_to_pyarrow(ice)


def _field_delta(
    walk: _Walk, f: NestedField, rf: pa.Field, path: str, ev: Evolution
) -> pa.Field | None:
    where = f"{path}{f.name}"
    optional = f.required and rf.nullable and f.field_id not in walk.identifiers
    if optional:
        ev.changes.append(f"make {where} optional (records leave it null)")
    nullable = optional or not f.required
    ice = f.field_type
    if not _fits_kind(ice, rf.type):
        ev.conflicts.append(f"{where}: column is {ice}, records have {rf.type}")
        return pa.field(f.name, _shell(ice), nullable=True) if optional else None
    if isinstance(ice, StructType):
        kids = _struct_delta(walk, ice.fields, list(rf.type), where + ".", ev)
        if kids or optional:
            return pa.field(f.name, pa.struct(kids), nullable=nullable)
        return None
    if isinstance(ice, ListType):
        element = ice.element_field
        if isinstance(element.field_type, StructType) and pa.types.is_struct(rf.type.value_type):
            kids = _struct_delta(
                walk, element.field_type.fields, list(rf.type.value_type), where + ".element.", ev
            )
            if kids:
                item = pa.field("element", pa.struct(kids), nullable=not element.required)
                return pa.field(f.name, pa.list_(item), nullable=nullable)
        return pa.field(f.name, _shell(ice), nullable=True) if optional else None
    wide = _widened(ice, rf)
    if wide is not None:
        ev.changes.append(
            f"widen {where} from {ice} to {'long' if wide == pa.int64() else 'double'}"
        )
        return pa.field(f.name, wide, nullable=nullable)
    if isinstance(ice, (LongType, DoubleType, IntegerType, FloatType)) and (
        pa.types.is_string(rf.type) or pa.types.is_boolean(rf.type)
    ):
        ev.conflicts.append(f"{where}: column is {ice}, records have {rf.type}")
    return pa.field(f.name, _shell(ice), nullable=True) if optional else None


def plan_evolution(
    schema: Schema,
    records: Sequence[pa.Field],
    *,
    name_mapping: NameMapping | None = None,
    case_insensitive: bool = False,
) -> Evolution:
    """What ``records`` (from :func:`infer_fields`, in the table's column names) need of
    ``schema``; columns matched by name, then ``name_mapping`` aliases, then (when asked) in
    any letter case. Pure: nothing is changed."""
    mapping = name_mapping if name_mapping is not None else schema.name_mapping
    walk = _Walk(
        mapped_names(mapping),
        case_insensitive,
        frozenset(schema.identifier_field_ids),
    )
    ev = Evolution()
    ev.delta = _struct_delta(walk, schema.fields, records, "", ev)
    return ev


def evolve_table(
    table: Table,
    plan: Callable[[Table], Evolution],
    *,
    attempts: int = 10,
) -> Table:
    """Apply ``plan(table)`` with ``union_by_name``, re-planning on the refreshed table after a
    concurrent schema change (another writer's, maybe the very same one), until nothing is
    left to do. Returns the table as it now is.

    Idempotent: a change already made plans to nothing, so writers racing to add one column
    add it once, and a replayed batch changes nothing. A change pyiceberg refuses is logged
    and skipped: the records that needed it then fail conversion and meet the error policy.
    """
    for _ in range(attempts):
        ev = plan(table)
        if not ev:
            return table
        try:
            with table.update_schema() as update:
                update.union_by_name(pa.schema(ev.delta))
        except CommitFailedException:
            table.refresh()
            continue
        except (ValidationError, ValueError) as exc:
            log.warning(
                "table %s: schema change refused, records that need it go to the error "
                "policy: %s (%s)",
                ".".join(table.name()),
                "; ".join(ev.changes),
                exc,
            )
            return table
        log.info("table %s: schema evolved: %s", ".".join(table.name()), "; ".join(ev.changes))
        table.refresh()
    raise CommitFailedException(
        f"table {'.'.join(table.name())}: schema change kept conflicting after {attempts} tries"
    )
