"""Versioned migrations: idempotent, safe when several processes start at once, upgradable,
and refusing a schema from a newer version."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from psycopg import sql

from icefloe_postgres import migrations
from icefloe_postgres.migrations import (
    MIGRATIONS,
    Migration,
    SchemaVersionError,
    latest_version,
    migrate,
    schema_version,
)
from icefloe_postgres.testing import BackendMaker, drop_schema

TABLES = {"schema_migrations", *migrations.TABLES}


def tables_in(dsn: str, schema: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchall()
    return {r[0] for r in rows}


def test_migrate_is_idempotent(pg_dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert schema_version(conn, fresh_schema) is None
        assert migrate(conn, fresh_schema) == [m.version for m in MIGRATIONS]
        assert migrate(conn, fresh_schema) == []
        assert schema_version(conn, fresh_schema) == latest_version()
    assert tables_in(pg_dsn, fresh_schema) == TABLES


def test_concurrent_starts_apply_each_migration_once(pg_dsn: str, fresh_schema: str) -> None:
    n = 6
    barrier = threading.Barrier(n)
    applied: list[list[int]] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                barrier.wait()
                applied.append(migrate(conn, fresh_schema))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(applied, key=len) == [[]] * (n - 1) + [[m.version for m in MIGRATIONS]]
    with psycopg.connect(pg_dsn) as conn:
        count = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.schema_migrations").format(
                sql.Identifier(fresh_schema)
            )
        ).fetchone()
    assert count == (len(MIGRATIONS),)


def test_upgrade_applies_only_new_versions_and_newer_schema_is_refused(
    pg_dsn: str, fresh_schema: str
) -> None:
    extra = Migration(
        latest_version() + 1, "test column", ("ALTER TABLE {s}.groups ADD COLUMN note text",)
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, fresh_schema)
        assert migrate(conn, fresh_schema, (*MIGRATIONS, extra)) == [extra.version]
        assert schema_version(conn, fresh_schema) == extra.version
        # an older icefloe must not touch a schema it does not understand
        with pytest.raises(SchemaVersionError, match="upgrade icefloe-backend-postgres"):
            migrate(conn, fresh_schema)


def test_upgrade_from_the_first_version_keeps_the_data(pg_dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert migrate(conn, fresh_schema, MIGRATIONS[:1]) == [1]
        leases = sql.Identifier(fresh_schema, "leases")
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (group_id, holder, instance, token, expires_at)"
                " VALUES ('g', 'c', 'i', 7, now())"
            ).format(leases)
        )
        assert migrate(conn, fresh_schema) == [m.version for m in MIGRATIONS[1:]]
        row = conn.execute(
            sql.SQL("SELECT token, holder_pid FROM {} WHERE group_id = 'g'").format(leases)
        ).fetchone()
    assert row == (7, None)


def test_failed_migration_leaves_nothing_behind(pg_dsn: str, fresh_schema: str) -> None:
    broken = Migration(
        latest_version() + 1,
        "fails half way",
        (
            "CREATE TABLE {s}.half_made (x int)",
            "ALTER TABLE {s}.no_such_table ADD COLUMN y int",
        ),
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, fresh_schema)
        with pytest.raises(psycopg.errors.UndefinedTable):
            migrate(conn, fresh_schema, (*MIGRATIONS, broken))
        assert schema_version(conn, fresh_schema) == latest_version()
    assert "half_made" not in tables_in(pg_dsn, fresh_schema)


def test_schema_name_is_quoted_not_formatted(pg_dsn: str, make_backend: BackendMaker) -> None:
    """A schema name SQL would choke on, unquoted, works: identifiers go through psycopg.sql."""
    odd = f'Ice "floe"; DROP TABLE x; -- {uuid.uuid4().hex[:6]}'
    try:
        backend = make_backend(schema=odd)
        w = backend.writer("w")
        assert w.open() > 0
        assert tables_in(pg_dsn, odd) >= TABLES
    finally:
        drop_schema(pg_dsn, odd)
