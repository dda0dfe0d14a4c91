"""Where a writer without a usable checkpoint may start (icefloe.coordination.resume), on every
backend's real server with a real catalog: a batch published and not yet committed counts as much as
one in the table, both for the start offsets and for the writer's batch numbers."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyiceberg.catalog import Catalog

from icefloe.channel import Backend
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.resume import (
    Progress,
    check_batch_continuity,
    committed,
    published,
    start_offsets,
)
from icefloe.coordination.writer import WriterClient
from icefloe.errors import WriterRegressionError
from icefloe.plugins.backends import open_backend
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, make_sqlite_catalog
from icefloe.testing.harness import RowSource, lead, wait_pending
from icefloe_kafka.embedded import EmbeddedKafkaBroker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.` from the root
from tests.test_e2e_spark import BACKENDS, backend_section

TABLE = "resume.rows"


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def open_pipeline_backend(
    backend: str, broker: EmbeddedKafkaBroker, name: str, catalog_dir: Path
) -> Backend:
    config = config_from_dict(
        {
            "name": name,
            "source": {"bootstrap_servers": broker.bootstrap_servers, "topics": ["source"]},
            "tables": [{"name": TABLE}],
            "catalog": {"name": "icefloe_test", "properties": {"warehouse": str(catalog_dir)}},
            "coordination": {
                "backend": backend,
                "lease_ttl_s": 3.0,
                backend: backend_section(backend, broker),
            },
        }
    )
    return open_backend(config)


@pytest.fixture(params=BACKENDS)
def pipeline_backend(
    request: pytest.FixtureRequest, kafka_broker: EmbeddedKafkaBroker, tmp_path: Path
) -> Iterator[tuple[Backend, str]]:
    """The backend of a new pipeline, and the pipeline's name."""
    # unique per run: PostgreSQL and Redis outlive the test, and a name seen before would
    # find the last run's writers and positions
    name = f"resume-{request.param}-{uuid.uuid4().hex[:10]}"
    opened = open_pipeline_backend(request.param, kafka_broker, name, tmp_path / "iceberg")
    yield opened, name
    opened.close()


def read_progress(backend: Backend, group_id: str, catalog: Catalog) -> tuple[Progress, Progress]:
    channel = backend.coordinator("resume-test-reader")
    try:
        on_channel = published(channel, group_id)
    finally:
        channel.close()
    return on_channel, committed(catalog, group_id, [TABLE])


def test_start_is_after_published_batches_and_batch_numbers_may_not_go_back(
    pipeline_backend: tuple[Backend, str], catalog: Catalog
) -> None:
    """A writer publishes batch 0 (committed) and batch 1 (not yet): a writer without a
    checkpoint starts after batch 1, and a checkpoint behind batch 1 is refused for "old"."""
    backend, group_id = pipeline_backend
    source = RowSource.create(catalog, [TABLE])
    writer = WriterClient(backend.writer("old"), group_id, "old")
    writer.start()
    coordinator = Coordinator(
        group_id,
        backend.coordinator("c1"),
        catalog,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=10.0),
        plugins=new_plugins(autoload=False),
    )
    try:
        lead(coordinator)
        source.publish(writer, 0)  # source offset 5
        wait_pending(coordinator, 1)
        assert not coordinator.commit_now().failed
        source.publish(writer, 1)  # source offset 10: published, not committed
        on_channel, in_tables = read_progress(backend, group_id, catalog)
        assert in_tables.source_offsets == {"source": {0: 5}}
        assert in_tables.batches == {"old": 0}
        assert on_channel.source_offsets["source"][0] == 10
        assert on_channel.batches["old"] == 1
        assert start_offsets(on_channel, in_tables) == {"source": {0: 10}}
        # a checkpoint behind what the writer published: refused, naming the fix
        for behind in (None, 0):
            with pytest.raises(WriterRegressionError, match="another writer id"):
                check_batch_continuity("old", behind, on_channel, in_tables, "/ckpt")
        check_batch_continuity("old", 1, on_channel, in_tables, "/ckpt")  # re-runs batch 1
        check_batch_continuity("new", None, on_channel, in_tables, "/ckpt")
        # once the batch is committed the tables alone still refuse a fresh checkpoint
        wait_pending(coordinator, 1)
        assert not coordinator.commit_now().failed
        on_channel, in_tables = read_progress(backend, group_id, catalog)
        assert in_tables.batches == {"old": 1}
        assert start_offsets(on_channel, in_tables) == {"source": {0: 10}}
        with pytest.raises(WriterRegressionError):
            check_batch_continuity("old", None, Progress(), in_tables, "/ckpt")
        assert_exactly_once(catalog, TABLE, source.expected[TABLE])
    finally:
        writer.close()
        coordinator.close()
