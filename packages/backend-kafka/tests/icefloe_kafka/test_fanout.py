"""Many writers in one process (issue 15's fan-out) and the fencing of answers, which are sent
outside transactions: against the real broker, counted with pyiceberg."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import ChannelRecord, CoordinatorChannel, WriterChannel
from icefloe.errors import WriterFencedError
from icefloe.events import CommitToTable, DataComplete, Event, StartCommit, WriterRef
from icefloe.testing.conformance import make_batch
from icefloe.testing.harness import fan_out_cycle
from icefloe_kafka import KafkaBackend

from .conftest import BackendMaker

WRITERS = 64  # 64 producers + 1 shared consumer in this process; 256 is the benchmark's job


def test_writers_of_one_process_complete_a_cycle_exactly(
    make_backend: BackendMaker, group_id: str, sqlite_catalog: SqlCatalog
) -> None:
    seen = fan_out_cycle(
        make_backend(group_id, lease_ttl_s=30.0), sqlite_catalog, group_id, WRITERS
    )
    assert seen.result.complete, "some writer's answer never reached the coordinator"
    assert not seen.result.failed
    assert seen.answered == WRITERS


@contextlib.contextmanager
def zombie_and_successor(
    backend: KafkaBackend,
) -> Iterator[tuple[WriterChannel, WriterRef, WriterChannel, WriterRef, CoordinatorChannel]]:
    """Two instances of writer ``w`` opened one after the other (the first is fenced) and a
    coordinator end, all closed afterwards."""
    old, new = backend.writer("w"), backend.writer("w")
    coordinator = backend.coordinator("c")
    try:
        old_ref = WriterRef("w", old.open())
        yield old, old_ref, new, WriterRef("w", new.open()), coordinator
    finally:
        for ch in (old, new, coordinator):
            ch.close()


def test_an_answer_of_a_fenced_instance_never_reaches_the_coordinator(
    make_backend: BackendMaker, group_id: str
) -> None:
    with zombie_and_successor(make_backend(group_id)) as (old, old_ref, new, new_ref, coordinator):
        # the old instance has not published since, so it has not noticed the fencing: its
        # answer may be appended (no transaction), after the new instance's epoch record
        with contextlib.suppress(WriterFencedError):
            old.respond(Event(group_id, DataComplete((), "c1"), old_ref, None))
        new.respond(Event(group_id, DataComplete((), "c1"), new_ref, None))
        assert coordinator.acquire(30.0) is not None
        coordinator.seek(None)
        recs: list[ChannelRecord] = []
        deadline = time.monotonic() + 60
        while not any(r.event.writer == new_ref for r in recs):
            assert time.monotonic() < deadline, f"the new instance's answer never came: {recs}"
            recs.extend(r for r in coordinator.poll(0.5) if r.event.group_id == group_id)
        assert [r.event.writer for r in recs] == [new_ref]


def test_the_channel_end_lies_past_every_answer_sent_at_once(
    make_backend: BackendMaker, group_id: str
) -> None:
    """Answers of many writers leave one shared producer together. A broker may report the end
    of a partition as the base offset of its last record batch + 1 (the bundled Tansu does), so
    several answers in one batch would put records past the reported end, and the channel-reset
    check would then stop a healthy pipeline. The end must lie past every record read."""
    backend = make_backend(group_id)
    writers = [backend.writer(f"w{i}") for i in range(16)]
    coordinator = backend.coordinator("c")
    try:
        refs = [WriterRef(f"w{i}", w.open()) for i, w in enumerate(writers)]
        with ThreadPoolExecutor(len(writers)) as pool:
            list(
                pool.map(
                    lambda i: writers[i].respond(
                        Event(group_id, DataComplete((), "c1"), refs[i], None)
                    ),
                    range(len(writers)),
                )
            )
        assert coordinator.acquire(30.0) is not None
        coordinator.seek(None)
        recs: list[ChannelRecord] = []
        deadline = time.monotonic() + 60
        while len({r.event.writer for r in recs if r.event.writer}) < len(writers):
            assert time.monotonic() < deadline, f"answers missing: {recs}"
            recs.extend(r for r in coordinator.poll(0.5) if r.event.group_id == group_id)
        end = coordinator.end_position()
        past = [(r.partition, r.offset) for r in recs if r.offset >= end.get(r.partition, 0)]
        assert not past, f"records at or past the reported end {end}: {past}"
    finally:
        channels: list[WriterChannel | CoordinatorChannel] = [*writers, coordinator]
        for ch in channels:
            ch.close()


def librdkafka_clients() -> int:
    """librdkafka clients alive in this process: each runs exactly one thread named
    ``rdk:main`` (Linux names threads in /proc)."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names.count("rdk:main")


def test_writers_of_one_process_share_one_broadcast_consumer(
    make_backend: BackendMaker, group_id: str
) -> None:
    """One transactional producer per writer (its fencing needs its own transactional.id),
    but one broadcast consumer for all of them: not a consumer per writer."""
    backend = make_backend(group_id)
    backend.clients.ensure_topics()  # the admin client exists before counting
    before = librdkafka_clients()
    writers = [backend.writer(f"w{i}") for i in range(16)]
    try:
        for w in writers:
            w.open()
        added = librdkafka_clients() - before
        assert added <= len(writers) + 1, (
            f"{added} librdkafka clients for {len(writers)} writers: the writers of one "
            "backend must share one broadcast consumer"
        )
    finally:
        for w in writers:
            w.close()


def broadcasts_until(writer: WriterChannel, want: set[str]) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + 60
    while not want <= got:
        assert time.monotonic() < deadline, f"broadcasts {want - got} never arrived"
        got.update(e.event_id for e in writer.poll_broadcasts(0.2))
    return got


def test_a_shared_consumer_serves_every_writer_and_outlives_a_closed_one(
    make_backend: BackendMaker, group_id: str
) -> None:
    backend = make_backend(group_id)
    writers = [backend.writer(f"w{i}") for i in range(3)]
    coordinator = backend.coordinator("c")
    late: WriterChannel | None = None
    try:
        for w in writers:
            w.open()
        assert coordinator.acquire(30.0) is not None
        first = Event(group_id, StartCommit("one"))
        coordinator.broadcast(first)
        for w in writers:
            broadcasts_until(w, {first.event_id})
        writers[0].close()  # the others go on with the shared consumer
        late = backend.writer("late")
        late.open()
        second = Event(group_id, CommitToTable("one", "db.t", 1))
        coordinator.broadcast(second)
        for w in (*writers[1:], late):
            broadcasts_until(w, {second.event_id})
    finally:
        channels: list[WriterChannel | CoordinatorChannel] = [*writers, *([late] if late else [])]
        channels.append(coordinator)
        for ch in channels:
            ch.close()


def test_a_writer_reopened_after_its_consumer_was_closed_reads_broadcasts_again(
    make_backend: BackendMaker, group_id: str
) -> None:
    """The last writer's close stops the shared consumer; the next open starts it again."""
    backend = make_backend(group_id)
    writer = backend.writer("w")
    coordinator = backend.coordinator("c")
    try:
        writer.open()
        writer.close()
        writer.open()
        assert coordinator.acquire(30.0) is not None
        sent = Event(group_id, StartCommit("again"))
        coordinator.broadcast(sent)
        broadcasts_until(writer, {sent.event_id})
    finally:
        for ch in (writer, coordinator):
            ch.close()


def test_a_zombie_sharing_the_consumer_stays_fenced_and_its_close_spares_the_successor(
    make_backend: BackendMaker, group_id: str
) -> None:
    """Two instances of one writer id in one process (a restarted writer whose predecessor
    lingers): both read through the shared consumer, the old one can no longer publish, and
    closing it does not stop the new one's broadcasts."""
    with zombie_and_successor(make_backend(group_id)) as (old, old_ref, new, new_ref, coordinator):
        assert new_ref.epoch > old_ref.epoch
        with pytest.raises(WriterFencedError):
            old.publish(make_batch(group_id, old_ref, 0))
        old.close()
        assert new.publish(make_batch(group_id, new_ref, 0)) is True
        assert coordinator.acquire(30.0) is not None
        sent = Event(group_id, StartCommit("after-zombie"))
        coordinator.broadcast(sent)
        broadcasts_until(new, {sent.event_id})
