"""The core conformance suite against the real PostgreSQL at 127.0.0.1:5432."""

from __future__ import annotations

import functools

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe_postgres import PostgresBackend
from icefloe_postgres.testing import BackendMaker, drop_schema


class TestPostgresConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, make_backend: BackendMaker) -> BackendFactory:
        # production retention: the suite checks that batch keys and broadcasts outlive a
        # prune, which holds for as long as these windows say
        return functools.partial(make_backend, retention_s=3600.0, broadcast_retention_s=600.0)

    @pytest.fixture
    def recreate_store(self, pg_dsn: str) -> StoreRecreator:
        """The store is the schema: dropped, then created anew by the next backend."""

        def recreate(backend: Backend) -> None:
            assert isinstance(backend, PostgresBackend)
            drop_schema(pg_dsn, backend.schema)

        return recreate
