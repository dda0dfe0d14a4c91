"""The core conformance suite against the real PostgreSQL at 127.0.0.1:5432."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe_postgres import PostgresBackend
from icefloe_postgres.testing import make_test_config


class TestPostgresConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, pg_dsn: str, session_schema: str) -> Iterator[BackendFactory]:
        made: list[Backend] = []

        def make(group_id: str, lease_ttl_s: float) -> Backend:
            # production retention: the suite checks that batch keys and broadcasts outlive a
            # prune, which holds for as long as these windows say
            config = make_test_config(
                pg_dsn, session_schema, retention_s=3600.0, broadcast_retention_s=600.0
            )
            b = PostgresBackend(config, group_id, lease_ttl_s)
            made.append(b)
            return b

        yield make
        for b in made:
            b.close()
