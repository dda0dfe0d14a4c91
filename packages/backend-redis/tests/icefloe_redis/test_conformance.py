"""The core conformance suite against the real Redis (this session's key prefix)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe_redis import RedisBackend, RedisConfig


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, config: RedisConfig) -> Iterator[BackendFactory]:
        made: list[RedisBackend] = []

        def factory(group_id: str, lease_ttl_s: float) -> RedisBackend:
            backend = RedisBackend(config, group_id, lease_ttl_s)
            made.append(backend)
            return backend

        yield factory
        for b in made:
            b.close()
