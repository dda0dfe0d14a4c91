"""Small Kafka helpers shared by the demo, the end-to-end tests and the benchmark."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from icefloe.throttle import ThrottledLog

if TYPE_CHECKING:
    from icefloe.config import SourceConfig

log = logging.getLogger("icefloe_spark.progress")

#: librdkafka's log for every client the runner builds, each message at most once a minute.
#: Without it a client's log goes raw to stderr: 39 lines of one connect failure per
#: ``icefloe status`` while a source cluster is down, written over ``icefloe run``'s live view.
CLIENT_LOG = ThrottledLog(logging.getLogger("icefloe_spark.kafka"))

#: (high, low) watermark per (topic, partition) of a source
Watermarks = tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Create ``topic`` (replication 1: the embedded broker is a single node)."""
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": CLIENT_LOG}
    admin = AdminClient(conf)
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(timeout=30)


def produce(bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes]]) -> int:
    """Produce (key, value) pairs and wait until the broker acknowledged every one; raise if
    any was not. Returns how many were produced."""
    failures: list[str] = []

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 20,
            "compression.type": "lz4",
            "logger": CLIENT_LOG,
        }
    )
    count = 0
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=report)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.1)
        count += 1
        if count % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"{left} records undelivered, {len(failures)} failed: {failures[:3]}")
    return count


def end_offsets(bootstrap: str, topic: str, timeout_s: float = 60.0) -> dict[int, int]:
    """Each partition's end offset, found by reading to the end (exact on every broker;
    the embedded Tansu's ListOffsets answers the last batch's base offset + 1)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "icefloe-end-offsets",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,  # an empty fetch at the end answers now, not in 500 ms
            "logger": CLIENT_LOG,
        }
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        starts = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts
        }
        # start near the listed end: only the last batch needs reading
        consumer.assign(
            [TopicPartition(topic, p, max(hi - 1, lo)) for p, (lo, hi) in starts.items()]
        )
        ends: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(ends) < len(parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not find the end of {topic} in {timeout_s}s")
            # poll returns at the first message or end-of-partition event; consume alone would
            # wait its whole timeout for 1000 messages (0.5 s a round, 1 s per `icefloe status`)
            first = consumer.poll(0.5)
            for msg in [] if first is None else [first, *consumer.consume(999, 0)]:
                err = msg.error()
                part, offset = msg.partition(), msg.offset()
                eof = err is not None and err.code() == KafkaError._PARTITION_EOF
                if eof and part is not None and offset is not None:
                    ends[part] = offset
        return ends
    finally:
        consumer.close()


def source_consumer(source: SourceConfig) -> Consumer:
    """A consumer of the source's cluster for watermarks only: it never joins its group."""
    return Consumer(
        {
            **source.kafka,
            "bootstrap.servers": source.bootstrap_servers,
            "group.id": f"icefloe-monitor-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "logger": CLIENT_LOG,
        }
    )


def watermarks(consumer: Consumer, source: SourceConfig, probe_end: bool) -> Watermarks:
    """The (high, low) watermarks of every partition of the source's topics; ``probe_end``:
    the high ones found by reading to the end (:func:`end_offsets`). Raises
    ``KafkaException`` or ``TimeoutError`` when the cluster does not answer."""
    high: dict[tuple[str, int], int] = {}
    low: dict[tuple[str, int], int] = {}
    listed = consumer.list_topics(timeout=2.0).topics  # all: never auto-creates
    for topic in source.subscribed(listed):
        meta = listed[topic]
        if meta.error is not None:
            continue
        for p in meta.partitions:
            lo, hi = consumer.get_watermark_offsets(
                TopicPartition(topic, p), timeout=2.0, cached=False
            )
            low[(topic, p)], high[(topic, p)] = lo, hi
        if probe_end:
            ends = end_offsets(source.bootstrap_servers, topic, timeout_s=5.0)
            high.update({(topic, p): o for p, o in ends.items()})
    return high, low


def source_watermarks(source: SourceConfig, probe_end: bool) -> Watermarks | None:
    """:func:`watermarks` through a consumer of its own, closed after; None when the cluster
    does not answer. Imports nothing but confluent_kafka: ``icefloe status`` runs it on a
    thread while its main thread imports pyiceberg (see ``icefloe_spark.plugin``)."""
    try:
        consumer = source_consumer(source)
        try:
            return watermarks(consumer, source, probe_end)
        finally:
            consumer.close()
    except (KafkaException, TimeoutError):
        log.debug("watermarks unavailable", exc_info=True)
        return None
