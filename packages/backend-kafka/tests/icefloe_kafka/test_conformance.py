"""The core conformance suite against the real broker."""

from __future__ import annotations

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe_kafka import KafkaBackend, KafkaBackendConfig

from .conftest import recreate_control_topic


class TestKafkaConformance(BackendConformance):
    # pipelines share the control topic; the coordinator skips other groups' records
    shared_log = True

    @pytest.fixture
    def backend_factory(self, kafka_config: KafkaBackendConfig) -> BackendFactory:
        return lambda group_id, ttl: KafkaBackend(kafka_config, group_id, ttl)

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        """The store is the control topic: deleted, then created anew by the next backend."""

        def recreate(backend: Backend) -> None:
            assert isinstance(backend, KafkaBackend)
            recreate_control_topic(backend)

        return recreate
