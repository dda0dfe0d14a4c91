"""Shared fixtures of the cross-package tests: a real Kafka-protocol broker (Tansu), one local
Spark session for the whole run (it takes ~10 s to start) and private Iceberg catalogs.

Servers the tests need must be there: a missing one fails the test loudly, never skips it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from icefloe_kafka.embedded import EmbeddedKafkaBroker

pytest_plugins = ["icefloe.testing.fixtures", "icefloe.testing.objectstore"]


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafkaBroker]:
    """A private Tansu broker for the whole session (memory storage, a free port)."""
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedKafkaBroker(log_path=log) as broker:
        yield broker


@pytest.fixture
def catalog_properties(tmp_path: Path) -> dict[str, str]:
    """A private SqlCatalog (SQLite + file:// warehouse) as pyiceberg catalog properties."""
    from icefloe.testing.fixtures import sqlite_catalog_properties

    return {"type": "sql", **sqlite_catalog_properties(tmp_path / "iceberg")}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every test that runs a query in-process. ``local[2,2]``:
    two cores and two attempts per task (local mode ignores spark.task.maxFailures)."""
    from icefloe_spark.testing import local_spark

    with local_spark("local[2,2]") as session:
        yield session
