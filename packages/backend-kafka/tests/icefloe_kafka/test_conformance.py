"""The core conformance suite against the real broker."""

from __future__ import annotations

import pytest

from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe_kafka import KafkaBackend, KafkaBackendConfig


class TestKafkaConformance(BackendConformance):
    # pipelines share the control topic; the coordinator skips other groups' records
    shared_log = True

    @pytest.fixture
    def backend_factory(self, kafka_config: KafkaBackendConfig) -> BackendFactory:
        return lambda group_id, ttl: KafkaBackend(kafka_config, group_id, ttl)
