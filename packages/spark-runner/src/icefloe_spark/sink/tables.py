"""Target tables: before the query starts, check they exist or create those marked
``auto_create`` from the record schema the source format declares; per write task, create the
tables a batch needs and evolve their schemas (:class:`TableResolver`).

A format whose codec knows its records' schema up front (``arrow_schema``: the built-in
``avro`` codec, from its writer schema) creates its tables at start. JSON carries no schema:
its ``auto_create`` tables, and tables named by ``[dynamic_tables]``, are created by the first
write task that has records for them, from the schema inferred from those records.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import IdentityTransform, Transform, parse_transform
from pyiceberg.types import (
    BinaryType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    TimestamptzType,
)

from icefloe.commit.versions import KnownVersions
from icefloe.config import PipelineConfig, TableConfig
from icefloe.errors import ConfigError, KeyedTableError
from icefloe.ops.maintenance import recommended_properties
from icefloe.plugins.manager import Plugins, get_plugins
from icefloe.records.changes import row_schema, schema_rows
from icefloe.records.converter import RecordConverter, TargetTable, renamed
from icefloe.records.evolution import evolve_table, infer_fields, infer_schema, plan_evolution
from icefloe.records.routing import dynamic_values, route_masks

log = logging.getLogger("icefloe_spark.tables")

DEAD_LETTER_SCHEMA = Schema(
    NestedField(1, "pipeline", StringType(), required=True, doc="the pipeline (group id)"),
    NestedField(2, "topic", StringType(), required=True, doc="source topic"),
    NestedField(3, "partition", IntegerType(), required=True, doc="source partition"),
    NestedField(4, "offset", LongType(), required=True, doc="source offset"),
    NestedField(5, "timestamp", TimestamptzType(), required=False, doc="the record's timestamp"),
    NestedField(6, "key", BinaryType(), required=False, doc="the record's key, as read"),
    NestedField(7, "value", BinaryType(), required=False, doc="the record's value, as read"),
    NestedField(8, "target_table", StringType(), required=False, doc="when known"),
    NestedField(9, "error_type", StringType(), required=True, doc="decode, route or conform"),
    NestedField(10, "error_message", StringType(), required=True),
    NestedField(11, "failed_at", TimestamptzType(), required=True, doc="when it was set aside"),
)
"""The fixed schema of an ``[errors] dead_letter_table``: one row per bad record, with the
raw bytes, so it can be inspected, fixed and replayed."""

FORMAT_VERSION = "format-version"
# table versions a worker's resolver keeps (a version is the parsed metadata: bounded, as the
# committer's are)
_KNOWN_TABLES = 4096

_PARTITION = re.compile(r"^\s*(\w+)\s*\(\s*(?:(\d+)\s*,\s*)?([\w.]+)\s*\)\s*$")
_WITH_ARG = ("bucket", "truncate")
_NO_ARG = ("identity", "year", "month", "day", "hour", "void")


def parse_partition(entry: str) -> tuple[str, Transform[object, object]]:
    """``"region"``, ``"day(ts)"``, ``"bucket(16, id)"`` -> (source column, transform)."""
    m = _PARTITION.match(entry)
    if m is None:
        if re.fullmatch(r"[\w.]+", entry.strip()):
            return entry.strip(), IdentityTransform()
        raise ConfigError(
            "tables.partition_by",
            f"'{entry}' is not a column or transform(column)",
            'write e.g. "region", "day(ts)", "bucket(16, id)", "truncate(4, name)"',
        )
    name, arg, column = m.group(1).lower(), m.group(2), m.group(3)
    if name in _WITH_ARG and arg is not None:
        return column, parse_transform(f"{name}[{arg}]")
    if name in _NO_ARG and arg is None:
        return column, parse_transform(name)
    raise ConfigError(
        "tables.partition_by",
        f"'{entry}' is not a known transform",
        "use identity, year, month, day, hour, bucket(N, col) or truncate(W, col)",
    )


def record_schema(config: PipelineConfig, plugins: Plugins | None = None) -> pa.Schema | None:
    """The Arrow schema the source format declares for its records, or None."""
    options = dict(config.source.format_options)
    for key in ("tombstones", "case_insensitive"):  # the converter's, not the codec's
        options.pop(key, None)
    codec = (plugins or get_plugins()).codec(config.source.format).factory(options)
    schema = getattr(codec, "arrow_schema", None)
    return schema if isinstance(schema, pa.Schema) else None


def create_table(catalog: Catalog, table: TableConfig, schema: pa.Schema) -> None:
    """Create ``table`` with its partition spec, identifier fields and properties (icefloe's
    bounded-metadata recommendations, then ``tables.properties``) in one transaction.

    Raises TableAlreadyExistsError when the table exists, also when another task or driver
    created it between this one's staging and its commit: catalogs answer that commit's failed
    ``assert-create`` with CommitFailedException (a 409 through REST), and callers take
    TableAlreadyExistsError for "another was quicker"."""
    # identifier fields must be required, and so must the structs holding nested ones
    fields = list(schema)
    for column in table.id_columns:
        path = _field_path(schema, column)
        if path is None:
            raise ConfigError(
                "tables.id_columns",
                f"{column!r} is not a field of the records",
                "fix the name (a field nested in a struct as 'struct.field')",
            )
        fields[path[0]] = _required(fields[path[0]], path[1:])
    namespace = table.name.rsplit(".", 1)[0]
    catalog.create_namespace_if_not_exists(namespace)
    properties = recommended_properties(table.properties)
    if table.keyed:  # deletes (what upserts become) need format version 2
        if properties.get(FORMAT_VERSION, "2") == "1":
            raise KeyedTableError(
                f"tables.properties.{FORMAT_VERSION}",
                f'mode "{table.mode}" writes deletes, which format version 1 has not',
                f'remove the property or set "{FORMAT_VERSION}" = "2"',
                "1",
            )
        properties[FORMAT_VERSION] = "2"
    txn = catalog.create_table_transaction(
        table.name, schema=pa.schema(fields), properties=properties
    )
    if table.partition_by:
        with txn.update_spec() as spec:
            for entry in table.partition_by:
                column, transform = parse_partition(entry)
                spec.add_field(column, transform)
    if table.id_columns:
        with txn.update_schema() as update:
            update.set_identifier_fields(*table.id_columns)
    try:
        txn.commit_transaction()
    except CommitFailedException as exc:
        if not catalog.table_exists(table.name):
            raise
        raise TableAlreadyExistsError(f"table '{table.name}' was created meanwhile") from exc


def _field_path(schema: pa.Schema, column: str) -> list[int] | None:
    """Indices from the top-level field down to ``column`` (a top-level name, else a dotted
    path through structs), or None."""
    index = schema.get_field_index(column)
    if index >= 0:
        return [index]
    head, dot, rest = column.partition(".")
    index = schema.get_field_index(head)
    if not dot or index < 0 or not pa.types.is_struct(schema.field(index).type):
        return None
    struct = schema.field(index).type
    inner = _field_path(pa.schema(list(struct)), rest)
    return None if inner is None else [index, *inner]


def _required(field: pa.Field, path: list[int]) -> pa.Field:
    """``field`` made required, and along ``path`` (child indices) each child too."""
    if path:
        children = list(field.type)
        children[path[0]] = _required(children[path[0]], path[1:])
        field = field.with_type(pa.struct(children))
    return field.with_nullable(False)


def check_keyed_table(table: Table, config: TableConfig) -> None:
    """KeyedTableError unless an upsert/CDC ``table`` can be written by key: format version 2
    (delete files) and identifier fields exactly the configured ``id_columns`` (the key files
    and the coordinator's resolution of them use the table's identifier field ids)."""
    if not config.keyed:
        return
    name = config.name
    if table.format_version < 2:
        raise KeyedTableError(
            "tables.mode",
            f"table '{name}' is format version {table.format_version}; mode "
            f'"{config.mode}" writes deletes, which need format version 2',
            "upgrade the table (pyiceberg: with table.transaction() as t: "
            "t.upgrade_table_version(2); Spark: ALTER TABLE ... SET TBLPROPERTIES "
            "('format-version'='2'))",
            table.format_version,
        )
    schema = table.schema()
    missing = [c for c in config.id_columns if c not in schema.column_names]
    if missing:
        raise KeyedTableError(
            "tables.id_columns",
            f"table '{name}' has no column(s) {missing}",
            "list columns of the table in id_columns",
            config.id_columns,
        )
    have = sorted(schema.identifier_field_names())
    if have != sorted(config.id_columns):
        columns = ", ".join(config.id_columns)
        raise KeyedTableError(
            "tables.id_columns",
            f"table '{name}' has identifier fields {have}, not the configured id_columns",
            f"make them the table's identifier fields (pyiceberg: with table.update_schema() as "
            f"u: u.set_identifier_fields({', '.join(repr(c) for c in config.id_columns)}); "
            f"Spark: ALTER TABLE {name} SET IDENTIFIER FIELDS {columns}), or set id_columns "
            "to the table's identifier fields",
            config.id_columns,
        )


def ensure_tables(
    catalog: Catalog, config: PipelineConfig, plugins: Plugins | None = None
) -> list[str]:
    """Fail on a missing table unless it is ``auto_create``; create those the format declares
    a record schema for (the rest are created by write tasks). Returns the names of the
    tables created."""
    created: list[str] = []
    schema: pa.Schema | None = None
    for t in config.tables:
        try:
            check_keyed_table(catalog.load_table(t.name), t)
            continue
        except NoSuchTableError:
            if not t.auto_create:
                raise ConfigError(
                    "tables.name",
                    f"table '{t.name}' does not exist",
                    "create it first, or set auto_create = true (created from the record "
                    "schema the format declares, else from the first records)",
                ) from None
        schema = schema if schema is not None else record_schema(config, plugins)
        if schema is None:
            # created by the first write task with records for it, from their inferred schema
            log.info("table %s will be created from the first records for it", t.name)
            continue
        try:
            create_table(catalog, t, row_schema(schema, t))
        except TableAlreadyExistsError:  # another driver of the pipeline was quicker
            continue
        log.info("created table %s", t.name)
        created.append(t.name)
    if ensure_dead_letter_table(catalog, config):
        created.append(str(config.errors.dead_letter_table))
    return created


def ensure_dead_letter_table(catalog: Catalog, config: PipelineConfig) -> bool:
    """Create the ``dead_letter`` policy's table when missing (True when created). An existing
    table must have :data:`DEAD_LETTER_SCHEMA`'s columns, or bad records could not be kept."""
    name = config.errors.dead_letter_table
    if config.errors.policy != "dead_letter" or name is None:
        return False
    try:
        existing = catalog.load_table(name).schema()
    except NoSuchTableError:
        catalog.create_namespace_if_not_exists(name.rsplit(".", 1)[0])
        try:
            catalog.create_table(name, schema=DEAD_LETTER_SCHEMA)
        except TableAlreadyExistsError:  # another driver of the pipeline was quicker
            return False
        log.info("created dead-letter table %s", name)
        return True
    missing = [f.name for f in DEAD_LETTER_SCHEMA.fields if f.name not in existing.column_names]
    if missing:
        raise ConfigError(
            "errors.dead_letter_table",
            f"table '{name}' exists but lacks the dead-letter columns {missing}",
            "name a new table (it is created) or one created by icefloe",
            name,
        )
    return False


class TableResolver:
    """What one write task writes into: the tables, created and evolved as its batch needs,
    and the converter for them.

    Why in the writer, before any file is written: a data file names its columns by field
    id, so the ids of new columns must exist (committed to the catalog) before a file uses
    them; the coordinator's later commit then adds files whose schema the table already has.
    Changes are additive and idempotent (see :func:`icefloe.records.evolution.evolve_table`), so
    concurrent tasks and replayed batches agree (docs/architecture.md, "Schema changes").
    """

    def __init__(
        self, catalog: Catalog, config: PipelineConfig, plugins: Plugins | None = None
    ) -> None:
        self.catalog = catalog
        self.config = config
        self.declared = record_schema(config, plugins)
        self.base = RecordConverter.from_config(config.source, [], plugins)
        # the version of each table last loaded, reused while the catalog names it still
        self._known = KnownVersions(_KNOWN_TABLES)

    def _load(self, name: str) -> Table:
        """The table as the catalog names it now (NoSuchTableError when it does not exist).

        Why not always ``load_table``: a task loads every table it writes, and at 1,000
        dynamic tables loading (the catalog's lookup, reading and parsing metadata.json) was
        more than half of a task's per-table CPU (issue 27). A catalog that can tell a table's
        metadata location by one lookup (:func:`icefloe.commit.versions.current_location`)
        is asked for it, and while it names the version loaded before, that version is used
        (a metadata location names one immutable metadata file; the committer's
        :class:`~icefloe.commit.versions.KnownVersions` rule); other catalogs load as before."""
        table = self._known.reusable(self.catalog, name, after_screen=False)
        if table is None:
            table = self.catalog.load_table(name)
            self._known.remember(name, table)
        return table

    def _extra_tables(self) -> list[str]:
        errors = self.config.errors
        if errors.policy == "dead_letter" and errors.dead_letter_table:
            return [errors.dead_letter_table]
        return []

    def prepare(self, data: pa.Table) -> tuple[dict[str, Table], RecordConverter]:
        """The tables for ``data`` (target tables and the dead-letter table) and a converter
        into their schemas as they are after any creation or evolution ``data`` needed."""
        tables: dict[str, Table] = {}
        for t in self.config.tables:
            try:
                tables[t.name] = self._load(t.name)
            except NoSuchTableError:
                if not t.auto_create:
                    raise
        for name in self._extra_tables():
            tables[name] = self._load(name)
        configs = list(self.config.tables)
        dynamic = self.config.dynamic_tables
        busy = dynamic is not None or any(
            t.evolve_schema or t.name not in tables for t in self.config.tables
        )
        if busy and data.num_rows:
            lean = self._existing_dynamic(data, tables)
            configs += self._prepare(self.base.decode_parts(data), tables) if lean is None else lean
        for c in configs:
            if c.name in tables:
                check_keyed_table(tables[c.name], c)
        targets = [TargetTable.of(c, tables[c.name]) for c in configs if c.name in tables]
        note = ""
        if dynamic is not None:
            note = (
                f"; [dynamic_tables] route_field '{dynamic.route_field}' must name a table "
                "that exists" + (" or can be created" if dynamic.auto_create else "")
            )
        converter = RecordConverter(
            self.base.codec,
            targets,
            case_insensitive=self.base.case_insensitive,
            tombstones=self.base.tombstones,
            route_note=note,
        )
        return tables, converter

    def _existing_dynamic(
        self, data: pa.Table, tables: dict[str, Table]
    ) -> list[TableConfig] | None:
        """The dynamic tables' entries when nothing is to be created or evolved (every
        ``[[tables]]`` entry exists and does not evolve, nor do dynamic tables, and every
        table the records name exists), found from the route field alone; else None, and
        :meth:`_prepare` decodes every field. Why: that decode, with every field's type
        inferred, then only served to read the route field, and the converter decodes the
        records again; at 10 dynamic tables it was a third of a task's CPU
        (``bench_task.py --tables 10``, docs/benchmarks.md)."""
        dynamic = self.config.dynamic_tables
        if (
            dynamic is None
            or dynamic.evolve_schema
            or any(t.evolve_schema or t.name not in tables for t in self.config.tables)
        ):
            return None
        reserved = {t.name for t in self.config.tables} | set(self._extra_tables())
        named: dict[str, list[str]] = {}
        for part in self.base.decode_parts(data, [dynamic.route_field]):
            self._name_dynamic(part, reserved, named)
        found: dict[str, Table] = {}
        for name in named:
            existing = tables.get(name) or self._existing(name)
            if existing is not None:
                found[name] = existing
            elif dynamic.auto_create:
                return None  # to be created from its rows
            # else its records are unrouted, as after the full decode
        tables.update(found)
        return [dynamic.table_config(n, v) for n, v in named.items()]

    def _name_dynamic(
        self, part: pa.Table, reserved: set[str], named: dict[str, list[str]]
    ) -> dict[str, list[str]]:
        """The dynamic tables ``part`` names, with their route values, added to ``named``;
        never a static or the dead-letter table (``reserved``) by another route."""
        dynamic = self.config.dynamic_tables
        assert dynamic is not None
        found = {
            name: values
            for name, values in dynamic_values(part, dynamic, self.base.case_insensitive).items()
            if name not in reserved
        }
        for name, values in found.items():
            named.setdefault(name, [])
            named[name] += [v for v in values if v not in named[name]]
        return found

    def _prepare(self, parts: Sequence[pa.Table], tables: dict[str, Table]) -> list[TableConfig]:
        """Create and evolve ``tables`` for the decoded ``parts``; returns the dynamic tables'
        entries (routed by the exact values that name them)."""
        dynamic = self.config.dynamic_tables
        ci = self.base.case_insensitive
        reserved = {t.name for t in self.config.tables} | set(self._extra_tables())
        named: dict[str, list[str]] = {}
        for part in parts:
            configs = list(self.config.tables)
            if dynamic is not None:
                for name, values in self._name_dynamic(part, reserved, named).items():
                    configs.append(dynamic.table_config(name, values))
            for cfg in configs:
                if cfg.name in tables and not cfg.evolve_schema:
                    continue
                if cfg.name in named and not cfg.evolve_schema:
                    # an existing dynamic table is neither created nor evolved: its rows are
                    # not needed (a mask over the whole part per table was ~3 ms a table at
                    # 1,000 tables)
                    existing = self._existing(cfg.name)
                    if existing is not None:
                        tables[cfg.name] = existing
                        continue
                try:
                    mask = route_masks(part, [cfg], ci)[cfg.name]
                except ConfigError:  # no record of this part has the route field
                    continue
                routed = part if mask is None else part.filter(mask)
                rows = renamed(schema_rows(routed, cfg), cfg.rename)
                if rows.num_rows == 0:
                    # no row image (a batch of only Debezium deletes): nothing to create or
                    # evolve the table from, but an existing table takes the batch's keys
                    if cfg.name in named and cfg.name not in tables:
                        existing = self._existing(cfg.name)
                        if existing is not None:
                            tables[cfg.name] = existing
                    continue
                table = tables.get(cfg.name) or self._load_or_create(cfg, rows)
                if table is None:
                    continue
                if cfg.evolve_schema:
                    table = self._evolve(table, cfg, rows)
                tables[cfg.name] = table
        assert dynamic is not None or not named
        return [dynamic.table_config(n, v) for n, v in named.items()] if dynamic else []

    def _infer(self, cfg: TableConfig, rows: pa.Table) -> pa.Schema:
        # a declared schema's widths stay; a JSON reader's guesses widen
        return infer_schema([rows], widen=self.declared is None, timestamps=cfg.infer_timestamps)

    def _evolve(self, table: Table, cfg: TableConfig, rows: pa.Table) -> Table:
        # infer_fields, not infer_schema: whether records leave a field null matters here
        fields = infer_fields(rows, widen=self.declared is None, timestamps=cfg.infer_timestamps)
        ci = self.base.case_insensitive
        return evolve_table(
            table,
            lambda t: plan_evolution(
                t.schema(), fields, name_mapping=t.name_mapping(), case_insensitive=ci
            ),
        )

    def _existing(self, name: str) -> Table | None:
        try:
            return self._load(name)
        except NoSuchTableError:
            return None

    def _load_or_create(self, cfg: TableConfig, rows: pa.Table) -> Table | None:
        """The table, created from ``rows`` when missing and ``auto_create``; None when it
        cannot be had (its records then go to the error policy as unrouted)."""
        try:
            return self._load(cfg.name)
        except NoSuchTableError:
            if not cfg.auto_create:
                return None
        # ``rows`` are row images already (schema_rows); a declared schema may be an envelope
        declared = None if self.declared is None else row_schema(self.declared, cfg)
        schema = declared if declared is not None else self._infer(cfg, rows)
        if not len(schema):
            return None  # records without any value: nothing to create a table from yet
        try:
            create_table(self.catalog, cfg, schema)
        except TableAlreadyExistsError:
            pass  # another task was quicker; its schema is evolved below if allowed
        except (ConfigError, ValueError) as exc:
            if cfg.name in {t.name for t in self.config.tables}:
                raise ConfigError(
                    "tables.auto_create",
                    f"cannot create table '{cfg.name}' from its records: {exc}",
                    "check partition_by and id_columns against the records' fields",
                ) from None
            log.error("cannot create dynamic table %s from its records: %s", cfg.name, exc)
            return None
        else:
            log.info("created table %s from its records", cfg.name)
        return self._load(cfg.name)
