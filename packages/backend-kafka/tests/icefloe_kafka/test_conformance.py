"""The core conformance suite against the real broker."""

from __future__ import annotations

import uuid

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe_kafka import KafkaBackend, KafkaBackendConfig

from .conftest import recreate_control_topic


class TestKafkaConformance(BackendConformance):
    # pipelines share the control topic; the coordinator skips other groups' records
    shared_log = True

    @pytest.fixture
    def backend_factory(
        self, kafka_config: KafkaBackendConfig, request: pytest.FixtureRequest
    ) -> BackendFactory:
        config = kafka_config
        if "recreate_store" in request.fixturenames:
            # a test that drops the store gets a control topic of its own: deleting the shared
            # one while clients of other tests of this process still used it crashed the
            # process (a segfault in librdkafka)
            topic = f"ctl-{uuid.uuid4().hex[:10]}"
            config = kafka_config.model_copy(update={"control_topic": topic})
        return lambda group_id, ttl: KafkaBackend(config, group_id, ttl)

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        """The store is the control topic: deleted, then created anew by the next backend."""

        def recreate(backend: Backend) -> None:
            assert isinstance(backend, KafkaBackend)
            recreate_control_topic(backend)

        return recreate
