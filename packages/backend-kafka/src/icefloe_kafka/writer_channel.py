"""A writer's end of the Kafka control topic.

* Fencing: every instance of a writer identity uses the same ``transactional.id``
  (``<transactional_id_prefix>-<group>-<writer_id>``). ``open()`` calls ``init_transactions``,
  which aborts any transaction an older instance left open and makes every later request of
  the older instance fail with a fencing error: :class:`WriterFencedError`.
* Epoch: Kafka's producer epoch is not visible through confluent-kafka, so the epoch is a
  counter in the state topic (see :mod:`icefloe_kafka.state`), bumped in a transaction of
  this writer's own transactional.id right after ``init_transactions``. A stale instance can
  therefore never write a newer epoch, and each open returns more than every earlier open.
* Atomic batches: one ``publish`` is one Kafka transaction holding all events of the batch
  (and, when ``source_consumer_group`` is set, the batch's source offsets through
  ``send_offsets_to_transaction``: they commit with the events or not at all).
* Order: a writer's events all go to one partition, in publish order. The partition is chosen
  from the record key (group, writer id) when the writer first registers and is recorded in
  its epoch record; later instances reuse it. Adding partitions to the control topic (which
  changes what ``hash(key) % count`` gives) therefore never splits a writer over two
  partitions, where the coordinator could read a later batch before an earlier one.
* Replays: Kafka cannot tell whether a batch key was already published, so ``publish`` always
  returns True and appends; the coordinator keeps the first copy of a (writer, batch, table).
* Broadcasts: read by the backend's one shared consumer (:mod:`icefloe_kafka.broadcasts`),
  not a consumer per writer, so many writers in a process cost one producer each.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import zlib
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from icefloe.channel import WriterBatch, WriterChannel
from icefloe.errors import ChannelError, WriterFencedError
from icefloe.events import Event, WriterRef, encode_event
from icefloe_kafka.broadcasts import BroadcastReader, Inbox
from icefloe_kafka.clients import KafkaClients, group_headers, record_key, run_transaction
from icefloe_kafka.errors import BatchTooLargeError
from icefloe_kafka.state import (
    StateValue,
    epoch_key,
    highest_record,
    next_value,
    produce_state,
)

log = logging.getLogger("icefloe_kafka.writer")

# Room for the key, headers and record framing next to the value (librdkafka checks the whole
# message against message.max.bytes).
_RECORD_OVERHEAD_BYTES = 1024


class KafkaWriterChannel(WriterChannel):
    """One writer instance: a transactional producer plus an inbox of the backend's shared
    broadcast reader (:mod:`icefloe_kafka.broadcasts`)."""

    def __init__(self, clients: KafkaClients, writer_id: str, broadcasts: BroadcastReader) -> None:
        self._clients = clients
        self._group_id = clients.group_id
        self._writer_id = writer_id
        self._key = record_key(self._group_id, writer_id)
        self._txn_id = clients.transactional_id(writer_id)
        self._lock = threading.Lock()  # one transaction at a time on the producer
        self._producer: Producer | None = None
        self._reader = broadcasts
        self._inbox: Inbox | None = None
        self._source: Consumer | None = None
        self._epoch: int | None = None
        self._partition = 0  # set by open(): the partition pinned at registration
        self._fence: WriterFencedError | None = None

    # ------------------------------------------------------------------ open / close

    def open(self) -> int:
        with self._lock:
            self._close_clients()
            self._clients.ensure_topics()
            producer = self._clients.producer(self._txn_id, f"writer-{self._writer_id}")
            try:
                producer.init_transactions(self._clients.timeout)
            except KafkaException as exc:
                raise ChannelError(
                    f"writer {self._writer_id}: init_transactions failed: {exc}"
                ) from exc
            key = epoch_key(self._group_id, self._writer_id)
            last = highest_record(self._clients, key, f"writer-{self._writer_id}")
            epoch = next_value(0 if last is None else last.value)
            partition = self._pinned_partition(last)
            record = StateValue(epoch, self._txn_id, partition=partition)
            run_transaction(
                producer,
                lambda: produce_state(self._clients, producer, key, record, self._group_id),
                self._clients.timeout,
                self._fenced,
            )
            self._producer = producer
            self._fence = None
            self._inbox = self._reader.subscribe()
            self._epoch = epoch
            self._partition = partition
            log.info("writer %s/%s opened with epoch %d", self._group_id, self._writer_id, epoch)
            return epoch

    def _pinned_partition(self, last: StateValue | None) -> int:
        """The partition recorded at the writer's registration; a new writer (or one registered
        before partitions were recorded) gets ``crc32(key) % count`` now, recorded from then on.
        Why by hand: Kafka's partitioners all depend on the current partition count."""
        parts = sorted(self._clients.partitions(self._clients.control_topic))
        if last is not None and last.partition is not None:
            if last.partition not in parts:
                raise ChannelError(
                    f"writer {self._writer_id} is pinned to partition {last.partition} of "
                    f"{self._clients.control_topic}, which no longer exists (topic recreated "
                    "with fewer partitions?); see docs/operations.md (channel reset)"
                )
            return last.partition
        return parts[zlib.crc32(self._key) % len(parts)]

    def close(self) -> None:
        with self._lock:
            self._close_clients()

    def _close_clients(self) -> None:
        if self._inbox is not None:
            self._inbox.close()  # the shared reader stops with its last writer
        if self._source is not None:
            with contextlib.suppress(RuntimeError):  # closed already
                self._source.close()
        self._inbox = self._source = None
        self._producer = None  # no open transaction is left behind: each call commits or aborts
        self._epoch = None

    # ------------------------------------------------------------------ publishing

    def _fenced(self, text: str) -> ChannelError:
        return WriterFencedError(
            f"writer {self._writer_id} (epoch {self._epoch}) is fenced by a newer instance: {text}"
        )

    def _opened(self) -> tuple[Producer, int]:
        if self._fence is not None:
            raise self._fence
        if self._producer is None or self._epoch is None:
            raise RuntimeError(f"writer {self._writer_id}: call open() first")
        return self._producer, self._epoch

    def _produce_value(self, producer: Producer, value: bytes) -> None:
        producer.produce(
            self._clients.control_topic,
            value=value,
            key=self._key,
            partition=self._partition,
            headers=group_headers(self._group_id),
        )

    def _checked(self, event: Event) -> bytes:
        """``event`` encoded, or BatchTooLargeError when it cannot be one Kafka record."""
        value = encode_event(event)
        limit = self._clients.max_record_bytes
        if len(value) + _RECORD_OVERHEAD_BYTES > limit:
            table = getattr(event.payload, "table", "?")
            raise BatchTooLargeError(self._writer_id, table, len(value), limit)
        return value

    def publish(self, batch: WriterBatch) -> bool:
        with self._lock:
            producer, epoch = self._opened()
            if batch.writer != WriterRef(self._writer_id, epoch):
                raise ValueError(f"batch of {batch.writer} published through {self._writer_id}")

            records = [self._checked(event) for event in batch.events]

            def body() -> None:
                for value in records:
                    self._produce_value(producer, value)
                self._send_source_offsets(producer, batch)

            self._transact(producer, body)
            # Kafka cannot tell a replayed batch key; the coordinator drops second copies
            return True

    def respond(self, event: Event) -> None:
        """Send an answer (a DataComplete naming a commit) outside any transaction, through
        the backend's shared plain producer.

        Why no transaction: one transaction per answer costs a round of the broker's
        transaction coordinator each (~30 ms on the test broker, serialised there), so 256
        writers took ~8 s to answer one StartCommit. An answer needs none of what a
        transaction gives:

        * Exactly-once: an answer carries no files. Files enter only through ``publish``,
          still one fenced transaction per batch, so nothing can be committed twice or lost
          by an answer, and the dedupe rule is untouched.
        * Order: ``WriterClient`` answers only after its earlier publishes returned, i.e. after
          their transactions committed, and the answer goes to the same (pinned) partition, so
          it lands behind every batch it vouches for. Its positions are the merge of positions
          those committed batches already carried, so merging them again changes nothing.
        * Atomicity: it is a single record; an idempotent producer neither duplicates nor
          reorders it.
        * Fencing: an instance that noticed it is fenced refuses here (``_opened``). One that
          has not noticed yet (a zombie that has not published since a newer instance opened)
          could still append an answer, so the coordinator's channel drops answers whose epoch
          is below the writer's newest epoch in the state topic, which it reads to its end
          before handing an answer over (``icefloe_kafka.state.EpochWatch``). The newer
          instance's epoch record commits before it does anything, so an answer appended after
          the newer instance opened is always dropped: the same cut-off a transaction gives
          (after ``init_transactions`` no transaction of the older instance commits). An answer
          appended before that is one the older instance could have sent transactionally too.
        """
        with self._lock:
            self._opened()
            value = encode_event(event)
            self._clients.send_plain(value, self._key, self._partition)

    def _transact(self, producer: Producer, body: Any) -> None:
        try:
            run_transaction(producer, body, self._clients.timeout, self._fenced)
        except WriterFencedError as exc:
            self._fence = exc  # a fenced producer is useless; every later call says so
            raise

    def _send_source_offsets(self, producer: Producer, batch: WriterBatch) -> None:
        group = self._clients.config.source_consumer_group
        if group is None or not batch.source_positions:
            return
        if self._source is None:
            # only its group metadata is used: it never joins the group or fetches
            self._source = self._clients.consumer(group, f"writer-{self._writer_id}-source")
        offsets = [TopicPartition(p.topic, p.partition, p.offset) for p in batch.source_positions]
        producer.send_offsets_to_transaction(
            offsets, self._source.consumer_group_metadata(), self._clients.timeout
        )

    # ------------------------------------------------------------------ broadcasts

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        """This writer's broadcasts, read by the backend's shared reader: no fetch here, so
        the writer client's frequent polls under its publish lock cost a queue look-up."""
        inbox = self._inbox
        if inbox is None:
            raise RuntimeError(f"writer {self._writer_id}: call open() first")
        return inbox.take(timeout)
