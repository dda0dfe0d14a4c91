"""Target tables before the query starts: check they exist, or create those marked
``auto_create`` from the record schema the source format declares.

Only a format whose codec knows its records' schema up front can create a table: the codec
exposes it as ``arrow_schema`` (the built-in ``avro`` codec does, from its writer schema). JSON
carries no schema, so its tables must be created first.
"""

from __future__ import annotations

import logging
import re

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError, TableAlreadyExistsError
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform, Transform, parse_transform
from pyiceberg.types import (
    BinaryType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    TimestamptzType,
)

from icefloe.config import PipelineConfig, TableConfig
from icefloe.errors import ConfigError
from icefloe.maintenance import recommended_properties
from icefloe.plugins import Plugins, get_plugins

log = logging.getLogger(__name__)

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
    bounded-metadata recommendations, then ``tables.properties``) in one transaction."""
    missing = [c for c in table.id_columns if c not in schema.names]
    if missing:
        raise ConfigError(
            "tables.id_columns", f"{missing} are not fields of the records", "fix the names"
        )
    # identifier fields must be required
    fields = [f.with_nullable(False) if f.name in table.id_columns else f for f in schema]
    namespace = table.name.rsplit(".", 1)[0]
    catalog.create_namespace_if_not_exists(namespace)
    txn = catalog.create_table_transaction(
        table.name, schema=pa.schema(fields), properties=recommended_properties(table.properties)
    )
    if table.partition_by:
        with txn.update_spec() as spec:
            for entry in table.partition_by:
                column, transform = parse_partition(entry)
                spec.add_field(column, transform)
    if table.id_columns:
        with txn.update_schema() as update:
            update.set_identifier_fields(*table.id_columns)
    txn.commit_transaction()


def ensure_tables(
    catalog: Catalog, config: PipelineConfig, plugins: Plugins | None = None
) -> list[str]:
    """Fail on a missing table unless it is ``auto_create``; create those. Returns the names
    of the tables created."""
    created: list[str] = []
    schema: pa.Schema | None = None
    for t in config.tables:
        try:
            catalog.load_table(t.name)
            continue
        except NoSuchTableError:
            if not t.auto_create:
                schema = schema if schema is not None else record_schema(config, plugins)
                raise ConfigError(
                    "tables.name",
                    f"table '{t.name}' does not exist",
                    "create it first, or set auto_create = true"
                    if schema is not None
                    # auto_create needs a record schema, which this format does not declare
                    else f"create it first (format '{config.source.format}' declares no "
                    "record schema to create it from)",
                ) from None
        schema = schema if schema is not None else record_schema(config, plugins)
        if schema is None:
            raise ConfigError(
                "tables.auto_create",
                f"table '{t.name}' does not exist and format '{config.source.format}' "
                "declares no record schema to create it from",
                "create the table first, or use a format with a schema (avro)",
            )
        try:
            create_table(catalog, t, schema)
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
