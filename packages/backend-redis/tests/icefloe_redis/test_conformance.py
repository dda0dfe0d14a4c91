"""The core conformance suite against the real Redis (this session's key prefix)."""

from __future__ import annotations

import pytest

from icefloe.testing.conformance import BackendConformance, BackendFactory

from .conftest import MakeBackend


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, make_backend: MakeBackend) -> BackendFactory:
        """``make_backend(group_id, lease_ttl_s)``: on this session's key prefix, closed at
        teardown."""
        return make_backend
