"""The least privilege the backend needs: the grants of a role that runs pipelines on a schema
another role owns and migrates (docs/operations.md lists them; the tests run the conformance
suite as a role with exactly these grants, so a privilege missing here fails a test).

``SELECT ... FOR SHARE`` / ``FOR UPDATE`` need ``UPDATE`` as well as ``SELECT``, which is why
``writers`` and ``leases`` have it. ``LISTEN``, ``pg_notify``, advisory locks and reading one's
own sessions in ``pg_stat_activity`` need no grant.
"""

from __future__ import annotations

from psycopg import sql

#: per table of :mod:`icefloe_postgres.migrations`, what the statements of
#: :mod:`icefloe_postgres.queries` do to it
TABLE_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "schema_migrations": ("SELECT",),
    "channel_identity": ("SELECT",),
    "groups": ("SELECT", "INSERT", "UPDATE"),
    "writers": ("SELECT", "INSERT", "UPDATE"),
    "batches": ("SELECT", "INSERT", "DELETE"),
    "events": ("SELECT", "INSERT", "DELETE"),
    "source_positions": ("SELECT", "INSERT", "UPDATE"),
    "leases": ("SELECT", "INSERT", "UPDATE"),
    "broadcasts": ("SELECT", "INSERT", "DELETE"),
    "positions": ("SELECT", "INSERT", "UPDATE"),
}


def runtime_grants(schema: str = "icefloe", role: str = "icefloe_app") -> list[str]:
    """The GRANT statements (run by the schema's owner, after the migrations) that let
    ``role`` run pipelines on ``schema`` and nothing more: no DDL, no TRUNCATE, no table it
    does not use. The role also needs CONNECT on the database (PUBLIC has it by default)."""
    schema_id, role_id = sql.Identifier(schema), sql.Identifier(role)
    out = [sql.SQL("GRANT USAGE ON SCHEMA {} TO {};").format(schema_id, role_id)]
    for table, privileges in TABLE_PRIVILEGES.items():
        out.append(
            sql.SQL("GRANT {} ON {} TO {};").format(
                sql.SQL(", ").join(sql.SQL(p) for p in privileges),
                sql.Identifier(schema, table),
                role_id,
            )
        )
    return [statement.as_string(None) for statement in out]
