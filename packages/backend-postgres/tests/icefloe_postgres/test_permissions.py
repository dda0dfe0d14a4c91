"""Least privilege, as docs/operations.md writes it down: the schema's owner migrates it with
no CREATE on the database, a role with only :func:`runtime_grants` runs pipelines (and says
how to fix it when the schema needs a migration it may not run), every one of those grants is
needed, and the docs show the grants the code defines."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from icefloe.events import Event, StartCommit, WriterRef
from icefloe_postgres import PostgresBackend
from icefloe_postgres.migrations import SchemaPermissionError
from icefloe_postgres.permissions import TABLE_PRIVILEGES, runtime_grants
from icefloe_postgres.testing import make_test_config

from .conftest import APP, OWNER, SecuredPostgres
from .test_reset import one_event_batch

OPERATIONS_MD = Path(__file__).resolve().parents[4] / "docs" / "operations.md"


@pytest.fixture
def owned_schema(secured_pg: SecuredPostgres) -> Iterator[str]:
    """A new, empty schema the owner role owns (created by the superuser, as a DBA would)."""
    schema = f"owned_{uuid.uuid4().hex[:8]}"
    with secured_pg.admin() as su:
        su.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(schema), sql.Identifier(OWNER)
            )
        )
    yield schema
    with secured_pg.admin() as su:
        su.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def backend(dsn: str, schema: str, group: str = "g") -> PostgresBackend:
    return PostgresBackend(
        make_test_config(dsn, schema, retry_timeout_s=2.0, poll_interval_s=0.05), group, 2.0
    )


def run_a_pipeline(b: PostgresBackend) -> None:
    """Every statement the backend has: register, publish twice, answer, lead, read,
    broadcast, store, prune (retention 0: the deletes run), identity, status, release."""
    writer = b.writer("w")
    ref = WriterRef("w", writer.open())
    assert writer.publish(one_event_batch(b.group_id, ref, 1))
    assert writer.publish(one_event_batch(b.group_id, ref, 2))
    assert writer.source_positions()
    coordinator = b.coordinator("c")
    assert coordinator.acquire(5.0) is not None
    coordinator.renew()
    coordinator.seek(None)
    records = coordinator.poll(2.0)
    coordinator.broadcast(Event(b.group_id, StartCommit("c-1")))
    writer.poll_broadcasts(2.0)
    writer.respond(Event(b.group_id, StartCommit("c-1"), writer=ref))
    end = {"0": records[-1].offset + 1}
    coordinator.store_position(end)
    assert coordinator.stored_position() == end
    coordinator.prune(end)
    coordinator.channel_id()
    coordinator.end_position()
    b.describe()
    assert b.doctor() == []
    coordinator.release()


def test_the_owner_of_an_existing_schema_migrates_it_without_create_on_the_database(
    secured_pg: SecuredPostgres, owned_schema: str
) -> None:
    b = backend(secured_pg.owner_dsn, owned_schema)
    b.close()
    with secured_pg.admin() as su:
        row = su.execute(
            sql.SQL("SELECT max(version) FROM {}.schema_migrations").format(
                sql.Identifier(owned_schema)
            )
        ).fetchone()
    assert row is not None
    assert row[0] == 3


def test_a_role_with_only_the_runtime_grants_runs_a_pipeline(
    secured_pg: SecuredPostgres, owned_schema: str
) -> None:
    backend(secured_pg.owner_dsn, owned_schema).close()
    with psycopg.connect(secured_pg.owner_dsn, autocommit=True) as owner:
        for statement in runtime_grants(owned_schema, APP):
            owner.execute(statement.encode())
    b = backend(secured_pg.app_dsn, owned_schema)
    try:
        run_a_pipeline(b)
    finally:
        b.close()


def test_the_runtime_role_cannot_migrate_and_says_how_to_fix_it(
    secured_pg: SecuredPostgres, owned_schema: str
) -> None:
    with secured_pg.admin() as su:
        su.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(owned_schema), sql.Identifier(APP)
            )
        )
    with pytest.raises(SchemaPermissionError) as info:
        backend(secured_pg.app_dsn, owned_schema)
    message = str(info.value)
    assert f"role '{APP}'" in message
    assert f"schema '{owned_schema}'" in message
    assert "permission denied" in message
    assert "owner" in message
    assert "docs/operations.md" in message


def open_and_run(dsn: str, schema: str, group: str, closing: ThreadPoolExecutor) -> None:
    """Open a backend and run a pipeline on it; its close is left to ``closing``."""
    b = backend(dsn, schema, group)
    try:
        run_a_pipeline(b)
    finally:
        closing.submit(b.close)


def test_every_runtime_grant_is_needed(secured_pg: SecuredPostgres, owned_schema: str) -> None:
    """Revoke one privilege at a time: the pipeline run must then fail."""
    backend(secured_pg.owner_dsn, owned_schema).close()
    # a backend's close waits up to half a second for its LISTEN thread: close them meanwhile
    with (
        psycopg.connect(secured_pg.owner_dsn, autocommit=True) as owner,
        ThreadPoolExecutor(max_workers=8) as closing,
    ):
        for statement in runtime_grants(owned_schema, APP):
            owner.execute(statement.encode())
        needed = [(t, p) for t, privileges in TABLE_PRIVILEGES.items() for p in privileges]
        for n, (table, privilege) in enumerate(needed):
            change = sql.SQL("{} {} ON {} {} {}")
            target, role = sql.Identifier(owned_schema, table), sql.Identifier(APP)
            owner.execute(
                change.format(sql.SQL("REVOKE"), sql.SQL(privilege), target, sql.SQL("FROM"), role)
            )
            with pytest.raises(Exception, match="permission denied"):
                open_and_run(secured_pg.app_dsn, owned_schema, f"g{n}", closing)
            owner.execute(
                change.format(sql.SQL("GRANT"), sql.SQL(privilege), target, sql.SQL("TO"), role)
            )


def test_operations_doc_shows_the_grants_the_code_defines() -> None:
    text = OPERATIONS_MD.read_text()
    for statement in runtime_grants():
        assert statement in text
