"""The core conformance suite against the real PostgreSQL at 127.0.0.1:5432."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from icefloe.channel import Backend, CoordinatorChannel
from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe_postgres import PostgresBackend, PostgresCoordinatorChannel
from icefloe_postgres.testing import make_test_config


class TestPostgresConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, pg_dsn: str, session_schema: str) -> Iterator[BackendFactory]:
        made: list[Backend] = []

        def make(group_id: str, lease_ttl_s: float) -> Backend:
            b = PostgresBackend(make_test_config(pg_dsn, session_schema), group_id, lease_ttl_s)
            made.append(b)
            return b

        yield make
        for b in made:
            b.close()

    def kill_coordinator_channel(self, channel: CoordinatorChannel) -> None:
        """A dead process: its connections vanish and it never releases; the lease row runs
        out on the database clock."""
        assert isinstance(channel, PostgresCoordinatorChannel)
        channel._listener.close()
