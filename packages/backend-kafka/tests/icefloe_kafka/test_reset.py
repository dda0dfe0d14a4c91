"""Channel identity and reset detection on the real broker: a control topic deleted and
recreated is a new channel (topic id), a stored position past the end of the log is refused,
and a pipeline whose tables were committed through the old topic is refused."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.errors import ChannelChangedError, ChannelResetError
from icefloe.events import Event, StartCommit
from icefloe.testing.fixtures import assert_exactly_once
from icefloe.testing.harness import RowSource, commit_batches, refused_restart
from icefloe_kafka import KafkaBackend

from .conftest import BackendMaker
from .conftest import recreate_control_topic as recreate

TABLE = "ns.t"


def test_recreated_topic_is_a_new_channel_and_refuses_positions_past_its_end(
    make_backend: BackendMaker, group_id: str
) -> None:
    topic = f"ctl-{uuid.uuid4().hex[:8]}"
    first = make_backend(group_id, control_topic=topic)
    coord = first.coordinator("c")
    old_id = coord.channel_id()
    assert old_id.startswith("kafka:")
    assert topic in old_id
    coord.close()
    recreate(first)

    second = make_backend(group_id, control_topic=topic)
    coord = second.coordinator("c")
    assert coord.channel_id() != old_id
    assert coord.acquire(20) is not None
    with pytest.raises(ChannelResetError, match="past the end of the log"):
        coord.seek({"0": 7})
    coord.close()


def test_pipeline_on_a_recreated_topic_is_refused(
    make_backend: BackendMaker, group_id: str, sqlite_catalog: SqlCatalog
) -> None:
    topic = f"ctl-{uuid.uuid4().hex[:8]}"
    source = RowSource.create(sqlite_catalog, [TABLE])
    first = make_backend(group_id, control_topic=topic)
    old_id = commit_batches(first, sqlite_catalog, group_id, source, range(2))
    committed = list(source.expected[TABLE])
    recreate(first)
    error = refused_restart(
        make_backend(group_id, control_topic=topic), sqlite_catalog, group_id, source, 2
    )
    assert isinstance(error, (ChannelChangedError, ChannelResetError)), error
    assert old_id in str(error) or "past the end" in str(error)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def _open_transaction(backend: KafkaBackend, name: str, partitions: Sequence[int]) -> Any:
    """A transactional producer with an open transaction holding one record per partition."""
    clients = backend.clients
    p = clients.producer(clients.transactional_id(name), name)
    p.init_transactions(clients.timeout)
    p.begin_transaction()
    for partition in partitions:
        p.produce(clients.control_topic, value=b"x", partition=partition)
    assert p.flush(clients.timeout) == 0
    return p


def test_a_position_behind_an_open_transaction_is_not_taken_for_a_reset(
    make_backend: BackendMaker, group_id: str
) -> None:
    """A driver killed inside its publish leaves a transaction open on the control topic. The
    log still covers every stored position; a new coordinator must seek there, not stop with
    ChannelResetError (seen in the upsert crash test: "past the end of the log (0)")."""
    backend = make_backend(group_id, transaction_timeout_ms=300_000)
    clients = backend.clients
    clients.ensure_topics()
    _open_transaction(backend, "done", [0]).commit_transaction(clients.timeout)
    coord = backend.coordinator("c")
    stored = coord.end_position()["0"]
    assert stored > 0
    hung = _open_transaction(backend, "killed-driver", [0])  # never ends its transaction
    try:
        coord.seek({"0": stored})
    finally:
        hung.abort_transaction(clients.timeout)
        coord.close()


def test_a_writer_opened_behind_an_open_transaction_reads_broadcasts_from_the_end(
    make_backend: BackendMaker, group_id: str
) -> None:
    """A writer reads only broadcasts sent after it opened, even while another producer's
    transaction is open (read_committed bounds read as 0 then: it would replay them all)."""
    backend = make_backend(group_id, transaction_timeout_ms=300_000)
    clients = backend.clients
    coord = backend.coordinator("c")
    assert coord.acquire(20) is not None
    coord.broadcast(Event(group_id, StartCommit("before-open")))
    hung = _open_transaction(backend, "killed-driver", clients.partitions(clients.control_topic))
    writer = backend.writer("w")
    try:
        writer.open()
    finally:
        hung.abort_transaction(clients.timeout)
    coord.broadcast(Event(group_id, StartCommit("after-open")))
    got: list[Event] = []
    deadline = time.monotonic() + 20
    while StartCommit("after-open") not in [e.payload for e in got]:
        assert time.monotonic() < deadline, f"the broadcast never arrived (got {got})"
        got.extend(writer.poll_broadcasts(0.2))
    assert [e.payload for e in got] == [StartCommit("after-open")]
    writer.close()
    coord.close()
