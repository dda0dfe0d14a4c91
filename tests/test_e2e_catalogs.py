"""Kafka (a real Tansu broker) -> Spark (local) -> Iceberg through the catalogs production runs:
pyiceberg's SqlCatalog on the real PostgreSQL, and the Iceberg REST protocol (pyiceberg's
RestCatalog client against ``icefloe.testing.rest_catalog``, a thin REST server over a
SqlCatalog on that PostgreSQL: no REST catalog server installs here).

The pipeline writes a table that exists and one its write tasks auto-create from the first
records (its tasks may race to create it). Another writer appends to the existing table through
the same catalog while the pipeline runs (with REST, before each of the pipeline's commits to
it is applied, so each conflicts and is redone).
Rows are counted with pyarrow from the data files the table's manifests list, by a catalog
client of its own: every produced record exactly once, every foreign row kept.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow

from icefloe.config import config_from_dict
from icefloe.testing.cli import run_icefloe, write_config
from icefloe.testing.fixtures import data_file_ids
from icefloe.testing.rest_catalog import RestCatalogServer
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.pipeline import Pipeline
from tests.test_e2e_spark import (
    SOURCE_OPTIONS,
    TABLE,
    WAIT_S,
    committed_rows,
    make_table,
    new_topic,
    pipeline_dict,
    produce_json,
    wait_until,
)

FOREIGN_BATCHES = 3  # the other writer's appends, 2 rows each
CREATED = "e2e.created"  # auto-created from the first records by the write tasks, racing


class ForeignWriter:
    """A writer that is not icefloe, appending rows with ids from 1,000,000 through a catalog
    client of its own; ``ids`` is what it committed."""

    def __init__(self, properties: dict[str, str]) -> None:
        # a SqlCatalog's tables belong to its name: the pipeline's ("e2e")
        self.catalog = load_catalog("e2e", **properties)
        self.ids: list[int] = []
        self.lock = threading.Lock()

    def append(self) -> None:
        table = self.catalog.load_table(TABLE)
        ids = [1_000_000 + len(self.ids), 1_000_001 + len(self.ids)]
        rows = {"id": ids, "name": ["foreign"] * 2, "kind": ["a", "b"]}
        table.append(pa.Table.from_pydict(rows, schema=schema_to_pyarrow(table.schema())))
        self.ids.extend(ids)

    def slip_in(self, identifier: tuple[str, ...]) -> None:
        """A REST server hook: append before the pipeline's commit to the table is applied (not
        before the foreign writer's own, which arrives on another server thread while the lock
        is held)."""
        if identifier != tuple(TABLE.split(".")) or len(self.ids) >= 2 * FOREIGN_BATCHES:
            return
        if not self.lock.acquire(blocking=False):
            return
        try:
            self.append()
        finally:
            self.lock.release()


def created_rows(catalog: Catalog) -> int:
    """Rows committed to the auto-created table (0 before it exists)."""
    if not catalog.table_exists(CREATED):
        return 0
    snapshot = catalog.load_table(CREATED).current_snapshot()
    return (
        0
        if snapshot is None or snapshot.summary is None
        else int(snapshot.summary["total-records"] or 0)
    )


def operator_commands_work(config: Path, name: str) -> None:
    """``icefloe status``, ``doctor`` and ``maintain`` (orphans included: everything is
    older than 0 s) go through the same catalog in a child process and succeed."""
    status = run_icefloe("status", "--config", str(config))
    assert status.returncode == 0, status.stdout + status.stderr
    assert name in status.stdout, status.stdout
    assert TABLE in status.stdout, status.stdout
    doctor = run_icefloe("doctor", "--config", str(config))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    maintain = run_icefloe(
        "maintain",
        "--config",
        str(config),
        "--expire-older-than",
        "0s",
        "--orphans-older-than",
        "0s",
    )
    assert maintain.returncode == 0, maintain.stdout + maintain.stderr


@contextlib.contextmanager
def served(catalog: str, properties: dict[str, str]) -> Iterator[RestCatalogServer | None]:
    """With ``rest``: a REST catalog server over the PostgreSQL SqlCatalog."""
    if catalog != "rest":
        yield None
        return
    backing = SqlCatalog("backing", **{k: v for k, v in properties.items() if k != "type"})
    with RestCatalogServer(backing) as server:
        yield server
    backing.engine.dispose()


@pytest.mark.parametrize("catalog", ["postgres", "rest"])
def test_every_record_lands_once_beside_another_writer(
    catalog: str,
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    postgres_catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    with served(catalog, postgres_catalog_properties) as server:
        properties = postgres_catalog_properties if server is None else server.client_properties()
        table_catalog: Catalog = make_table(properties)
        foreign = ForeignWriter(properties)
        topic = new_topic(kafka_broker)
        name = f"e2e-cat-{catalog}-{uuid.uuid4().hex[:8]}"
        section = pipeline_dict(
            name, kafka_broker, topic, properties, "postgres", tmp_path / "ckpt"
        )
        section["tables"].append({"name": CREATED, "auto_create": True})
        produce_json(kafka_broker.bootstrap_servers, topic, range(500))
        if server is not None:
            server.before_commit = foreign.slip_in
        with Pipeline(
            config_from_dict(section), spark=spark, source_extra_options=SOURCE_OPTIONS
        ) as pipeline:
            wait_until(lambda: committed_rows(table_catalog) >= 250, WAIT_S, "the first rows")
            if server is None:  # PostgreSQL: the other writer appends while batches commit
                for _ in range(FOREIGN_BATCHES):
                    foreign.append()
            produce_json(kafka_broker.bootstrap_servers, topic, range(500, 750))
            total = 750 + 2 * FOREIGN_BATCHES
            wait_until(lambda: committed_rows(table_catalog) >= total, WAIT_S, "every row")
            wait_until(lambda: created_rows(table_catalog) >= 750, WAIT_S, "every created row")
            assert pipeline.stats.records == 750
        if server is not None:
            assert server.conflicts >= FOREIGN_BATCHES, "no commit conflicted through REST"
        reader = load_catalog("e2e", **properties)  # a client of its own, not the committer's
        got = data_file_ids(reader.load_table(TABLE))
        assert data_file_ids(reader.load_table(CREATED)) == list(range(750))
        operator_commands_work(write_config(tmp_path / "pipeline.toml", section), name)
        assert data_file_ids(reader.load_table(TABLE)) == got  # maintain kept every row
    assert len(foreign.ids) == 2 * FOREIGN_BATCHES
    assert got == sorted([*range(750), *foreign.ids])
