"""The runner's own Kafka clients (the source's planner and readers, ``icefloe status``'s and
the live view's watermark reader) against a cluster that is down: one log line for a connect
failure, not one per reconnect backoff, and none raw on stderr."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import Consumer, KafkaException

from icefloe.config import SourceConfig
from icefloe.throttle import ThrottledLog
from icefloe_kafka.embedded import free_port
from icefloe_spark.kafka import admin, options
from icefloe_spark.kafka.admin import source_watermarks
from icefloe_spark.kafka.options import SourceOptions

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of its own per test: the process's one held the message back for a minute."""
    log = ThrottledLog(logging.getLogger("icefloe_spark.kafka"))
    monkeypatch.setattr(admin, "CLIENT_LOG", log)
    monkeypatch.setattr(options, "CLIENT_LOG", log)


def _failures(caplog: pytest.LogCaptureFixture, port: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "icefloe_spark.kafka" and f":{port} failed" in r.getMessage()
    ]


def test_the_watermark_reader_logs_a_down_cluster_once_and_nothing_raw(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Before, its consumer had no logger: librdkafka wrote 39 lines of one connect failure
    straight to stderr per ``icefloe status`` (and over ``icefloe run``'s live view)."""
    port = free_port()
    caplog.set_level(logging.ERROR, logger="icefloe_spark.kafka")
    source = SourceConfig(bootstrap_servers=f"127.0.0.1:{port}", topics=["events"])
    assert source_watermarks(source, probe_end=False) is None
    raw = [line for line in capfd.readouterr().err.splitlines() if "rdkafka" in line]
    assert raw == []
    assert len(_failures(caplog, port)) == 1, _failures(caplog, port)


def test_the_source_consumer_logs_a_down_cluster_once(caplog: pytest.LogCaptureFixture) -> None:
    """The source's planner and readers logged each connect failure at every backoff: 59
    lines in a 3 s metadata request."""
    port = free_port()
    caplog.set_level(logging.ERROR, logger="icefloe_spark.kafka")
    source = SourceOptions.parse(
        {"kafka.bootstrap.servers": f"127.0.0.1:{port}", "subscribe": "events"}
    )
    consumer = Consumer(source.consumer_conf())
    try:
        with pytest.raises(KafkaException):
            consumer.list_topics(timeout=3.0)
        consumer.poll(0)  # librdkafka hands queued log lines over in a poll
    finally:
        consumer.close()
    assert len(_failures(caplog, port)) == 1, _failures(caplog, port)
