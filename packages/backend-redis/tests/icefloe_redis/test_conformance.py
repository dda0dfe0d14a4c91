"""The core conformance suite against the real Redis (this session's key prefix), and again as
the least-privileged ACL user over TLS (``secured_redis``)."""

from __future__ import annotations

import functools

import pytest

from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe_redis import RedisConfig

from .conftest import MakeBackend


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, make_backend: MakeBackend) -> BackendFactory:
        """``make_backend(group_id, lease_ttl_s)``: on this session's key prefix, closed at
        teardown."""
        return make_backend


class TestRedisConformanceAsLeastPrivilegedUserOverTls(BackendConformance):
    """Every rule again with the ACL of docs/operations.md and TLS: a command the backend
    sends that the ACL lacks fails here with NOPERM."""

    @pytest.fixture
    def backend_factory(
        self, make_backend: MakeBackend, secured_redis: RedisConfig
    ) -> BackendFactory:
        return functools.partial(make_backend, cfg=secured_redis)
