"""What the tasks of the ``icefloe-kafka`` sources run: read a range of one partition from
Kafka into Arrow record batches with the columns of Spark's own Kafka source (key, value,
topic, partition, offset, timestamp, timestampType, headers).
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from icefloe_spark.kafka.options import SourceOptions
from icefloe_spark.kafka.planning import (
    DataLossError,
    KafkaInputPartition,
    KafkaSourceError,
    int_of,
)

KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)
# exactly what Spark checks returned batches against
KAFKA_ARROW_SCHEMA: pa.Schema = to_arrow_schema(KAFKA_SCHEMA, timezone="UTC")
_READ_BATCH = 20_000


class ConsumerPool:
    """Idle consumers of this process, by client settings, for the next range read.

    Why: a Python worker runs task after task (Spark reuses it), and a new consumer costs a
    connection and a metadata round trip (~45 ms here) per range; Spark's own Kafka source
    pools its consumers per executor for the same reason. A consumer is only reused after a
    read that ended normally, and is unassigned before it is returned.
    """

    MAX_IDLE = 4  # per settings: as many as a worker has ranges in flight, and then some

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, list[Consumer]] = {}

    @staticmethod
    def _key(options: SourceOptions) -> str:
        conf = options.consumer_conf()
        return json.dumps(
            {k: str(v) for k, v in conf.items() if k not in ("group.id", "logger")},
            sort_keys=True,
        )

    def take(self, options: SourceOptions) -> Consumer:
        with self._lock:
            idle = self._idle.get(self._key(options))
            if idle:
                return idle.pop()
        return Consumer(options.consumer_conf())

    def give_back(self, options: SourceOptions, consumer: Consumer, reusable: bool) -> None:
        if reusable:
            try:
                consumer.unassign()
            except KafkaException:
                reusable = False
        if reusable:
            with self._lock:
                idle = self._idle.setdefault(self._key(options), [])
                if len(idle) < self.MAX_IDLE:
                    idle.append(consumer)
                    return
        consumer.close()


CONSUMERS = ConsumerPool()


def read_range(
    options: SourceOptions, part: KafkaInputPartition, batch_size: int = _READ_BATCH
) -> Iterator[pa.RecordBatch]:
    """Every record of [start, end) of one partition, as Kafka-layout record batches.

    Offsets without a record (transaction markers, compaction, aborted transactions under
    read_committed) are skipped: the range ends at the first record at or past ``end``, or
    at the end of the partition once it reaches ``end``.
    """
    consumer = CONSUMERS.take(options)
    finished = False
    try:
        consumer.assign([TopicPartition(part.topic, part.partition, part.start)])
        msgs: list[Any] = []
        next_offset = part.start
        last_progress = time.monotonic()
        while next_offset < part.end:
            # ask for no more than the range still holds: a consume returns once it has that
            # many or its timeout ran out, so asking for more waits out the timeout at the end
            # of every range (offsets without a record only cost one short wait)
            wanted = max(1, min(batch_size, part.end - next_offset))
            polled = consumer.consume(num_messages=wanted, timeout=0.1)
            if not polled:
                if time.monotonic() - last_progress > options.poll_timeout_s:
                    raise KafkaSourceError(
                        f"{part.topic}[{part.partition}]: no records for "
                        f"{options.poll_timeout_s}s while reading offsets [{part.start}, "
                        f"{part.end}) (next: {next_offset})"
                    )
                continue
            reading_from = next_offset  # before an end-of-partition event below moves it
            # list comprehensions, not a loop with branches: this runs once per record
            events = [m for m in polled if m.error() is not None]
            if events:
                polled = [m for m in polled if m.error() is None]
                if _range_ends_here(part, events):
                    next_offset = part.end
            if polled and not _all_of_range(polled, part, reading_from):
                polled = [  # a pooled consumer's leftovers (never seen): keep only this range
                    m
                    for m in polled
                    if (m.topic(), m.partition()) == (part.topic, part.partition)
                    and int_of(m.offset()) >= reading_from
                ]
            if polled:
                if int_of(polled[-1].offset()) >= part.end:
                    offsets = [int_of(m.offset()) for m in polled]
                    polled = polled[: bisect.bisect_left(offsets, part.end)]
                    next_offset = part.end
                if polled:
                    msgs += polled
                    next_offset = max(next_offset, int_of(polled[-1].offset()) + 1)
                    last_progress = time.monotonic()
            if msgs and (len(msgs) >= batch_size or next_offset >= part.end):
                yield to_record_batch(part.topic, part.partition, msgs)
                msgs = []
        finished = True
    finally:
        CONSUMERS.give_back(options, consumer, finished)


def _all_of_range(polled: Sequence[Any], part: KafkaInputPartition, next_offset: int) -> bool:
    """Cheap check that a consume returned only this range's records: one partition's
    records come in offset order, and anything older would come first."""
    first, last = polled[0], polled[-1]
    here = (part.topic, part.partition)
    return (
        (first.topic(), first.partition()) == here
        and (last.topic(), last.partition()) == here
        and int_of(first.offset()) >= next_offset
    )


def read_ranges(options: SourceOptions, ranges: Iterable[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """The records of range rows (``icefloe-kafka-ranges``), as Kafka-layout batches."""
    out: list[pa.RecordBatch] = []
    for batch in ranges:
        for row in batch.to_pylist():
            part = KafkaInputPartition(row["topic"], row["partition"], row["start"], row["end"])
            out += read_range(options, part)
    return out


def _range_ends_here(part: KafkaInputPartition, events: Sequence[Any]) -> bool:
    """Handle the client's non-record events: True when the partition's end was reached at
    or past ``part.end`` (the rest of the range holds no records); data loss and other
    errors raise."""
    ended = False
    for event in events:
        err = event.error()
        if err.code() == KafkaError._PARTITION_EOF:
            # librdkafka drops what an earlier assignment fetched (assign() moves the
            # partition's version on); the partition check guards a pooled consumer anyway
            mine = (event.topic(), event.partition()) == (part.topic, part.partition)
            ended = ended or (mine and int_of(event.offset()) >= part.end)
        elif err.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
            raise DataLossError(
                f"{part.topic}[{part.partition}]: offsets [{part.start}, {part.end}) are no "
                f"longer on the broker ({err.str()}); set failOnDataLoss=false to continue "
                "from what the broker still has"
            )
        else:
            raise KafkaException(err)
    return ended


# confluent-kafka's timestamp kinds -> Kafka's TimestampType ids (-1: none)
_TS_TYPE = np.full(3, -1, dtype=np.int32)
_TS_TYPE[TIMESTAMP_CREATE_TIME] = 0
_TS_TYPE[TIMESTAMP_LOG_APPEND_TIME] = 1
_HEADERS_TYPE = KAFKA_ARROW_SCHEMA.field("headers").type


def to_record_batch(topic: str, partition: int, msgs: Sequence[Any]) -> pa.RecordBatch:
    """Messages -> one Kafka-layout batch. One pass per column over the client's message
    objects (confluent-kafka hands out one object per record); the rest is vectorised."""
    n = len(msgs)
    stamps = np.array([m.timestamp() for m in msgs], dtype=np.int64).reshape(n, 2)
    ts_type = _TS_TYPE[np.clip(stamps[:, 0], 0, 2)]
    ts_ms = stamps[:, 1]
    no_ts = ts_type < 0
    timestamps = pa.array(ts_ms * 1000, pa.int64(), mask=no_ts if no_ts.any() else None).cast(
        KAFKA_ARROW_SCHEMA.field("timestamp").type
    )
    headers = [m.headers() for m in msgs]
    if any(h is not None for h in headers):
        header_col = pa.array(
            [None if h is None else [{"key": k, "value": v} for k, v in h] for h in headers],
            _HEADERS_TYPE,
        )
    else:
        header_col = pa.nulls(n, _HEADERS_TYPE)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([m.key() for m in msgs], pa.binary()),
            pa.array([m.value() for m in msgs], pa.binary()),
            pa.repeat(pa.scalar(topic, pa.string()), n),
            pa.repeat(pa.scalar(partition, pa.int32()), n),
            pa.array(np.fromiter((m.offset() for m in msgs), np.int64, n)),
            timestamps,
            pa.array(ts_type),
            header_col,
        ],
        schema=KAFKA_ARROW_SCHEMA,
    )
