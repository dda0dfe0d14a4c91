"""The core conformance suite against the real Redis (this session's key prefix), and again as
the least-privileged ACL user over TLS (``secured_redis``)."""

from __future__ import annotations

import functools

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe_redis import RedisBackend, RedisConfig

from .conftest import MakeBackend


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, make_backend: MakeBackend) -> BackendFactory:
        """``make_backend(group_id, lease_ttl_s)``: on this session's key prefix, closed at
        teardown."""
        return make_backend

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        """The store is the pipeline's keys (its identity key among them): deleted, as a
        restart without persistence or a FLUSHALL would."""

        def recreate(backend: Backend) -> None:
            assert isinstance(backend, RedisBackend)
            backend.drop_state()

        return recreate


class TestRedisConformanceAsLeastPrivilegedUserOverTls(TestRedisConformance):
    """Every rule again with the ACL of docs/operations.md and TLS: a command the backend
    sends that the ACL lacks fails here with NOPERM."""

    @pytest.fixture
    def backend_factory(
        self, make_backend: MakeBackend, secured_redis: RedisConfig
    ) -> BackendFactory:
        return functools.partial(make_backend, cfg=secured_redis)
