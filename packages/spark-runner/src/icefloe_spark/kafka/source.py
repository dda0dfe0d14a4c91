"""``icefloe-kafka``: a Kafka source for Spark Structured Streaming in Python.

Spark's own Kafka source is a JVM connector that PySpark wheels do not ship; this one uses
PySpark's Python Data Source API and confluent-kafka, and produces the same columns (key,
value, topic, partition, offset, timestamp, timestampType, headers) as Arrow record batches.

Offsets are Spark offsets, ``{"topic": {"partition": next offset}}``, checkpointed by Spark.
A micro-batch reads the fixed range [start, end) of each partition, one Spark input
partition per Kafka partition, so a replayed batch reads exactly the same records (the
exactly-once sink relies on it).

The options are those of :mod:`icefloe_spark.kafka.options`; the driver plans each
micro-batch (:mod:`icefloe_spark.kafka.planning`), the tasks read its ranges
(:mod:`icefloe_spark.kafka.reading`). This module wires them into Spark's data source API.

``icefloe-kafka-ranges`` plans exactly as ``icefloe-kafka`` but its rows are the ranges
themselves (``topic, partition, start, end``), one per input partition: the ``icefloe`` sink
reads each range in its own task (:func:`~icefloe_spark.kafka.reading.read_ranges`), so
records never cross into the JVM.

New partitions (and topics created after the start) are picked up from their earliest
offset: the batch that discovers one records it at its earliest offset, the next reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from icefloe_spark.kafka.options import SourceOptions
from icefloe_spark.kafka.planning import (
    RANGE_ARROW_SCHEMA,
    RANGE_SCHEMA,
    KafkaInputPartition,
    KafkaOffsetPlanner,
    KafkaRangeGroup,
    pack_ranges,
)
from icefloe_spark.kafka.reading import KAFKA_SCHEMA, read_range
from icefloe_spark.runtime import workergc

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SOURCE_NAME = "icefloe-kafka"
RANGES_SOURCE_NAME = "icefloe-kafka-ranges"


class KafkaStreamReader(KafkaOffsetPlanner, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side: offsets and planning (:class:`KafkaOffsetPlanner`). Executor side:
    :meth:`read` (on a pickled copy, without the driver's clients)."""

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaInputPartition)
        yield from read_range(self.options, partition)
        workergc.freeze_new()


class KafkaRangeReader(KafkaStreamReader):
    """Plans like :class:`KafkaStreamReader`, then packs short ranges into one task
    (:func:`pack_ranges`) where ``maxRecordsPerPartition`` is set; each range is one row."""

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        planned = super().partitions(start, end)
        limit = self.options.max_partition_records
        ranges = [p for p in planned if isinstance(p, KafkaInputPartition)]
        if limit is None or len(ranges) != len(planned):
            return planned
        return [KafkaRangeGroup(group) for group in pack_ranges(ranges, limit)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, KafkaRangeGroup):
            ranges = partition.ranges
        else:
            assert isinstance(partition, KafkaInputPartition)
            ranges = [partition]
        yield pa.RecordBatch.from_pylist(
            [
                {"topic": p.topic, "partition": p.partition, "start": p.start, "end": p.end}
                for p in ranges
            ],
            schema=RANGE_ARROW_SCHEMA,
        )
        workergc.freeze_new()


# --------------------------------------------------------------------------- registration


class IcefloeKafkaDataSource(DataSource):
    """``spark.readStream.format("icefloe-kafka")``."""

    source_name = SOURCE_NAME
    row_schema = KAFKA_SCHEMA
    stream_reader_class: type[KafkaStreamReader] = KafkaStreamReader

    @classmethod
    def name(cls) -> str:
        return cls.source_name

    def schema(self) -> StructType:
        return self.row_schema

    def streamReader(self, schema: StructType) -> KafkaStreamReader:  # noqa: N802 (Spark's name)
        return self.stream_reader_class(SourceOptions.parse(self.options))


class IcefloeKafkaRangesDataSource(IcefloeKafkaDataSource):
    """``spark.readStream.format("icefloe-kafka-ranges")``: offset ranges, not records."""

    source_name = RANGES_SOURCE_NAME
    row_schema = RANGE_SCHEMA
    stream_reader_class = KafkaRangeReader


def register_sources(spark: SparkSession) -> None:
    """Make ``icefloe-kafka`` and ``icefloe-kafka-ranges`` available to
    ``spark.readStream.format(...)``."""
    spark.dataSource.register(IcefloeKafkaDataSource)
    spark.dataSource.register(IcefloeKafkaRangesDataSource)
