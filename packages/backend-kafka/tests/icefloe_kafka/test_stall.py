"""A stalled control channel is reported, on the real broker: another producer leaves a
transaction open on the control topic, so read_committed readers (the coordinator, and the read
``icefloe status`` makes) cannot pass it while writers keep appending behind it. The coordinator
must say so (log warning, metric, ``channel_stalled_s``) instead of waiting silently, and carry
on without loss or duplicates once the transaction ends (rows counted with a pyiceberg scan)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataComplete, Event, WriterRef, encode_event
from icefloe.ops.status import _read_backend
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, make_sqlite_catalog
from icefloe.testing.harness import RowSource, lead, wait_pending
from icefloe_kafka.clients import group_headers, record_key

from .conftest import BackendMaker
from .test_pipeline import wait_for

TABLE = "kafka_stall.events"


@pytest.fixture
def catalog(tmp_path: Path) -> SqlCatalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def _stalled_metric() -> float:
    return REGISTRY.get_sample_value("icefloe_channel_stalled_seconds") or 0.0


def test_an_open_foreign_transaction_is_reported_as_a_stall_and_nothing_is_lost(
    make_backend: BackendMaker,
    group_id: str,
    catalog: SqlCatalog,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = make_backend(group_id, transaction_timeout_ms=300_000)
    source = RowSource.create(catalog, [TABLE])
    writer = WriterClient(backend.writer("w1"), group_id, "w1")
    writer.start()
    settings = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=20.0, stall_after_s=1.0
    )
    coordinator = Coordinator(
        group_id,
        backend.coordinator("c1"),
        catalog,
        settings,
        coordinator_id="c1",
        plugins=new_plugins(autoload=False),
    )
    clients = backend.clients
    hung = clients.producer(clients.transactional_id("hung-tool"), "hung-tool")
    try:
        lead(coordinator)
        first = source.publish(writer, 0)
        wait_pending(coordinator, first.file_count)
        assert coordinator.channel_stalled_s is None

        # a foreign producer opens a transaction in w1's partition and never ends it...
        hung.init_transactions(clients.timeout)
        hung.begin_transaction()
        stray = Event(group_id, DataComplete(()), writer=WriterRef("hung-tool", 1))
        hung.produce(
            clients.control_topic,
            value=encode_event(stray),
            key=record_key(group_id, "w1"),
            headers=group_headers(group_id),
        )
        assert hung.flush(clients.timeout) == 0
        # ...while the writer goes on publishing behind it
        second = source.publish(writer, 1)

        with caplog.at_level(logging.WARNING, logger="icefloe.coordinator"):
            wait_for(
                "a stall report", lambda: coordinator.step(0.2) or coordinator.channel_stalled_s
            )
        assert coordinator.pending_files() == {TABLE: first.file_count}  # the read stands
        assert _stalled_metric() >= 1.0
        assert any("control channel stalled" in r.getMessage() for r in caplog.records)
        why = _read_backend(backend, group_id).stall  # what `icefloe status` shows
        assert why is not None
        assert "holds events no reader gets" in why

        hung.abort_transaction(clients.timeout)  # the transaction ends: reading resumes
        wait_pending(coordinator, first.file_count + second.file_count, timeout=60)
        wait_for(
            "the stall to clear", lambda: coordinator.step(0.2) or not coordinator.channel_stalled_s
        )
        assert _stalled_metric() == 0.0
        [result] = coordinator.commit_now().tables
        assert result.data_files == first.file_count + second.file_count
        assert_exactly_once(catalog, TABLE, source.expected[TABLE])
    finally:
        writer.close()
        coordinator.close()
