"""Fixtures: the shared PostgreSQL at 127.0.0.1:5432 (a private schema per test session) and
private PostgreSQL servers for restart tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from icefloe.events import WriterRef
from icefloe_postgres import PostgresBackend, PostgresCoordinatorChannel, PostgresWriterChannel
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
