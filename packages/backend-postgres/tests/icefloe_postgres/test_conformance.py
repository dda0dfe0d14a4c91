"""The core conformance suite against the real PostgreSQL at 127.0.0.1:5432, and again as the
least-privileged role over TLS with a SCRAM password (``secured_pg``)."""

from __future__ import annotations

import functools

import pytest

from icefloe.channel import Backend
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe_postgres import PostgresBackend
from icefloe_postgres.testing import BackendMaker, drop_schema

from .conftest import SECURED_SCHEMA, SecuredPostgres

# production retention: the suite checks that batch keys and broadcasts outlive a prune,
# which holds for as long as these windows say
RETENTION = {"retention_s": 3600.0, "broadcast_retention_s": 600.0}


class TestPostgresConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, make_backend: BackendMaker) -> BackendFactory:
        return functools.partial(make_backend, **RETENTION)

    @pytest.fixture
    def recreate_store(self, pg_dsn: str) -> StoreRecreator:
        """The store is the schema: dropped, then created anew by the next backend."""

        def recreate(backend: Backend) -> None:
            assert isinstance(backend, PostgresBackend)
            drop_schema(pg_dsn, backend.schema)

        return recreate


class TestPostgresConformanceAsLeastPrivilegedRoleOverTls(BackendConformance):
    """Every rule again as a role with exactly the grants of docs/operations.md on a schema
    another role owns, over ``sslmode=verify-full`` with a SCRAM password: a statement that
    needs a privilege the grants lack fails here."""

    @pytest.fixture
    def backend_factory(
        self, make_backend: BackendMaker, secured_pg: SecuredPostgres
    ) -> BackendFactory:
        return functools.partial(
            make_backend, dsn=secured_pg.app_dsn, schema=SECURED_SCHEMA, **RETENTION
        )

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        """Dropping and re-creating the schema needs its owner, not this role: the rules that
        recreate the store run in TestPostgresConformance; this class checks privileges."""
        pytest.skip("store recreation needs the schema's owner; TestPostgresConformance runs it")
