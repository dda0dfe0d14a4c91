"""The coordinator's end of the Kafka control topic: leader election, reading, broadcasts and
stored positions.

Election (see ``docs/backends/kafka.md`` for the full argument):

* Every coordinator of a pipeline uses one shared ``transactional.id``
  (``<transactional_id_prefix>-<group>-coordinator``). Taking over starts with
  ``init_transactions``: Kafka then aborts whatever the previous leader had open and rejects
  every later transactional request of the previous leader's producer. So after a takeover the
  old leader can neither broadcast, nor store a position, nor write a lease record.
* The lease lives in the compacted state topic: the leader writes an ``acquire`` record with
  its fencing token, then a ``heartbeat`` record every ``heartbeat_interval_s`` (default
  TTL / 3) while it keeps calling ``renew``/``poll``, and a ``release`` record when it steps
  down. A candidate reads the state topic and takes over only when the newest lease record of
  the pipeline is a release, or when it has seen no new lease record for a whole TTL, measured
  on its own monotonic clock from the moment it read the newest one. No clocks are compared
  across hosts.
* The fencing token is read after ``init_transactions`` (so every token an earlier leader
  committed is visible) and set to the maximum seen plus one (never below the wall clock in
  ms), then committed in the ``acquire`` record. If that commit is fenced, a later candidate
  won and this one returns None. Tokens of successful leaders therefore strictly grow.
* A heartbeat that commits proves nobody has taken over since (a takeover fences it first), so
  ``renew`` returns a lease valid for one TTL from the heartbeat's start. A paused leader that
  wakes up fails its next heartbeat, broadcast or position store with NotLeaderError, and its
  Iceberg commits are refused by the higher token in the table property (invariant 3).

Reading: an assign-mode consumer of every control-topic partition with ``read_committed``.
Positions are ``{partition: next offset}`` and are stored as the offsets of the consumer
group ``<consumer_group_prefix>-<group>-coordinator`` through ``send_offsets_to_transaction``
in a transaction of the leader's producer, so a fenced leader cannot store a position.
Records of other pipelines are returned too (the coordinator skips them and advances its
position past them); records without icefloe's group header that do not decode are not
icefloe's and are skipped; an undecodable record of this pipeline stops reading with
:class:`EventDecodeError`, at that record, on every poll.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from icefloe.channel import ChannelPosition, ChannelRecord, CoordinatorChannel, Lease
from icefloe.errors import ChannelError, ChannelResetError, EventDecodeError, NotLeaderError
from icefloe.events import DataComplete, DataWritten, Event, decode_event, encode_event
from icefloe_kafka.broadcasts import broadcast_key
from icefloe_kafka.clients import (
    KafkaClients,
    fetch,
    group_headers,
    header_group,
    log_bounds,
    run_transaction,
)
from icefloe_kafka.state import (
    ACQUIRE,
    HEARTBEAT,
    RELEASE,
    EpochWatch,
    StateReader,
    StateValue,
    highest_value,
    lease_key,
    next_value,
    produce_state,
)

log = logging.getLogger("icefloe_kafka.coordinator")

_BATCH_TAIL_S = 5.0  # longest wait for the rest of a batch a consume ended inside


def _inside_batch(records: list[ChannelRecord]) -> bool:
    """Whether the last record read of some writer (per partition) is a DataWritten, whose
    batch's DataComplete (always its last event) has not been read yet. Per writer, because
    other writers' records (batches, answers) may sit between a batch's records."""
    last: dict[tuple[str, str | None], ChannelRecord] = {}
    for r in records:
        ref = r.event.writer
        last[r.partition, None if ref is None else ref.writer_id] = r
    return any(isinstance(r.event.payload, DataWritten) for r in last.values())


def _is_answer(event: Event) -> bool:
    """A writer's answer to a StartCommit (sent outside transactions)."""
    return (
        event.writer is not None
        and isinstance(event.payload, DataComplete)
        and event.payload.commit_id is not None
    )


class KafkaCoordinatorChannel(CoordinatorChannel):
    """One coordinator process's end; see the module docstring."""

    def __init__(
        self,
        clients: KafkaClients,
        coordinator_id: str,
        lease_ttl_s: float,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        self._clients = clients
        self._group_id = clients.group_id
        self._id = coordinator_id
        # two channels with one coordinator_id are still two contenders
        self._instance = f"{coordinator_id}/{uuid.uuid4().hex[:12]}"
        self._ttl = lease_ttl_s
        self._heartbeat_every = heartbeat_interval_s or lease_ttl_s / 3
        self._txn_id = clients.transactional_id("coordinator")
        self._lease_key = lease_key(self._group_id)
        self._role = f"coordinator-{coordinator_id}"
        self._lock = threading.RLock()
        # election: what this candidate has seen of the pipeline's lease records
        self._observer: StateReader | None = None
        self._seen: StateValue | None = None
        self._seen_offset = -1
        self._seen_at = 0.0
        self._max_token = 0
        # leadership
        self._lease: Lease | None = None
        self._producer: Producer | None = None
        self._last_heartbeat = 0.0
        # reading
        self._data: Consumer | None = None
        self._ends: Consumer | None = None  # read_uncommitted, for end_position() only
        self._sought = False
        self._from_start: dict[int, int | None] = {}  # sought from the log start: its offset
        self._epochs: EpochWatch | None = None  # drops answers of fenced writer instances

    # ------------------------------------------------------------------ election

    def acquire(self, timeout: float) -> Lease | None:
        with self._lock:
            if self._lease is not None:
                try:
                    return self.renew()
                except NotLeaderError:
                    pass  # lost meanwhile: compete again below
            deadline = time.monotonic() + max(timeout, 0.0)
            if self._observer is None:
                self._clients.ensure_topics()
                self._observer = StateReader(self._clients, self._role)
            while True:
                left = deadline - time.monotonic()
                self._observer.drain(min(max(left, 0.0), 0.05), self._observe)
                if self._observer.caught_up and self._lease_expired():
                    lease = self._take_over()
                    if lease is not None:
                        return lease
                if time.monotonic() >= deadline:
                    return None

    def _observe(self, key: bytes | None, value: StateValue | None, offset: int) -> None:
        if key != self._lease_key or value is None or offset <= self._seen_offset:
            return
        self._seen, self._seen_offset, self._seen_at = value, offset, time.monotonic()
        self._max_token = max(self._max_token, value.value)

    def _lease_expired(self) -> bool:
        seen = self._seen
        if seen is None:
            return True  # this pipeline never had a leader
        if seen.status == RELEASE and seen.value >= self._max_token:
            return True  # the newest leader stepped down
        return time.monotonic() - self._seen_at >= self._ttl

    def _forget_observations(self) -> None:
        if self._observer is not None:
            self._observer.close()
        self._observer = None
        self._seen, self._seen_offset, self._seen_at = None, -1, 0.0

    def _take_over(self) -> Lease | None:
        producer = self._clients.producer(self._txn_id, self._role)
        started = time.monotonic()
        try:
            producer.init_transactions(self._clients.timeout)  # fences the previous leader
        except KafkaException as exc:
            raise ChannelError(f"{self._id}: init_transactions failed: {exc}") from exc
        top = highest_value(self._clients, self._lease_key, self._role)
        token = next_value(max(top, self._max_token))
        record = StateValue(token, self._instance, ACQUIRE)
        try:
            run_transaction(
                producer,
                lambda: produce_state(
                    self._clients, producer, self._lease_key, record, self._group_id
                ),
                self._clients.timeout,
                lambda text: NotLeaderError(f"{self._id}: a newer candidate won: {text}"),
            )
        except NotLeaderError as exc:
            log.info("%s", exc)
            # someone took over just now: give it a full TTL instead of fencing it right back
            self._seen = StateValue(self._max_token, "", ACQUIRE)
            self._seen_at = time.monotonic()
            return None
        self._producer = producer
        self._lease = Lease(token, self._id, started + self._ttl)
        self._last_heartbeat = started
        self._forget_observations()  # a leader needs no observer; a new one starts fresh
        log.info("%s leads pipeline %s with token %d", self._id, self._group_id, token)
        return self._lease

    def _lost(self, text: str) -> NotLeaderError:
        """Forget leadership after a fencing error and say why."""
        token = self._lease.token if self._lease else None
        self._lease = None
        self._producer = None
        return NotLeaderError(f"{self._id} (token {token}) was fenced by a newer leader: {text}")

    def _leader(self) -> tuple[Producer, Lease]:
        if self._lease is None or self._producer is None:
            raise NotLeaderError(f"{self._id} does not hold the lease of {self._group_id}")
        return self._producer, self._lease

    def _transact(self, body: Callable[[Producer], None]) -> None:
        """Run ``body`` in a transaction of the leader's producer; fencing -> NotLeaderError."""
        producer, _ = self._leader()
        run_transaction(producer, lambda: body(producer), self._clients.timeout, self._lost)

    def _write_lease(self, status: str, also: Callable[[Producer], None] | None = None) -> None:
        """Commit a lease record of ours (plus whatever ``also`` adds) in one transaction."""
        _, lease = self._leader()
        record = StateValue(lease.token, self._instance, status)

        def body(producer: Producer) -> None:
            produce_state(self._clients, producer, self._lease_key, record, self._group_id)
            if also is not None:
                also(producer)

        self._transact(body)

    def _heartbeat(self, also: Callable[[Producer], None] | None = None) -> Lease:
        """A committed heartbeat proves nobody took over: the lease runs one TTL from its
        start."""
        started = time.monotonic()
        self._write_lease(HEARTBEAT, also)
        _, lease = self._leader()
        self._last_heartbeat = started
        self._lease = Lease(lease.token, self._id, started + self._ttl)
        return self._lease

    def renew(self) -> Lease:
        with self._lock:
            _, lease = self._leader()
            if time.monotonic() - self._last_heartbeat < self._heartbeat_every:
                return lease
            try:
                return self._heartbeat()
            except NotLeaderError:
                raise
            except ChannelError as exc:
                if time.monotonic() >= lease.expires_at:
                    self._lease, self._producer = None, None
                    raise NotLeaderError(
                        f"{self._id}: lease expired, heartbeats failing: {exc}"
                    ) from exc
                log.warning("%s: heartbeat failed, lease still valid: %s", self._id, exc)
                return lease

    def _heartbeat_if_due(self) -> None:
        """From poll(): keep the lease alive while the coordinator keeps reading."""
        if self._lease is None or time.monotonic() - self._last_heartbeat < self._heartbeat_every:
            return
        try:
            self._heartbeat()
        except NotLeaderError as exc:
            log.warning("%s", exc)  # renew() reports it to the coordinator
        except ChannelError as exc:
            log.warning("%s: heartbeat failed: %s", self._id, exc)

    def release(self) -> None:
        with self._lock:
            if self._lease is None:
                return
            try:
                self._write_lease(RELEASE)
            except ChannelError as exc:  # fenced or unreachable: the lease ends by TTL then
                log.info("%s: release record not written: %s", self._id, exc)
            finally:
                self._lease, self._producer = None, None

    @property
    def is_leader(self) -> bool:
        return self._lease is not None

    # ------------------------------------------------------------------ reading

    def _data_consumer(self) -> Consumer:
        if self._data is None:
            self._clients.ensure_topics()
            self._data = self._clients.consumer(
                self._clients.consumer_group("coordinator"), self._role
            )
        return self._data

    def seek(self, position: ChannelPosition | None) -> None:
        with self._lock:
            consumer = self._data_consumer()
            topic = self._clients.control_topic
            parts = self._clients.partitions(topic)
            unknown = set(position or {}) - {str(p) for p in parts}
            if unknown:
                log.warning(
                    "%s: position names partitions %s that %s lacks", self._id, unknown, topic
                )
            start = []
            self._from_start = {}
            for p in parts:
                offset = None if position is None else position.get(str(p))
                if offset is None:
                    start.append(TopicPartition(topic, p, OFFSET_BEGINNING))
                    self._from_start[p] = None
                    continue
                self._check_in_log(topic, p, int(offset))
                start.append(TopicPartition(topic, p, int(offset)))
            consumer.assign(start)
            self._sought = True

    def _check_in_log(self, topic: str, partition: int, offset: int) -> None:
        """Refuse a stored position that the partition's log no longer covers."""
        low, high = self._watermarks(topic, partition)
        if offset > high:
            raise ChannelResetError(
                f"the stored position {topic}[{partition}]@{offset} lies past the end of the "
                f"log ({high}): the control topic was deleted and recreated or rolled back, "
                "and batches published before are gone. Restart the writers from a checkpoint "
                "taken before the reset, or see docs/operations.md (channel reset) to accept "
                "the loss"
            )
        if offset < low:
            raise ChannelResetError(
                f"events {topic}[{partition}] {offset}..{low - 1} were deleted by retention "
                "before they were committed; the files they announced are not in any table. "
                "Raise retention.ms of the control topic, and see docs/operations.md "
                "(channel reset) to recover"
            )

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        """Next records; a writer batch is never handed over in parts.

        Why: a transaction becomes visible at once on the broker, but the client may fetch its
        records in two responses, so one ``consume`` can end inside a batch. While the last
        record read of a partition is a DataWritten (a batch ends with its DataComplete), read
        on for up to ``_BATCH_TAIL_S``: the rest is committed and arrives at once. An aborted
        batch without its tail (visible on brokers that do not filter aborted records) only
        costs that wait.
        """
        with self._lock:
            self._heartbeat_if_due()
            if not self._sought:
                self.seek(None)
            consumer = self._data_consumer()
            msgs = fetch(consumer, max(1, max_records), timeout)
            out: list[ChannelRecord] = []
            if self._take(consumer, msgs, out):
                return self._without_fenced_answers(out)
            deadline = time.monotonic() + _BATCH_TAIL_S
            while (
                len(out) < max_records
                and _inside_batch(out)
                and (left := deadline - time.monotonic()) > 0
            ):
                more = fetch(consumer, max_records - len(out), min(left, 0.1))
                if self._take(consumer, more, out):
                    break
            return self._without_fenced_answers(out)

    def _without_fenced_answers(self, records: list[ChannelRecord]) -> list[ChannelRecord]:
        """``records`` minus the answers of writer instances a newer instance has fenced.

        Answers are not transactional (see ``KafkaWriterChannel.respond``), so fencing them is
        done here: the state topic is read to its end after the answer was read, so the epoch
        record of any instance that opened before the answer was appended is known, and an
        answer with a lower epoch is dropped (its position is still passed: it is returned
        as nothing, the next record's offset moves the position on)."""
        mine = [r for r in records if r.event.group_id == self._group_id and _is_answer(r.event)]
        if not mine:
            return records
        if self._epochs is None:
            self._epochs = EpochWatch(self._clients, f"{self._role}-epochs")
        self._epochs.catch_up()
        stale: set[int] = set()
        for r in mine:
            ref = r.event.writer
            assert ref is not None  # _is_answer
            newest = self._epochs.newest(ref.writer_id)
            if newest is not None and ref.epoch < newest:
                log.warning(
                    "%s: dropping the answer of fenced writer %s epoch %d (newest epoch %d)",
                    self._id,
                    ref.writer_id,
                    ref.epoch,
                    newest,
                )
                stale.add(id(r))
        return [r for r in records if id(r) not in stale] if stale else records

    def _take(self, consumer: Consumer, msgs: list[Any], out: list[ChannelRecord]) -> bool:
        """Decode ``msgs`` into ``out``; True when an undecodable record of this pipeline
        stopped the read (it is read again, and raised, by the next poll)."""
        for i, msg in enumerate(msgs):
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise ChannelError(f"reading {self._clients.control_topic} failed: {err.str()}")
                log.warning("%s: read error: %s", self._id, err.str())
                continue
            partition, offset = msg.partition() or 0, msg.offset() or 0
            group = header_group(msg.headers())
            try:
                event = decode_event(msg.value() or b"")
            except EventDecodeError as exc:
                if group != self._group_id:
                    log.debug("skipping a foreign undecodable record at %d@%d", partition, offset)
                    continue  # not this pipeline's record: nothing of ours can be lost
                self._rewind(consumer, msgs[i:])
                if out:
                    return True  # hand over what came before; the next poll raises
                raise EventDecodeError(
                    f"{self._clients.control_topic}[{partition}]@{offset}: {exc}"
                ) from exc
            out.append(ChannelRecord(str(partition), offset, event))
        return False

    def _rewind(self, consumer: Consumer, unread: list[Any]) -> None:
        """Seek back so the first unreturned record of each partition is read again."""
        first: dict[int, int] = {}
        for msg in unread:
            if msg.error() is None:
                p = msg.partition() or 0
                first.setdefault(p, msg.offset() or 0)
        for p, offset in first.items():
            consumer.seek(TopicPartition(self._clients.control_topic, p, offset))

    # ------------------------------------------------------------------ writing

    def broadcast(self, event: Event) -> None:
        self.broadcast_all([event])

    def broadcast_all(self, events: Sequence[Event]) -> None:
        """All in one transaction: a transaction is several round trips to the broker."""
        if not events:
            return
        with self._lock:
            values = [encode_event(event) for event in events]
            key = broadcast_key(self._group_id)  # writers read only this key
            headers = group_headers(self._group_id)

            def body(producer: Producer) -> None:
                for value in values:
                    producer.produce(
                        self._clients.control_topic, value=value, key=key, headers=headers
                    )

            self._transact(body)

    def store_position(self, position: ChannelPosition) -> None:
        """Commit the offsets in one transaction with a lease heartbeat: the record proves the
        lease in the same atomic step, and some brokers (Tansu 0.6) apply the offsets of a
        transaction that produced no record only when a later one commits."""
        with self._lock:
            self._leader()
            topic = self._clients.control_topic
            offsets = [TopicPartition(topic, int(p), int(o)) for p, o in position.items()]
            metadata = self._data_consumer().consumer_group_metadata()
            timeout = self._clients.timeout

            def send_offsets(producer: Producer) -> None:
                if offsets:
                    producer.send_offsets_to_transaction(offsets, metadata, timeout)

            self._heartbeat(send_offsets)

    def stored_position(self) -> ChannelPosition | None:
        with self._lock:
            topic = self._clients.control_topic
            parts = self._clients.partitions(topic)
            try:
                committed = self._data_consumer().committed(
                    [TopicPartition(topic, p) for p in parts], timeout=self._clients.timeout
                )
            except KafkaException as exc:
                raise ChannelError(f"cannot read the stored position: {exc}") from exc
            pos = {
                str(tp.partition): int(tp.offset)
                for tp in committed
                if tp.error is None and tp.offset is not None and tp.offset >= 0
            }
            return pos or None

    def prune(self, before: ChannelPosition) -> int:
        """Retention of the control topic is the broker's (``retention.ms``)."""
        return 0

    def channel_id(self) -> str:
        """Cluster id, topic name and the topic id Kafka gives every newly created topic
        (KIP-516), so a topic deleted and recreated under the same name is a new channel."""
        with self._lock:
            return self._clients.channel_id()

    def _watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        # read_uncommitted (see log_bounds): the high watermark, not the last stable offset,
        # so a channel stalled behind an open transaction does not look idle either
        with self._lock:
            if self._ends is None:
                self._clients.ensure_topics()
                self._ends = self._clients.consumer(
                    self._clients.consumer_group("coordinator"), self._role, committed=False
                )
            return log_bounds(self._ends, topic, partition, self._clients.timeout)

    def end_position(self) -> ChannelPosition:
        with self._lock:
            topic = self._clients.control_topic
            return {str(p): self._watermarks(topic, p)[1] for p in self._clients.partitions(topic)}

    def read_through(self) -> ChannelPosition | None:
        """The consumer's position per assigned partition: past the transaction markers that
        end every batch and broadcast (the high watermark counts them), unlike the offsets of
        the records returned. A partition read from the log start that has given no record yet
        (the consumer has no position there) is read through its log start: nothing before it
        can be read, and a log that retention emptied (log start = high watermark) is read
        through to its end. Other partitions without a position (nothing fetched yet from a
        sought offset) are left out: the caller knows that offset."""
        with self._lock:
            if self._data is None or not self._sought:
                return None
            try:
                positions = self._data.position(self._data.assignment())
            except KafkaException as exc:
                raise ChannelError(f"cannot read the consumer position: {exc}") from exc
            out: dict[str, int] = {}
            for tp in positions:
                if tp.error is None and tp.offset is not None and tp.offset >= 0:
                    out[str(tp.partition)] = int(tp.offset)
                elif tp.partition in self._from_start:
                    out[str(tp.partition)] = self._log_start(tp.partition)
            return out

    def _log_start(self, partition: int) -> int:
        """The low watermark of a partition sought from the log start, asked once per seek
        (it only grows, so an earlier answer stays true)."""
        start = self._from_start.get(partition)
        if start is None:
            start = self._watermarks(self._clients.control_topic, partition)[0]
            self._from_start[partition] = start
        return start

    def close(self) -> None:
        with self._lock:
            self.release()
            self._forget_observations()
            if self._epochs is not None:
                self._epochs.close()
                self._epochs = None
            for consumer in (self._data, self._ends):
                if consumer is not None:
                    with contextlib.suppress(RuntimeError):  # closed already
                        consumer.close()
            self._data = self._ends = None
