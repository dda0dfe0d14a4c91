"""A change of the control topic's partition count must not move a writer to another partition
(the coordinator reads partitions independently, so a later batch could be read first and an
earlier one dropped as a replay).

The embedded broker (Tansu) does not implement CreatePartitions, so the count is changed by
deleting the topic and creating it again with more partitions; what is checked is the same:
the writer's next batches go to the partition recorded when it registered, not to
``hash(key) % new count``."""

from __future__ import annotations

import time
import uuid
import zlib

from icefloe.channel import ChannelRecord
from icefloe.events import WriterRef
from icefloe.testing.conformance import make_batch
from icefloe_kafka.clients import record_key

from .conftest import BackendMaker
from .conftest import recreate_control_topic as recreate

BEFORE, AFTER = 2, 6


def writer_that_moves(group_id: str) -> str:
    """A writer id whose key hashes to another partition once the topic has AFTER partitions
    (the default partitioner is crc32(key) % count): without pinning it would move."""
    for i in range(1000):
        wid = f"w{i}"
        crc = zlib.crc32(record_key(group_id, wid))
        if crc % BEFORE != crc % AFTER:
            return wid
    raise AssertionError("no such writer id")


def test_writer_keeps_its_partition_when_partitions_are_added(
    make_backend: BackendMaker, group_id: str
) -> None:
    topic = f"ctl-{uuid.uuid4().hex[:8]}"
    backend = make_backend(group_id, control_topic=topic, partitions=BEFORE)
    wid = writer_that_moves(group_id)
    first = backend.writer(wid)
    ref = WriterRef(wid, first.open())
    for seq in (0, 1):
        first.publish(make_batch(group_id, ref, seq))
    first.close()

    recreate(backend)
    # a restarted writer (new producer, fresh metadata) publishes the next batches
    later = make_backend(group_id, control_topic=topic, partitions=AFTER).writer(wid)
    ref = WriterRef(wid, later.open())
    for seq in (2, 3):
        later.publish(make_batch(group_id, ref, seq))
    later.close()

    coord = backend.coordinator("c")
    assert coord.acquire(20) is not None
    coord.seek(None)
    got: list[ChannelRecord] = []
    deadline = time.monotonic() + 30
    while len(got) < 4:  # batches 2 and 3 x (DataWritten + DataComplete)
        assert time.monotonic() < deadline, f"read only {len(got)} events"
        got.extend(r for r in coord.poll(0.2) if r.event.group_id == group_id)
    assert len(backend.clients.partitions(topic)) == AFTER
    pinned = str(zlib.crc32(record_key(group_id, wid)) % BEFORE)
    assert {r.partition for r in got} == {pinned}
    assert [r.event.batch_seq for r in got] == [2, 2, 3, 3]
    coord.close()
