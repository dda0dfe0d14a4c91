"""PostgreSQL coordination backend for icefloe."""

from icefloe_postgres.backend import (
    PostgresBackend,
    PostgresCoordinatorChannel,
    PostgresWriterChannel,
)
from icefloe_postgres.config import PostgresConfig

__all__ = [
    "PostgresBackend",
    "PostgresConfig",
    "PostgresCoordinatorChannel",
    "PostgresWriterChannel",
]
