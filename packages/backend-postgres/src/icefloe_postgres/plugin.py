"""icefloe plugin entry point (hook implementations)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_postgres.config import PostgresConfig

if TYPE_CHECKING:
    from icefloe_postgres.backend import PostgresBackend


def create_backend(config: PostgresConfig, context: BackendContext) -> PostgresBackend:
    """Factory called by ``icefloe.plugins.backends.open_backend`` with the validated section.
    The backend module (psycopg's pool) is imported here: every CLI command loads this plugin,
    few open a PostgreSQL channel."""
    from icefloe_postgres.backend import PostgresBackend

    return PostgresBackend(config, context.group_id, context.lease_ttl_s)


@hookimpl
def icefloe_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="postgres",
            config_model=PostgresConfig,
            factory=create_backend,
            description="PostgreSQL tables: ordered event log, fenced writers, lease row",
            contract=2,  # docs/backend-authors.md, "Contract versions"
        )
    ]
