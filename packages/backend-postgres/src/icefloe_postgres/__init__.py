"""PostgreSQL coordination backend for icefloe."""

from icefloe_postgres.backend import PostgresBackend
from icefloe_postgres.config import PostgresConfig
from icefloe_postgres.coordinator_channel import PostgresCoordinatorChannel
from icefloe_postgres.writer_channel import PostgresWriterChannel

__all__ = [
    "PostgresBackend",
    "PostgresConfig",
    "PostgresCoordinatorChannel",
    "PostgresWriterChannel",
]
