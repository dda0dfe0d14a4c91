"""Read-only reads of the channel (where a writer without a checkpoint resumes, what
``icefloe maintain`` must keep) go to the end the channel reported before the read, never
"until a poll found nothing", on the real broker:

* a slow fetch (the broker holds every fetch for ``fetch.wait.max.ms`` while less than
  ``fetch.min.bytes`` is ready) returns nothing for seconds while batches are there;
* a read_committed reader stands still at a transaction left open (a writer that died while
  publishing, under its old id) while committed batches wait behind it.

A read cut short misses those batches: a writer started after a lost checkpoint starts below
them (their records are read and committed twice), and ``icefloe maintain`` deletes the files
they announce before the coordinator commits them (rows counted with a pyiceberg scan).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.config import config_from_dict
from icefloe.coordination.backlog import backlog, short_of
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.reading import announced_files
from icefloe.coordination.resume import Progress, published, start_offsets
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ChannelStalledError
from icefloe.events import DataComplete, Event, WriterRef, encode_event
from icefloe.ops.maintenance import maintain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    make_sqlite_catalog,
    sqlite_catalog_properties,
)
from icefloe.testing.harness import Batch, RowSource, lead, wait_pending
from icefloe.testing.rules.support import make_batch
from icefloe_kafka import KafkaBackend
from icefloe_kafka.clients import group_headers, record_key
from icefloe_kafka.embedded import EmbeddedKafkaBroker

from .conftest import BackendMaker

TABLE = "read_to_end.events"
CATALOG = "read_to_end"
#: a fetch the broker answers only after this long (less than fetch.min.bytes is ever ready)
SLOW_FETCH = {"fetch_wait_max_ms": 2000, "kafka": {"fetch.min.bytes": "100000000"}}


@pytest.fixture
def catalog_dir(tmp_path: Path) -> Path:
    return tmp_path / "iceberg"


@pytest.fixture
def catalog(catalog_dir: Path) -> SqlCatalog:
    return make_sqlite_catalog(catalog_dir, CATALOG)


@pytest.fixture
def topic() -> str:
    """A control topic for the test alone (of one partition in ``pipe``: the open transaction
    and the batches behind it share the writer's partition)."""
    return f"read-to-end-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def source(catalog: SqlCatalog) -> RowSource:
    return RowSource.create(catalog, [TABLE])


Pipe = Callable[..., tuple[KafkaBackend, WriterClient]]


@pytest.fixture
def pipe(make_backend: BackendMaker, group_id: str, topic: str) -> Iterator[Pipe]:
    """``pipe(**backend_config)``: a backend on the test's topic and its started writer w."""
    writers: list[WriterClient] = []

    def make(**config: Any) -> tuple[KafkaBackend, WriterClient]:
        backend = make_backend(group_id, control_topic=topic, partitions=1, **config)
        writer = WriterClient(backend.writer("w"), group_id, "w")
        writer.start()
        writers.append(writer)
        return backend, writer

    yield make
    for w in writers:
        w.close()


def files_of(*batches: Batch) -> set[str]:
    return {f.path for b in batches for f in b.files[TABLE]}


def leave_transaction_open(backend: KafkaBackend, group_id: str) -> Producer:
    """A producer that left a transaction open in the writers' partition (a writer that died
    while publishing, under an id nobody reuses after a lost checkpoint, so nothing fences
    it): the transaction stays open until the broker's transaction timeout aborts it. What it
    produced does not matter here (a DataComplete without positions; Tansu, unlike Apache
    Kafka, shows aborted records to read_committed readers, so it carries no file)."""
    clients = backend.clients
    producer = clients.producer(clients.transactional_id("old"), "dead-writer")
    producer.init_transactions(clients.timeout)
    producer.begin_transaction()
    stray = Event(group_id, DataComplete(()), WriterRef("old", 1), 0)
    producer.produce(
        clients.control_topic,
        value=encode_event(stray),
        key=record_key(group_id, "old"),
        headers=group_headers(group_id),
    )
    assert producer.flush(clients.timeout) == 0  # in the log, not committed
    return producer


def abort_later(producer: Producer, after_s: float, timeout: float) -> threading.Thread:
    """The broker's transaction timeout, shortened: the open transaction ends ``after_s`` from
    now, while the read under test runs."""

    def run() -> None:
        time.sleep(after_s)
        producer.abort_transaction(timeout)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def age_everything(location: str, seconds: float) -> None:
    stamp = time.time() - seconds
    for path in Path(location.removeprefix("file://")).rglob("*"):
        if path.is_file():
            os.utime(path, (stamp, stamp))


def test_a_slow_fetch_does_not_cut_the_read_of_published_batches_short(
    pipe: Pipe, group_id: str, source: RowSource
) -> None:
    """Every fetch of the readers below takes seconds: polls come back empty while three
    batches are on the channel. A writer after a lost checkpoint must still start after all
    three, and maintain must still know all their files."""
    backend, writer = pipe(**SLOW_FETCH)
    batches = [source.publish(writer, seq) for seq in range(3)]

    with closing(backend.coordinator("start")) as channel:
        progress = published(channel, group_id)
    assert progress.batches == {"w": 2}
    assert start_offsets(progress, Progress()) == {"source": {0: 15}}
    with closing(backend.coordinator("maintain")) as channel:
        assert announced_files(channel, group_id) == files_of(*batches)


def test_resume_reads_past_a_transaction_left_open(
    pipe: Pipe, group_id: str, source: RowSource
) -> None:
    """Batch 1 is committed behind a transaction left open. The read waits for the
    transaction to end and includes batch 1; if it does not end in time, the read refuses
    (ChannelStalledError) instead of answering short."""
    backend, writer = pipe(transaction_timeout_ms=300_000)
    clients = backend.clients
    source.publish(writer, 0)
    hung = leave_transaction_open(backend, group_id)
    source.publish(writer, 1)

    ends = abort_later(hung, 5.0, clients.timeout)
    with closing(backend.coordinator("start")) as channel:
        progress = published(channel, group_id)
    ends.join()
    assert progress.batches.get("w") == 1, "the read stopped at the open transaction"
    assert start_offsets(progress, Progress())["source"][0] == 10

    hung = leave_transaction_open(backend, group_id)
    source.publish(writer, 2)
    try:
        with (
            closing(backend.coordinator("start-again")) as channel,
            pytest.raises(ChannelStalledError, match="holds events no reader gets"),
        ):
            published(channel, group_id, timeout_s=2.0)
    finally:
        hung.abort_transaction(clients.timeout)


def test_maintain_keeps_the_files_of_batches_behind_an_open_transaction(
    pipe: Pipe,
    kafka_broker: EmbeddedKafkaBroker,
    group_id: str,
    source: RowSource,
    catalog: SqlCatalog,
    catalog_dir: Path,
    topic: str,
) -> None:
    """Batch 0 is published behind a transaction left open, so the coordinator has not
    committed it: its files are unreferenced and old. ``icefloe maintain`` must not delete
    them; once the transaction ends, the coordinator commits every row once."""
    backend, writer = pipe(transaction_timeout_ms=300_000)
    clients = backend.clients
    hung = leave_transaction_open(backend, group_id)
    pending = source.publish(writer, 0)
    age_everything(catalog.load_table(TABLE).location(), 10 * 86_400)

    cfg = config_from_dict(
        {
            "name": group_id,
            "source": {"topics": ["t"]},
            "catalog": {"name": CATALOG, "properties": sqlite_catalog_properties(catalog_dir)},
            "tables": [{"name": TABLE}],
            "coordination": {
                "backend": "kafka",
                "kafka": {
                    "bootstrap_servers": kafka_broker.bootstrap_servers,
                    "control_topic": topic,
                    "operation_timeout_s": 20.0,
                },
            },
        }
    )
    ends = abort_later(hung, 8.0, clients.timeout)
    lines = maintain(cfg, orphans_older_than_s=86_400)
    ends.join()
    deleted = sorted(p for p in files_of(pending) if not Path(p.removeprefix("file://")).exists())
    assert deleted == [], f"maintain deleted files of an uncommitted batch: {lines}"

    coordinator = Coordinator(
        group_id,
        backend.coordinator("c1"),
        catalog,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=20.0),
        coordinator_id="c1",
        plugins=new_plugins(autoload=False),
    )
    try:
        lead(coordinator)
        wait_pending(coordinator, pending.file_count, timeout=60)
        # the dead writer's aborted record shows on Tansu: do not wait for it to answer
        assert not coordinator.commit_now(wait_for_writers=False).failed
        assert_exactly_once(catalog, TABLE, source.expected[TABLE])
    finally:
        coordinator.close()


def test_partitions_not_read_yet_are_read_through_their_log_start(
    make_backend: BackendMaker, group_id: str, topic: str
) -> None:
    """A reader from the log start has read nothing before the low watermark, so partitions
    that gave it no record yet count as read through it (a log emptied by retention is then
    read to its end, instead of holding every read-to-end back)."""
    backend = make_backend(group_id, control_topic=topic, partitions=3)
    with closing(backend.writer("w")) as writer, closing(backend.coordinator("r")) as reader:
        epoch = writer.open()
        for seq in range(2):
            assert writer.publish(make_batch(group_id, WriterRef("w", epoch), seq))
        end = reader.end_position()
        reader.seek(None)
        assert reader.read_through() == {"0": 0, "1": 0, "2": 0}
        assert [rec.event.batch_seq for rec in backlog(reader, group_id)][-1] == 1
        assert short_of({}, reader.read_through(), end) == {}
