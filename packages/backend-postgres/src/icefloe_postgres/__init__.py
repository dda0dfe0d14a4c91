"""PostgreSQL coordination backend for icefloe.

Attributes import on first use (icefloe.plugins.lazy).
"""

from typing import TYPE_CHECKING

from icefloe.plugins.lazy import lazy_exports

if TYPE_CHECKING:
    from icefloe_postgres.backend import PostgresBackend
    from icefloe_postgres.config import PostgresConfig
    from icefloe_postgres.coordinator_channel import PostgresCoordinatorChannel
    from icefloe_postgres.writer_channel import PostgresWriterChannel

__getattr__ = lazy_exports(
    __name__,
    {
        "PostgresBackend": "icefloe_postgres.backend",
        "PostgresConfig": "icefloe_postgres.config",
        "PostgresCoordinatorChannel": "icefloe_postgres.coordinator_channel",
        "PostgresWriterChannel": "icefloe_postgres.writer_channel",
    },
)
__all__ = [
    "PostgresBackend",
    "PostgresConfig",
    "PostgresCoordinatorChannel",
    "PostgresWriterChannel",
]
