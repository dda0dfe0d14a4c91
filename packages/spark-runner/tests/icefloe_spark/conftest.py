"""Shared fixtures of the Spark runner tests: a real Kafka-protocol broker (Tansu), a real
local SparkSession (one per test process: it takes ~10-30 s to start), topics and a producer.

* ``kafka_broker``: the session's :class:`~icefloe_kafka.embedded.EmbeddedKafkaBroker`.
* ``spark``: a ``local[2]`` SparkSession with the ``icefloe-kafka`` source registered.
* ``new_topic(partitions=...)``: create a uniquely named topic, return its name.
* ``produce(topic, values, ...)``: produce and wait; returns ``(partition, offset)`` per value.
* ``source_options(topics, **extra)``: the ``icefloe-kafka`` options for the test broker.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]  # stubs
from pyspark.sql import SparkSession

from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.source import register_sources
from icefloe_spark.testing import local_spark

_log = logging.getLogger("tests.kafka")


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedKafkaBroker]:
    """A private broker for the whole test run (memory only: nothing outlives it)."""
    with EmbeddedKafkaBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession per test process; Python workers run this interpreter."""
    conf = {
        "spark.default.parallelism": "2",
        "spark.sql.streaming.stopTimeout": "30s",
        "spark.driver.memory": "1g",
    }
    with local_spark("local[2]", conf) as session:
        register_sources(session)
        yield session


@pytest.fixture
def new_topic(kafka_broker: EmbeddedKafkaBroker) -> Callable[..., str]:
    """``new_topic(partitions=2, name=None)`` creates a topic and returns its name."""
    conf: dict[str, Any] = {"bootstrap.servers": kafka_broker.bootstrap_servers, "logger": _log}
    admin = AdminClient(conf)

    def create(partitions: int = 2, name: str | None = None) -> str:
        topic = name or f"t-{uuid.uuid4().hex[:12]}"
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result(timeout=30)
        return topic

    return create


@pytest.fixture
def produce(kafka_broker: EmbeddedKafkaBroker) -> Iterator[Callable[..., list[tuple[int, int]]]]:
    """``produce(topic, values, partition=None, keys=None, headers=None, batched=False)``.

    ``partition`` is an int, a per-value sequence, or None (round robin over ``partitions``
    given by the caller's values' index: value i goes to partition i % n when n is given as
    ``partitions=n``). Unless ``batched``, every record is its own batch: Tansu 0.6 answers
    ListOffsets with the last batch's base offset + 1, so multi-record batches hide their tail
    from a plain ListOffsets (see the source's ``probeHighWatermark`` option).
    """
    producers: dict[bool, Producer] = {}

    def send(
        topic: str,
        values: Sequence[bytes | None],
        partition: int | Sequence[int] | None = None,
        partitions: int | None = None,
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[list[tuple[str, bytes]] | None] | None = None,
        batched: bool = False,
    ) -> list[tuple[int, int]]:
        if batched not in producers:
            conf: dict[str, Any] = {
                "bootstrap.servers": kafka_broker.bootstrap_servers,
                "logger": _log,
                "linger.ms": 5 if batched else 0,
            }
            if not batched:
                conf["batch.num.messages"] = 1
            producers[batched] = Producer(conf)
        producer = producers[batched]
        results: list[tuple[int, int] | None] = [None] * len(values)
        errors: list[Any] = []

        def done(i: int) -> Callable[[Any, Any], None]:
            def callback(err: Any, msg: Any) -> None:
                if err is not None:
                    errors.append(err)
                else:
                    results[i] = (msg.partition(), msg.offset())

            return callback

        for i, value in enumerate(values):
            kwargs: dict[str, Any] = {"value": value, "on_delivery": done(i)}
            if isinstance(partition, int):
                kwargs["partition"] = partition
            elif partition is not None:
                kwargs["partition"] = partition[i]
            elif partitions is not None:
                kwargs["partition"] = i % partitions
            if keys is not None:
                kwargs["key"] = keys[i]
            if headers is not None and headers[i] is not None:
                kwargs["headers"] = headers[i]
            producer.produce(topic, **kwargs)
            producer.poll(0)
        producer.flush(30)
        if errors:
            raise KafkaException(errors[0])
        missing = [i for i, r in enumerate(results) if r is None]
        assert not missing, f"no delivery report for values {missing[:5]}"
        return [r for r in results if r is not None]

    yield send
    for p in producers.values():
        p.flush(10)


@pytest.fixture
def source_options(kafka_broker: EmbeddedKafkaBroker) -> Callable[..., dict[str, str]]:
    """``source_options(topics, **extra)``: the icefloe-kafka options for the test broker."""

    def make(topics: str | Sequence[str], **extra: str) -> dict[str, str]:
        names = topics if isinstance(topics, str) else ",".join(topics)
        return {
            "kafka.bootstrap.servers": kafka_broker.bootstrap_servers,
            "subscribe": names,
            "pollTimeoutMs": "20000",
            **extra,
        }

    return make
