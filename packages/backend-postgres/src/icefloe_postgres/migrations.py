"""Versioned schema migrations the backend runs itself on start.

Each migration runs once, in order, inside one transaction that holds a transaction-level
advisory lock derived from the schema name: two processes starting at once serialise on the
lock, and the second finds the versions already recorded in ``schema_migrations`` and does
nothing. DDL is transactional in PostgreSQL, so a failed migration leaves no half-made schema.
Identifiers are composed with :mod:`psycopg.sql`, never formatted into strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from icefloe.errors import IcefloeError


class SchemaVersionError(IcefloeError):
    """The schema was migrated by a newer icefloe than this one; refusing to touch it."""


class SchemaPermissionError(IcefloeError):
    """The schema needs a migration the connecting role is not allowed to run."""


@dataclass(frozen=True)
class Migration:
    """One schema version: statements with ``{s}`` standing for the quoted schema name."""

    version: int
    description: str
    statements: tuple[str, ...]

    def compose(self, schema: str) -> list[sql.Composed]:
        ident = sql.Identifier(schema)
        return [sql.SQL(stmt).format(s=ident) for stmt in self.statements]


#: the tables the migrations create (besides ``schema_migrations``): the ones the queries use
TABLES = (
    "groups",
    "writers",
    "batches",
    "events",
    "source_positions",
    "leases",
    "broadcasts",
    "positions",
    "channel_identity",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "event log, writer epochs, batch keys, source positions, leases, broadcasts, positions",
        (
            # one row per pipeline; its row lock serialises appends (commit order == offsets)
            """CREATE TABLE {s}.groups (
                group_id text PRIMARY KEY,
                next_offset bigint NOT NULL DEFAULT 0,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp()
            )""",
            """CREATE TABLE {s}.writers (
                group_id text NOT NULL,
                writer_id text NOT NULL,
                epoch bigint NOT NULL,
                opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, writer_id)
            )""",
            """CREATE TABLE {s}.batches (
                group_id text NOT NULL,
                writer_id text NOT NULL,
                batch_seq bigint NOT NULL,
                epoch bigint NOT NULL,
                first_offset bigint NOT NULL,
                event_count integer NOT NULL,
                publish_id text NOT NULL,
                published_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, writer_id, batch_seq)
            )""",
            """CREATE TABLE {s}.events (
                group_id text NOT NULL,
                event_offset bigint NOT NULL,
                event_id text NOT NULL,
                event_type text NOT NULL,
                writer_id text,
                epoch bigint,
                batch_seq bigint,
                payload bytea NOT NULL,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, event_offset)
            )""",
            "CREATE UNIQUE INDEX events_event_id ON {s}.events (group_id, event_id)",
            """CREATE TABLE {s}.source_positions (
                group_id text NOT NULL,
                writer_id text NOT NULL,
                topic text NOT NULL,
                source_partition integer NOT NULL,
                next_offset bigint NOT NULL,
                max_timestamp_ms bigint,
                batch_seq bigint NOT NULL,
                updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, writer_id, topic, source_partition)
            )""",
            """CREATE TABLE {s}.leases (
                group_id text PRIMARY KEY,
                holder text,
                instance text,
                token bigint NOT NULL,
                expires_at timestamptz NOT NULL,
                acquired_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                broadcast_seq bigint NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE {s}.broadcasts (
                group_id text NOT NULL,
                seq bigint NOT NULL,
                event_id text NOT NULL,
                event_type text NOT NULL,
                token bigint NOT NULL,
                payload bytea NOT NULL,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, seq)
            )""",
            "CREATE UNIQUE INDEX broadcasts_event_id ON {s}.broadcasts (group_id, event_id)",
            """CREATE TABLE {s}.positions (
                group_id text NOT NULL,
                channel_partition text NOT NULL,
                next_offset bigint NOT NULL,
                token bigint NOT NULL,
                stored_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                PRIMARY KEY (group_id, channel_partition)
            )""",
        ),
    ),
    Migration(
        2,
        "lease row records the holder's session, so a contender sees a dead leader at once",
        (
            "ALTER TABLE {s}.leases ADD COLUMN holder_pid integer,"
            " ADD COLUMN holder_session_start timestamptz",
        ),
    ),
    Migration(
        3,
        "channel identity born with the schema; counters start from the clock",
        (
            # one row: a schema recreated (or a new database) is a new channel; a backup
            # restores the same identity, which is what end_position() checks catch
            """CREATE TABLE {s}.channel_identity (
                singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                channel_id text NOT NULL DEFAULT gen_random_uuid()::text,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp()
            )""",
            "INSERT INTO {s}.channel_identity DEFAULT VALUES",
            # offsets of a recreated schema never reuse numbers a table already recorded
            "ALTER TABLE {s}.groups ALTER COLUMN next_offset"
            " SET DEFAULT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        ),
    ),
)


def lock_key(schema: str) -> int:
    """The advisory-lock key guarding migrations of ``schema`` (a signed 64-bit int)."""
    digest = hashlib.sha256(f"icefloe-postgres-migrate:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def latest_version(migrations: Sequence[Migration] = MIGRATIONS) -> int:
    return max(m.version for m in migrations)


def migrate(
    conn: psycopg.Connection[Any],
    schema: str,
    migrations: Sequence[Migration] = MIGRATIONS,
) -> list[int]:
    """Bring ``schema`` to the newest version; return the versions applied by this call.

    A schema already at the newest version is only read, so a role with nothing but the
    grants of :func:`icefloe_postgres.permissions.runtime_grants` can start; an existing
    schema is not created again, so its owner needs no CREATE on the database. A migration
    the role may not run raises :class:`SchemaPermissionError` naming the fix.

    ``conn`` must be in autocommit mode (the whole upgrade is one explicit transaction).
    """
    versions = [m.version for m in migrations]
    if versions != sorted(set(versions)):
        raise ValueError("migration versions must be unique and ascending")
    try:
        if schema_version(conn, schema) == latest_version(migrations):
            return []
        return _migrate_locked(conn, schema, migrations)
    except psycopg.errors.InsufficientPrivilege as exc:
        role = conn.info.parameter_status("session_authorization") or conn.info.user
        raise SchemaPermissionError(
            f"role '{role}' cannot create or migrate schema '{schema}' ({exc}). Start icefloe "
            "once as the schema's owner (or a role with CREATE on the database) to migrate "
            "it, then give this role the grants of docs/operations.md (least privilege)"
        ) from None


def _migrate_locked(
    conn: psycopg.Connection[Any], schema: str, migrations: Sequence[Migration]
) -> list[int]:
    """The migrations, under the schema's advisory lock, in one transaction."""
    ident = sql.Identifier(schema)
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(schema),))
        exists = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        if exists.fetchone() is None:  # CREATE SCHEMA checks CREATE on the database first
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY,"
                " description text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(ident)
        )
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(ident)
        ).fetchone()
        current = int(row[0]) if row else 0
        if current > latest_version(migrations):
            raise SchemaVersionError(
                f"schema '{schema}' is at version {current}, newer than this icefloe-backend-"
                f"postgres knows ({latest_version(migrations)}); upgrade icefloe-backend-postgres"
                " or use another schema"
            )
        for m in migrations:
            if m.version <= current:
                continue
            for stmt in m.compose(schema):
                conn.execute(stmt)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.schema_migrations (version, description) VALUES (%s, %s)"
                ).format(ident),
                (m.version, m.description),
            )
            applied.append(m.version)
    return applied


def schema_version(conn: psycopg.Connection[Any], schema: str) -> int | None:
    """The version recorded in ``schema``, or None when it was never migrated."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        (sql.Identifier(schema, "schema_migrations").as_string(conn),),
    ).fetchone()
    if not row or not row[0]:
        return None
    got = conn.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    return int(got[0]) if got else None
