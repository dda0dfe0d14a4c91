"""Fixtures: the shared PostgreSQL at 127.0.0.1:5432 (a private schema per test session) and
private PostgreSQL servers for restart tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from icefloe.events import WriterRef
from icefloe_postgres import PostgresBackend, PostgresCoordinatorChannel, PostgresWriterChannel
from icefloe_postgres.permissions import runtime_grants
from icefloe_postgres.testing import BackendMaker, PrivatePostgres, drop_schema, make_test_config

DSN = os.environ.get(
    "ICEFLOE_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test"
)


def new_schema_name() -> str:
    return f"icefloe_test_{uuid.uuid4().hex[:10]}"


def open_writer(
    backend: PostgresBackend, writer_id: str = "w"
) -> tuple[PostgresWriterChannel, WriterRef]:
    """An opened writer end and the reference its events carry."""
    writer = backend.writer(writer_id)
    return writer, WriterRef(writer_id, writer.open())


def counted(backend: PostgresBackend, query: str | sql.SQL | sql.Composed, *params: Any) -> int:
    """What a ``SELECT count(...)`` returns, run on the backend's pool."""
    row = backend.db.run("count", lambda c: c.execute(query, params).fetchone())
    assert row is not None
    return int(row[0])


def reader(backend: PostgresBackend, coordinator_id: str = "c") -> PostgresCoordinatorChannel:
    """A coordinator end that reads the log from its start."""
    coord = backend.coordinator(coordinator_id)
    coord.seek(None)
    return coord


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    """The shared server; fails (never skips) when it is not running."""
    try:
        with psycopg.connect(DSN, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is required at {DSN!r} ({exc}); start it as .ci/run does "
            "or set ICEFLOE_TEST_POSTGRES_DSN"
        )
    return DSN


@pytest.fixture(scope="session")
def session_schema(pg_dsn: str) -> Iterator[str]:
    """One schema for the whole test session, dropped at its end."""
    schema = new_schema_name()
    yield schema
    drop_schema(pg_dsn, schema)


@pytest.fixture
def fresh_schema(pg_dsn: str) -> Iterator[str]:
    """A schema of its own for one test (migration tests), dropped afterwards."""
    schema = new_schema_name()
    yield schema
    drop_schema(pg_dsn, schema)


@pytest.fixture
def make_backend(pg_dsn: str, session_schema: str) -> Iterator[BackendMaker]:
    """``make_backend(group_id=None, lease_ttl_s=5.0, **config)``: backends closed at teardown."""
    made: list[PostgresBackend] = []

    def make(
        group_id: str | None = None, lease_ttl_s: float = 5.0, **overrides: Any
    ) -> PostgresBackend:
        overrides.setdefault("schema", session_schema)
        dsn = overrides.pop("dsn", pg_dsn)
        b = PostgresBackend(
            make_test_config(dsn, **overrides),
            group_id or f"g-{uuid.uuid4().hex[:10]}",
            lease_ttl_s,
        )
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    server.start()
    try:
        yield server
    finally:
        server.close()


#: the roles of the secured server: the schema's owner migrates it and grants the app role
#: exactly runtime_grants(); pipelines run as the app role
OWNER, OWNER_PASSWORD = "icefloe_owner", "owner-pw-Sekrit-5432"
APP, APP_PASSWORD = "icefloe_app", "app-pw-Sekrit-5432"
SECURED_SCHEMA = "icefloe"


@dataclass(frozen=True)
class SecuredPostgres:
    """A server that takes only TLS with SCRAM passwords over TCP, and its roles."""

    server: PrivatePostgres
    database: str

    def dsn(self, role: str, password: str, **extra: str) -> str:
        """A DSN for ``role`` that verifies the server's certificate and host name."""
        assert self.server.tls is not None
        params = {
            "host": "127.0.0.1",
            "port": str(self.server.port),
            "dbname": self.database,
            "user": role,
            "password": password,
            "sslmode": "verify-full",
            "sslrootcert": str(self.server.tls.ca),
            **extra,
        }
        return psycopg.conninfo.make_conninfo(**params)

    @property
    def app_dsn(self) -> str:
        return self.dsn(APP, APP_PASSWORD)

    @property
    def owner_dsn(self) -> str:
        return self.dsn(OWNER, OWNER_PASSWORD)

    def admin(self) -> psycopg.Connection[Any]:
        """The superuser on the pipelines database, through the Unix socket."""
        dsn = psycopg.conninfo.make_conninfo(self.server.dsn, dbname=self.database)
        return psycopg.connect(dsn, autocommit=True)


@pytest.fixture(scope="session")
def secured_pg() -> Iterator[SecuredPostgres]:
    """A private server set up as docs/operations.md says: a database only the two roles may
    connect to, a schema the owner role owns and has migrated, and the app role with exactly
    :func:`runtime_grants` on it."""
    server = PrivatePostgres(secured=True)
    try:
        server.start()
        secured = SecuredPostgres(server, "pipelines")
        with psycopg.connect(server.dsn, autocommit=True) as su:
            for role, password in ((OWNER, OWNER_PASSWORD), (APP, APP_PASSWORD)):
                su.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                        sql.Identifier(role), sql.Literal(password)
                    )
                )
            su.execute("CREATE DATABASE pipelines")
            su.execute("REVOKE ALL ON DATABASE pipelines FROM PUBLIC")
            su.execute(
                sql.SQL("GRANT CONNECT ON DATABASE pipelines TO {}, {}").format(
                    sql.Identifier(OWNER), sql.Identifier(APP)
                )
            )
        with secured.admin() as su:
            su.execute(
                sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                    sql.Identifier(SECURED_SCHEMA), sql.Identifier(OWNER)
                )
            )
        # the owner's first start migrates the schema; then it grants the app role
        PostgresBackend(make_test_config(secured.owner_dsn, SECURED_SCHEMA), "setup").close()
        with psycopg.connect(secured.owner_dsn, autocommit=True) as owner:
            for statement in runtime_grants(SECURED_SCHEMA, APP):
                owner.execute(statement.encode())
        yield secured
    finally:
        server.close()
