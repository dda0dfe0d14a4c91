"""The record converter: a batch of raw records in Spark's Kafka layout -> the rows of each
target table, in that table's exact schema.

It decodes once with the source's codec (into a hint schema that covers every table), routes
rows to tables (:mod:`icefloe.records.routing`), turns keyed tables' records into row images
and keys (:mod:`icefloe.records.changes`) and conforms each table's rows
(:mod:`icefloe.records.conform`). A record that cannot be decoded, routed or conformed fails
the batch, or, for the ``[errors]`` policies that go on, is set aside with its error
(:meth:`RecordConverter.convert_tolerant`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import NameMapping
from pyiceberg.types import IcebergType, ListType, NestedField, StructType

from icefloe.errors import (
    ConfigError,
    RecordConversionError,
    RecordRouteError,
    record_error,
)
from icefloe.hookspecs import CASE_INSENSITIVE_KEY, INFER_ALL_KEY, DecodeContext, RecordCodec
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
from icefloe.records.conform import (
    ConformTarget,
    conform,
    conform_target,
    names_of,
    table_target,
)

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from icefloe.config import SourceConfig, TableConfig
    from icefloe.plugins.manager import Plugins


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
        out += [pa.field(n, t) for n in names_of(field, names)]
    return out


@dataclass(frozen=True)
class TargetTable:
    """One table records are converted for: its config (routing), schema and name mapping."""

    config: TableConfig
    schema: Schema
    name_mapping: NameMapping | None = None
    known: ConformTarget | None = dataclass_field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, config: TableConfig, table: Table) -> TargetTable:
        """The table as it is now; what conforming to it needs is derived once per table
        version (:func:`icefloe.records.conform.table_target`), not per task."""
        target = table_target(table)
        return cls(config, table.schema(), target.name_mapping, target)

    @cached_property
    def target(self) -> ConformTarget:
        """The schema in Arrow and every name of each field."""
        return self.known or conform_target(self.schema, self.name_mapping)


def decode_hint(
    targets: Sequence[TargetTable], case_insensitive: bool = False, extra: Sequence[str] = ()
) -> pa.Schema:
    """The schema a codec decodes into for all ``targets`` at once: every field (and alias)
    of every table, first table's type winning on a clash, plus ``extra`` string columns (route
    fields). Conversion to each table's exact schema is :func:`conform`'s job."""
    fields: dict[str, pa.Field] = {}
    for t in targets:
        hinted = _hint_fields(t.schema.fields, list(t.target.arrow), t.target.names)
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


def _each(context: DecodeContext, fn: Callable[[pa.Array], pa.Array]) -> DecodeContext:
    """``context`` with ``fn`` applied to each of its columns."""
    return DecodeContext(
        topics=fn(context.topics),
        partitions=fn(context.partitions),
        offsets=fn(context.offsets),
        locate=context.locate,
    )


def filter_context(context: DecodeContext, mask: pa.Array) -> DecodeContext:
    return _each(context, lambda a: a.filter(mask))


def take_context(context: DecodeContext, indices: pa.Array) -> DecodeContext:
    return _each(context, lambda a: a.take(indices))


def slice_context(context: DecodeContext, start: int, n: int) -> DecodeContext:
    return _each(context, lambda a: a.slice(start, n))


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
                row = int(pc.index(values.is_null(), True).as_py())
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

    def decode_parts(
        self, batch: pa.RecordBatch | pa.Table, fields: Sequence[str] = ()
    ) -> list[pa.Table]:
        """Every decodable record of ``batch``, each field with the type its values have (not
        the tables'), in parts: a batch with undecodable records is halved around them, as
        :meth:`convert_tolerant` does, and they are left out (conversion reports them).
        ``fields``: only these are needed (as strings), so a codec may skip the others."""
        hint = (
            decode_hint([], self.case_insensitive, fields)
            if fields
            else pa.schema([], metadata={INFER_ALL_KEY: b"true"})
        )
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
        decoded, context = self.decode(batch, locate)
        out: dict[str, pa.Table] = {}
        keys: dict[str, pa.Table] = {}
        for t, (rows, ctx) in zip(self.targets, self._route(decoded, context), strict=True):
            try:
                if t.config.keyed:
                    out[t.config.name], keys[t.config.name] = self._changes(t, rows, ctx)
                else:
                    out[t.config.name] = self._conform(t, renamed(rows, t.config.rename), ctx)
            except RecordConversionError as exc:
                raise exc.with_(table=t.config.name) from None
        return out, keys

    def _route(
        self, decoded: pa.Table, context: DecodeContext
    ) -> list[tuple[pa.Table, DecodeContext]]:
        """Each target's rows and their context, in target order; RecordRouteError for the
        first record no table takes. A fan-out by exact values (dynamic tables) is grouped
        in one pass (:func:`~icefloe.records.routing.route_groups`), other routes by a mask
        per table."""
        from icefloe.records.routing import (
            route_groups,
            route_masks,
            unrouted_at,
            unrouted_problem,
        )

        configs = [t.config for t in self.targets]
        ci = self.case_insensitive
        groups = route_groups(decoded, configs, ci)
        if groups is not None:
            unrouted = (
                None if groups.unrouted < 0 else unrouted_at(decoded, configs, groups.unrouted, ci)
            )
        else:
            masks = route_masks(decoded, configs, ci)
            unrouted = unrouted_problem(decoded, masks, configs, ci)
        if unrouted is not None:
            problem = f"{unrouted[1]}{self.route_note}"
            raise record_error(context, unrouted[0], None, problem, RecordRouteError)
        if groups is None:
            return [
                (decoded, context) if m is None else (decoded.filter(m), filter_context(context, m))
                for m in (masks[c.name] for c in configs)
            ]
        rows, ctx = decoded.take(groups.order), take_context(context, groups.order)
        return [
            (rows.slice(start, n), slice_context(ctx, start, n))
            for start, n in (groups.spans[c.name] for c in configs)
        ]

    def _conform(
        self, t: TargetTable, rows: pa.Table, ctx: DecodeContext, schema: Schema | None = None
    ) -> pa.Table:
        return conform(
            rows,
            t.schema if schema is None else schema,
            case_insensitive=self.case_insensitive,
            context=ctx,
            name_mapping=t.name_mapping,
            target=t.target if schema is None else None,
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
