"""The state topic: a small compacted topic holding, per pipeline, the leader lease records
(with their fencing tokens) and, per writer identity, the writer epochs.

Why a topic: Kafka exposes neither the producer epoch nor a consumer group's generation through
confluent-kafka, and both would be lost with the group anyway. Every record here is written in
a transaction of the transactional.id it belongs to (the writer's own, or the pipeline's one
coordinator id), and read with ``read_committed``. Because ``init_transactions`` completes
or aborts every earlier transaction of that id before it returns, a scan made right after it
sees every value an earlier instance committed; the new value is the maximum seen plus one
(and never below the wall clock in milliseconds, so a lost or recreated state topic cannot
make values go back). Brokers that show aborted records only make the maximum larger.
Compaction keeps the newest record per key, which carries the largest value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from icefloe.channel import BackendStatus
from icefloe.errors import ChannelError
from icefloe_kafka.clients import KafkaClients, fetch, group_headers, record_key

log = logging.getLogger(__name__)

LEASE = "lease"
EPOCH = "epoch"
ACQUIRE, HEARTBEAT, RELEASE = "acquire", "heartbeat", "release"


def lease_key(group_id: str) -> bytes:
    return record_key(LEASE, group_id)


def epoch_key(group_id: str, writer_id: str) -> bytes:
    return record_key(EPOCH, group_id, writer_id)


@dataclass(frozen=True)
class StateValue:
    """One state record's value: a counter and, for leases, who wrote it and why."""

    value: int
    holder: str = ""
    status: str = ""
    partition: int | None = None  # writers: the control-topic partition pinned at registration

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "v": 1,
            "value": self.value,
            "holder": self.holder,
            "status": self.status,
        }
        if self.partition is not None:
            body["partition"] = self.partition
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> StateValue | None:
        """None for anything that is not a state value (a tombstone, a foreign record)."""
        if not data:
            return None
        try:
            body = json.loads(data)
            part = body.get("partition")
            return cls(
                int(body["value"]),
                str(body.get("holder", "")),
                str(body.get("status", "")),
                None if part is None else int(part),
            )
        except (ValueError, KeyError, TypeError):
            return None


def next_value(highest: int) -> int:
    """Above every value seen, and not below the wall clock (ms), so values keep growing even
    if the state topic were lost."""
    return max(highest + 1, int(time.time() * 1000))


def produce_state(
    clients: KafkaClients, producer: Any, key: bytes, value: StateValue, group_id: str
) -> None:
    producer.produce(
        clients.state_topic, value=value.encode(), key=key, headers=group_headers(group_id)
    )


def _is_eof(msg: Message) -> bool:
    err = msg.error()
    return err is not None and err.code() == KafkaError._PARTITION_EOF


class StateReader:
    """An assign-mode, read_committed consumer of the whole state topic from its beginning.

    ``on_record(key, value, offset)`` sees every committed record in order. ``caught_up``
    turns true once every partition reached its end (last stable offset) at least once.
    """

    def __init__(self, clients: KafkaClients, role: str, fetch_wait_ms: int | None = None) -> None:
        self._clients = clients
        self._consumer: Consumer = clients.consumer(
            clients.consumer_group("state-reader"), role, eof=True, fetch_wait_ms=fetch_wait_ms
        )
        parts = clients.partitions(clients.state_topic)
        # the partitions' leader known to this consumer before they are assigned: otherwise
        # librdkafka may look up the start offset before it has the leader and retry only
        # 500 ms later (half a second of every `icefloe status`, at random)
        try:
            self._consumer.list_topics(clients.state_topic, timeout=clients.timeout)
        except KafkaException as exc:
            raise ChannelError(f"cannot read metadata of the state topic: {exc}") from exc
        self._pending_eof = set(parts)
        #: the broker/producer timestamp (ms) of the record ``on_record`` is being handed
        self.timestamp_ms: int | None = None
        self._consumer.assign(
            [TopicPartition(clients.state_topic, p, OFFSET_BEGINNING) for p in parts]
        )

    @property
    def caught_up(self) -> bool:
        return not self._pending_eof

    def drain(
        self, wait: float, on_record: Callable[[bytes | None, StateValue | None, int], None]
    ) -> int:
        """Hand every record buffered now (waiting up to ``wait`` for the first) to
        ``on_record``; returns how many were handled."""
        handled = 0
        timeout = max(wait, 0.0)
        while True:
            msgs = fetch(self._consumer, 500, timeout)
            if not msgs:
                return handled
            timeout = 0.0
            for msg in msgs:
                if _is_eof(msg):
                    self._pending_eof.discard(msg.partition() or 0)
                    continue
                err = msg.error()
                if err is not None:
                    if err.fatal():
                        raise ChannelError(f"reading the state topic failed: {err.str()}")
                    log.warning("state topic read error: %s", err.str())
                    continue
                value = msg.value()
                kind, stamp = msg.timestamp()
                self.timestamp_ms = stamp if kind != TIMESTAMP_NOT_AVAILABLE else None
                on_record(
                    msg.key(),
                    StateValue.decode(value if isinstance(value, bytes) else None),
                    msg.offset() or 0,
                )
                handled += 1

    def read_to_end(
        self, on_record: Callable[[bytes | None, StateValue | None, int], None]
    ) -> None:
        """Drain until every partition has reached its end once (fails after the operation
        timeout)."""
        deadline = time.monotonic() + self._clients.timeout
        while not self.caught_up:
            if time.monotonic() > deadline:
                raise ChannelError(
                    f"could not read the state topic '{self._clients.state_topic}' to its end "
                    f"within {self._clients.timeout}s"
                )
            self.drain(0.1, on_record)

    def at_end(self) -> bool:
        """Whether the consumer's position reached every partition's current end (asks the
        broker). Why not EOF events: librdkafka sends one only when it reaches the end, not
        when it already sits there."""
        topic = self._clients.state_topic
        parts = [TopicPartition(topic, p) for p in self._clients.partitions(topic)]
        try:
            positions = self._consumer.position(parts)
            for tp in positions:
                low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, tp.partition), timeout=self._clients.timeout
                )
                if high > low and tp.offset < high:  # tp.offset < 0: nothing read yet
                    return False
        except KafkaException as exc:
            raise ChannelError(f"cannot read the end of the state topic: {exc}") from exc
        return True

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            self._consumer.close()


@contextmanager
def state_reader(clients: KafkaClients, role: str) -> Iterator[StateReader]:
    reader = StateReader(clients, role)
    try:
        yield reader
    finally:
        reader.close()


def highest_value(clients: KafkaClients, key: bytes, role: str) -> int:
    """The largest value ever committed under ``key`` (0 when none), read with a fresh
    consumer to the current end of the state topic."""
    top = highest_record(clients, key, role)
    return 0 if top is None else top.value


def highest_record(clients: KafkaClients, key: bytes, role: str) -> StateValue | None:
    """The record with the largest value ever committed under ``key`` (None when none)."""
    top: StateValue | None = None

    def seen(k: bytes | None, v: StateValue | None, _offset: int) -> None:
        nonlocal top
        if k == key and v is not None and (top is None or v.value >= top.value):
            top = v

    with state_reader(clients, role) as reader:
        reader.read_to_end(seen)
    return top


#: The fetch wait of a reader that reads the state topic to its end once (``icefloe
#: status``): its end shows only when a fetch there returns empty, after this wait
_READ_ONCE_FETCH_WAIT_MS = 10


def pipeline_state(
    clients: KafkaClients, lease_ttl_s: float, probe_timeout_s: float | None = None
) -> BackendStatus:
    """The pipeline's lease and writers as the state topic shows them, for `icefloe status`:
    a fresh assign-mode consumer reads it to its end and writes nothing, so no leader is
    fenced and no lease renewed. Lease times come from the records' timestamps (the writing
    host's clock), so they are estimates when clocks differ."""
    if clients.state_topic not in clients.existing_topics(probe_timeout_s):
        return BackendStatus(writers=())  # nothing ran yet (and asking for it might create it)
    group = clients.group_id
    key = lease_key(group)
    newest: tuple[StateValue, int | None] | None = None
    acquired_ms: dict[int, int] = {}  # token -> timestamp of its acquire record
    writers: set[str] = set()
    reader = StateReader(clients, "status", fetch_wait_ms=_READ_ONCE_FETCH_WAIT_MS)

    def seen(k: bytes | None, v: StateValue | None, _offset: int) -> None:
        nonlocal newest
        if v is None or k is None:
            return
        if k == key:
            newest = (v, reader.timestamp_ms)
            if v.status == ACQUIRE and reader.timestamp_ms is not None:
                acquired_ms[v.value] = reader.timestamp_ms
            return
        writer = _writer_of(k, group)
        if writer is not None:
            writers.add(writer)

    try:
        reader.read_to_end(seen)
    finally:
        reader.close()
    if newest is None or newest[0].status == RELEASE:
        return BackendStatus(writers=tuple(sorted(writers)))
    record, stamp = newest
    now_ms = time.time() * 1000
    started = acquired_ms.get(record.value)
    return BackendStatus(
        leader=record.holder or None,
        token=record.value,
        lease_age_s=None if started is None else max(now_ms - started, 0.0) / 1000,
        lease_expires_in_s=None if stamp is None else (stamp - now_ms) / 1000 + lease_ttl_s,
        writers=tuple(sorted(writers)),
    )


def _writer_of(key: bytes, group_id: str) -> str | None:
    """The writer id of an epoch key of ``group_id`` (None for any other key)."""
    try:
        parts = json.loads(key)
    except ValueError:
        return None
    if isinstance(parts, list) and len(parts) == 3 and parts[:2] == [EPOCH, group_id]:
        return str(parts[2])
    return None


class EpochWatch:
    """The newest epoch of every writer of a pipeline, as the state topic holds it; lets the
    coordinator drop answers of fenced writer instances (answers are sent outside transactions,
    see ``KafkaWriterChannel.respond``)."""

    def __init__(self, clients: KafkaClients, role: str) -> None:
        self._clients = clients
        self._reader = StateReader(clients, role)
        self._epochs: dict[str, int] = {}

    def _seen(self, key: bytes | None, value: StateValue | None, _offset: int) -> None:
        if key is None or value is None:
            return
        writer = _writer_of(key, self._clients.group_id)
        if writer is not None and value.value > self._epochs.get(writer, 0):
            self._epochs[writer] = value.value

    def catch_up(self) -> None:
        """Read the state topic to its current end: every epoch committed before this call
        is known afterwards."""
        deadline = time.monotonic() + self._clients.timeout
        self._reader.drain(0.0, self._seen)
        while not self._reader.at_end():
            if time.monotonic() > deadline:
                raise ChannelError(
                    f"could not read the state topic '{self._clients.state_topic}' to its end "
                    f"within {self._clients.timeout}s"
                )
            self._reader.drain(0.02, self._seen)

    def newest(self, writer_id: str) -> int | None:
        return self._epochs.get(writer_id)

    def close(self) -> None:
        self._reader.close()
