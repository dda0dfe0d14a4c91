"""Kafka-specific channel behaviour on the real broker: shared control topic, keys and
partitions, source offsets in the batch transaction, epochs and tokens that outlive the
process, undecodable records, heartbeats and fencing of a paused leader."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from icefloe.channel import ChannelRecord, CoordinatorChannel, WriterBatch
from icefloe.errors import EventDecodeError, NotLeaderError, WriterFencedError
from icefloe.events import (
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    SourcePosition,
    StartCommit,
    WriterRef,
    encode_event,
)
from icefloe_kafka.clients import GROUP_HEADER, record_key
from icefloe_kafka.coordinator_channel import KafkaCoordinatorChannel
from icefloe_kafka.embedded import EmbeddedKafkaBroker

from .conftest import CONTROL_PARTITIONS, LEASE_TTL_S, BackendMaker

DEADLINE_S = 20.0


def batch(group_id: str, ref: WriterRef, seq: int, *positions: SourcePosition) -> WriterBatch:
    f = DataFileMeta(f"file:///t/{ref.writer_id}-{seq}.parquet", 1, 1)
    events = (
        Event(group_id, DataWritten("ns.t", (f,)), ref, seq),
        Event(group_id, DataComplete(tuple(positions)), ref, seq),
    )
    return WriterBatch(ref, seq, events, tuple(positions))


def read_until(
    channel: CoordinatorChannel, want: set[str], deadline_s: float = DEADLINE_S
) -> list[ChannelRecord]:
    """Every record polled until the events ``want`` were all seen."""
    got: list[ChannelRecord] = []
    deadline = time.monotonic() + deadline_s
    while not want <= {r.event.event_id for r in got}:
        assert time.monotonic() < deadline, f"read {len(got)} records, missing events"
        got.extend(channel.poll(0.2))
    return got


def leader(backend_maker: BackendMaker, group_id: str, name: str) -> CoordinatorChannel:
    ch = backend_maker(group_id).coordinator(name)
    assert ch.acquire(DEADLINE_S) is not None
    return ch


def test_pipelines_share_one_topic_and_each_writer_keeps_one_partition(
    make_backend: BackendMaker,
) -> None:
    groups = [f"share-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    backends = {g: make_backend(g) for g in groups}
    published: dict[str, list[str]] = {}
    for g, backend in backends.items():
        for i in range(2):
            w = backend.writer(f"w{i}")
            ref = WriterRef(f"w{i}", w.open())
            for seq in range(2):
                one = batch(g, ref, seq)
                assert w.publish(one)
                published.setdefault(g, []).extend(e.event_id for e in one.events)
            w.close()
    a, b = groups
    coord = backends[a].coordinator("c")
    assert coord.acquire(DEADLINE_S) is not None
    coord.seek(None)
    recs = read_until(coord, set(published[a]) | set(published[b]))
    mine = [r for r in recs if r.event.group_id == a]
    assert sorted(r.event.event_id for r in mine) == sorted(published[a])
    partitions_of: dict[str, set[str]] = {}
    for r in mine:
        assert r.event.writer is not None
        partitions_of.setdefault(r.event.writer.writer_id, set()).add(r.partition)
    assert all(len(p) == 1 for p in partitions_of.values()), partitions_of
    assert {p for ps in partitions_of.values() for p in ps} <= {
        str(i) for i in range(CONTROL_PARTITIONS)
    }
    # broadcasts reach only the writers of their own pipeline
    wa, wb = backends[a].writer("x"), backends[b].writer("x")
    wa.open()
    wb.open()
    other = backends[b].coordinator("c")
    assert other.acquire(DEADLINE_S) is not None
    other.broadcast(Event(b, StartCommit("for-b")))
    coord.broadcast(Event(a, StartCommit("for-a")))
    got: list[Event] = []
    deadline = time.monotonic() + DEADLINE_S
    while not any(e.payload == StartCommit("for-a") for e in got):
        assert time.monotonic() < deadline
        got.extend(wa.poll_broadcasts(0.2))
    assert all(e.group_id == a for e in got)
    for ch in (wa, wb, other, coord):
        ch.close()


def test_source_offsets_commit_in_the_batch_transaction_and_never_for_a_fenced_writer(
    make_backend: BackendMaker, kafka_broker: EmbeddedKafkaBroker, group_id: str
) -> None:
    source, source_group = f"src-{uuid.uuid4().hex[:8]}", f"src-group-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    for f in admin.create_topics([NewTopic(source, 2, 1)]).values():
        f.result(timeout=20)
    backend = make_backend(group_id, source_consumer_group=source_group)
    reader = Consumer(
        {
            "bootstrap.servers": kafka_broker.bootstrap_servers,
            "group.id": source_group,
            "isolation.level": "read_committed",
        }
    )

    def committed() -> dict[int, int]:
        tps = reader.committed([TopicPartition(source, p) for p in (0, 1)], timeout=20)
        return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}

    old = backend.writer("w")
    old_ref = WriterRef("w", old.open())
    assert old.publish(batch(group_id, old_ref, 1, SourcePosition(source, 0, 42, None)))
    assert committed() == {0: 42}
    new = backend.writer("w")
    new_ref = WriterRef("w", new.open())
    with pytest.raises(WriterFencedError):
        old.publish(batch(group_id, old_ref, 2, SourcePosition(source, 0, 99, None)))
    assert committed() == {0: 42}, "a fenced writer moved the source offsets"
    both = (SourcePosition(source, 0, 50, None), SourcePosition(source, 1, 7, None))
    assert new.publish(batch(group_id, new_ref, 2, *both))
    assert committed() == {0: 50, 1: 7}
    reader.close()
    old.close()
    new.close()


def test_epochs_and_tokens_grow_across_processes(make_backend: BackendMaker, group_id: str) -> None:
    """Each backend object stands for a new process: nothing is remembered in memory."""
    before_ms = int(time.time() * 1000)
    epochs = []
    for _ in range(3):
        w = make_backend(group_id).writer("w")
        epochs.append(w.open())
        w.close()
    assert epochs == sorted(set(epochs))
    assert epochs[0] >= before_ms, "epochs never fall below the wall clock in ms"
    tokens = []
    for i in range(3):
        c = make_backend(group_id).coordinator(f"c{i}")
        lease = c.acquire(DEADLINE_S)
        assert lease is not None
        tokens.append(lease.token)
        c.close()  # releases: the next one takes over at once
    assert tokens == sorted(set(tokens))


def raw_producer(kafka_broker: EmbeddedKafkaBroker) -> Producer:
    return Producer({"bootstrap.servers": kafka_broker.bootstrap_servers})


def poll_until_decode_error(
    coord: CoordinatorChannel, group_id: str
) -> tuple[list[str], EventDecodeError | None]:
    """Event ids of the pipeline polled until a decode error (or the deadline)."""
    seen: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            seen.extend(r.event.event_id for r in coord.poll(0.2) if r.event.group_id == group_id)
        except EventDecodeError as exc:
            return seen, exc
    return seen, None


def test_foreign_garbage_is_skipped_but_a_corrupt_event_of_the_pipeline_stops_reading(
    make_backend: BackendMaker, kafka_broker: EmbeddedKafkaBroker, group_id: str
) -> None:
    backend = make_backend(group_id)
    coord = backend.coordinator("c")
    assert coord.acquire(DEADLINE_S) is not None
    topic = backend.config.control_topic
    ref = WriterRef("w", 1)
    good = [Event(group_id, DataComplete((), None), ref, i) for i in range(3)]
    p = raw_producer(kafka_broker)
    key = record_key(group_id, "w")
    own: list[tuple[str, str | bytes | None]] = [(GROUP_HEADER, group_id.encode())]
    p.produce(topic, encode_event(good[0]), key, partition=0, headers=own)
    p.produce(topic, b"not an event", key, partition=0)  # no header: not icefloe's
    p.produce(topic, b"IFgarbage", key, partition=0, headers=[(GROUP_HEADER, b"other")])
    p.produce(topic, encode_event(good[1]), key, partition=0, headers=own)
    p.produce(topic, b"IF\x01corrupt", key, partition=0, headers=own)
    p.produce(topic, encode_event(good[2]), key, partition=0, headers=own)
    assert p.flush(20) == 0
    coord.seek(None)
    seen, error = poll_until_decode_error(coord, group_id)
    assert error is not None, "the corrupt event was never reported"
    assert "[0]@" in str(error)
    assert seen == [good[0].event_id, good[1].event_id], "records before it are delivered"
    again, error = poll_until_decode_error(coord, group_id)
    assert error is not None, "a corrupt event of the pipeline was skipped"
    assert again == []
    coord.close()


def test_reading_keeps_the_lease_and_a_paused_leader_is_fenced(
    make_backend: BackendMaker, group_id: str
) -> None:
    c1 = leader(make_backend, group_id, "c1")
    c2 = make_backend(group_id).coordinator("c2")
    # while c1 keeps reading, c2 never gets the lease (three TTLs)
    until = time.monotonic() + 3 * LEASE_TTL_S
    while time.monotonic() < until:
        c1.poll(0.1)
        assert c2.acquire(0.05) is None, "a reading leader lost its lease"
    stored = {"0": 1}
    c1.store_position(stored)
    # c1 pauses: c2 takes over after one TTL of silence
    lease2 = c2.acquire(DEADLINE_S)
    assert lease2 is not None
    c1.poll(0.1)  # reading stays possible for a deposed leader
    with pytest.raises(NotLeaderError):
        c1.renew()
    with pytest.raises(NotLeaderError):
        c1.store_position({"0": 100})
    with pytest.raises(NotLeaderError):
        c1.broadcast(Event(group_id, StartCommit("stale")))
    assert dict(c2.stored_position() or {}) == stored
    c1.close()
    c2.close()


def test_a_takeover_fences_the_old_leader_even_before_its_lease_runs_out(
    make_backend: BackendMaker, group_id: str
) -> None:
    """The Kafka fence alone, without lease timing: a candidate that takes over at once (as if
    clocks lied) still leaves the old leader unable to store a position or broadcast."""
    c1 = leader(make_backend, group_id, "c1")
    c1.store_position({"0": 3})
    c2 = make_backend(group_id).coordinator("c2")
    assert isinstance(c2, KafkaCoordinatorChannel)
    lease2 = c2._take_over()  # skip the wait for c1's lease to expire
    assert lease2 is not None
    with pytest.raises(NotLeaderError):
        c1.store_position({"0": 100})
    with pytest.raises(NotLeaderError):
        c1.broadcast(Event(group_id, StartCommit("stale")))
    with pytest.raises(NotLeaderError):
        c1.renew()  # the failed store already told c1
    assert dict(c2.stored_position() or {}) == {"0": 3}
    c1.close()
    c2.close()


def test_writers_skip_other_writers_batches_without_decoding_them(
    make_backend: BackendMaker, group_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared broadcast reader reads the whole control topic: decoding every writer's
    batches made a cycle with many writers take seconds. It decodes each broadcast once, for
    all writers of the process."""
    import icefloe_kafka.broadcasts as broadcasts_module

    decoded: list[bytes] = []
    real_decode = broadcasts_module.decode_event  # type: ignore[attr-defined]  # as it uses it

    def counting_decode(data: bytes) -> Event:
        decoded.append(data)
        return real_decode(data)

    monkeypatch.setattr(broadcasts_module, "decode_event", counting_decode)
    backend = make_backend(group_id)
    listener, busy = backend.writer("listener"), backend.writer("busy")
    listener.open()
    ref = WriterRef("busy", busy.open())
    for seq in range(30):
        busy.publish(batch(group_id, ref, seq))
    coordinator = leader(make_backend, group_id, "c1")
    coordinator.broadcast(Event(group_id, StartCommit("cycle-1")))

    for writer in (listener, busy):
        got: list[Event] = []
        deadline = time.monotonic() + DEADLINE_S
        while not any(isinstance(e.payload, StartCommit) for e in got):
            assert time.monotonic() < deadline, "the StartCommit broadcast never arrived"
            got.extend(writer.poll_broadcasts(0.2))
        assert [e.payload for e in got] == [StartCommit("cycle-1")]
    assert len(decoded) == 1, f"decoded {len(decoded)} records to find 1 broadcast"


def test_a_batch_above_the_record_limit_is_refused_whole_and_clearly(
    make_backend: BackendMaker, group_id: str
) -> None:
    from icefloe_kafka.errors import BatchTooLargeError

    limit = 100_000
    backend = make_backend(group_id, kafka={"message.max.bytes": str(limit)})
    writer = backend.writer("wide")
    ref = WriterRef("wide", writer.open())

    def files(n: int) -> tuple[DataFileMeta, ...]:  # random names: compression cannot hide them
        return tuple(
            DataFileMeta(f"file:///t/{uuid.uuid4().hex}{uuid.uuid4().hex}.parquet", 1, 1)
            for _ in range(n)
        )

    small = Event(group_id, DataWritten("ns.small", files(3)), ref, 0)
    huge = Event(group_id, DataWritten("ns.huge", files(3000)), ref, 0)
    done = Event(group_id, DataComplete(()), ref, 0)
    with pytest.raises(BatchTooLargeError, match=r"'ns\.huge'.*100,000 bytes") as info:
        writer.publish(WriterBatch(ref, 0, (small, huge, done)))
    assert info.value.size > limit
    assert info.value.table == "ns.huge"

    ok = batch(group_id, ref, 1)  # the writer is still usable; the refused batch left nothing
    assert writer.publish(ok)
    coordinator = leader(make_backend, group_id, "c1")
    got = {r.event.event_id for r in read_until(coordinator, {e.event_id for e in ok.events})}
    assert not got & {small.event_id, huge.event_id, done.event_id}


class _SmallFetches:
    """The real consumer, handing out at most ``n`` records per consume: what a client does
    when one transaction's records arrive in several fetch responses."""

    def __init__(self, consumer: Consumer, n: int) -> None:
        self._consumer, self._n = consumer, n

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        return self._consumer.consume(min(num_messages, self._n), timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_a_poll_never_ends_inside_a_batch_that_arrives_in_several_fetches(
    make_backend: BackendMaker, group_id: str
) -> None:
    tables = 12
    backend = make_backend(group_id)
    w = backend.writer("w")
    ref = WriterRef("w", w.open())
    files = [(DataFileMeta(f"file:///t/{i}.parquet", 1, 1),) for i in range(tables)]
    events = (
        *(Event(group_id, DataWritten(f"ns.t{i}", files[i]), ref, 0) for i in range(tables)),
        Event(group_id, DataComplete(()), ref, 0),
    )
    assert w.publish(WriterBatch(ref, 0, events))
    coord = backend.coordinator("c")
    assert isinstance(coord, KafkaCoordinatorChannel)
    assert coord.acquire(DEADLINE_S) is not None
    coord.seek(None)
    coord._data = _SmallFetches(coord._data_consumer(), 5)  # type: ignore[assignment]
    deadline = time.monotonic() + DEADLINE_S
    mine: list[ChannelRecord] = []
    while not mine:
        assert time.monotonic() < deadline, "the batch never arrived"
        mine = [r for r in coord.poll(0.2) if r.event.group_id == group_id and r.event.writer]
    assert [r.event.event_id for r in mine] == [e.event_id for e in events]
