"""Target tables: existence checks and auto-creation from a format's record schema, against a
real SqlCatalog."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import TableAlreadyExistsError
from pyiceberg.table import CommitTableResponse, Table
from pyiceberg.table.update import TableRequirement, TableUpdate
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform

from icefloe.config import PipelineConfig, config_from_dict
from icefloe.errors import ConfigError
from icefloe.plugins.manager import get_plugins
from icefloe.records.changes import row_schema
from icefloe.testing.fixtures import make_sqlite_catalog, sqlite_catalog_properties
from icefloe.testing.rest_catalog import RestCatalogServer
from icefloe_spark.sink.tables import create_table, ensure_tables, parse_partition, record_schema

AVRO = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "region", "type": ["null", "string"]},
        {"name": "created_at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    ],
}


def config(tables: list[dict[str, Any]], fmt: str = "avro") -> PipelineConfig:
    options = {"schema": json.dumps(AVRO)} if fmt == "avro" else {}
    return config_from_dict(
        {
            "name": "orders",
            "source": {"topics": ["orders"], "format": fmt, "format_options": options},
            "tables": tables,
        }
    )


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def test_partition_entries() -> None:
    assert parse_partition("region") == ("region", IdentityTransform())
    assert parse_partition("day(created_at)") == ("created_at", DayTransform())
    assert parse_partition(" bucket(16, order_id) ") == ("order_id", BucketTransform(16))
    for bad in ("bucket(order_id)", "day(3, ts)", "frobnicate(ts)", "a b"):
        with pytest.raises(ConfigError, match="partition_by"):
            parse_partition(bad)


def test_auto_create_builds_schema_spec_and_identifier_fields(catalog: Catalog) -> None:
    cfg = config(
        [
            {
                "name": "sales.orders",
                "auto_create": True,
                "partition_by": ["day(created_at)", "region"],
                "id_columns": ["order_id"],
            }
        ]
    )
    assert ensure_tables(catalog, cfg) == ["sales.orders"]
    table = catalog.load_table("sales.orders")
    schema = table.schema()
    assert [f.name for f in schema.fields] == ["order_id", "region", "created_at"]
    assert schema.find_field("order_id").required
    assert [schema.find_field(i).name for i in schema.identifier_field_ids] == ["order_id"]
    spec = [(schema.find_field(f.source_id).name, f.transform) for f in table.spec().fields]
    assert spec == [("created_at", DayTransform()), ("region", IdentityTransform())]
    assert ensure_tables(catalog, cfg) == []  # exists now: left alone


def test_missing_table_without_auto_create_is_a_config_error(catalog: Catalog) -> None:
    with pytest.raises(ConfigError, match=r"sales\.orders.*does not exist"):
        ensure_tables(catalog, config([{"name": "sales.orders"}]))


def test_missing_json_table_suggests_auto_create(catalog: Catalog) -> None:
    """JSON tables can be auto-created now (from their first records): suggest it."""
    with pytest.raises(ConfigError, match="set auto_create = true"):
        ensure_tables(catalog, config([{"name": "sales.orders"}], fmt="json"))


def test_json_auto_create_waits_for_records(catalog: Catalog) -> None:
    """JSON declares no schema: nothing is created at start, the first records create it."""
    cfg = config([{"name": "sales.orders", "auto_create": True}], fmt="json")
    assert ensure_tables(catalog, cfg) == []
    assert not catalog.table_exists("sales.orders")


def test_unknown_id_column_is_named(catalog: Catalog) -> None:
    cfg = config([{"name": "sales.orders", "auto_create": True, "id_columns": ["nope"]}])
    with pytest.raises(ConfigError, match="nope"):
        ensure_tables(catalog, cfg)


def test_auto_created_tables_keep_metadata_bounded_and_take_configured_properties(
    catalog: Catalog,
) -> None:
    cfg = config(
        [
            {
                "name": "sales.orders",
                "auto_create": True,
                "properties": {"write.metadata.previous-versions-max": "7", "owner": "sales"},
            }
        ]
    )
    ensure_tables(catalog, cfg)
    props = catalog.load_table("sales.orders").properties
    assert props["commit.manifest-merge.enabled"] == "true"
    assert props["write.metadata.delete-after-commit.enabled"] == "true"
    assert props["write.metadata.previous-versions-max"] == "7"  # the configured value wins
    assert props["owner"] == "sales"


class _SlowSql(SqlCatalog):
    """A SqlCatalog client whose commits run ``hook`` first (another client's commit lands
    between this one's staging and its commit)."""

    def __init__(self, hook: Callable[[tuple[str, ...]], None], **properties: str) -> None:
        super().__init__("icefloe_test", **properties)
        self._hook = hook

    def commit_table(
        self,
        table: Table,
        requirements: tuple[TableRequirement, ...],
        updates: tuple[TableUpdate, ...],
    ) -> CommitTableResponse:
        self._hook(table.name())
        return super().commit_table(table, requirements, updates)


@pytest.mark.parametrize("catalog_kind", ["sql", "rest"])
def test_a_create_that_loses_the_race_is_table_already_exists(
    catalog_kind: str, tmp_path: Path
) -> None:
    """Two write tasks (or drivers) auto-create the same table; the one whose staged create
    commits second finds the table there. Its callers take TableAlreadyExistsError for "another
    was quicker" and load the table; the catalog answers a failed assert-create with
    CommitFailedException (409 through REST), which used to fail the task (in local mode,
    which retries no task, the query)."""
    cfg = config([{"name": "sales.orders", "auto_create": True}])
    declared = record_schema(cfg, get_plugins())
    assert declared is not None
    schema = row_schema(declared, cfg.tables[0])
    backing = make_sqlite_catalog(tmp_path / "race")
    backing.create_namespace("sales")
    first: list[str] = []

    def quicker(_: tuple[str, ...]) -> None:  # the other task's create lands first
        if not first:
            create_table(backing, cfg.tables[0], schema)
            first.append(str(backing.load_table("sales.orders").metadata.table_uuid))

    with RestCatalogServer(backing, before_commit=quicker) as server:
        if catalog_kind == "rest":
            client = load_catalog("client", **server.client_properties())
        else:  # a SQL client of the same catalog, its commit slowed past the other's
            client = _SlowSql(quicker, **sqlite_catalog_properties(tmp_path / "race"))
        with pytest.raises(TableAlreadyExistsError):
            create_table(client, cfg.tables[0], schema)
    assert first == [str(backing.load_table("sales.orders").metadata.table_uuid)]
