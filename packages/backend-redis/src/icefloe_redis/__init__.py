"""Redis coordination backend for icefloe.

Attributes import on first use (icefloe.plugins.lazy).
"""

from typing import TYPE_CHECKING

from icefloe.plugins.lazy import lazy_exports

if TYPE_CHECKING:
    from icefloe_redis.backend import RedisBackend
    from icefloe_redis.config import RedisConfig
    from icefloe_redis.coordinator_channel import RedisCoordinatorChannel
    from icefloe_redis.writer_channel import RedisStateLostError, RedisWriterChannel

__getattr__ = lazy_exports(
    __name__,
    {
        "RedisBackend": "icefloe_redis.backend",
        "RedisConfig": "icefloe_redis.config",
        "RedisCoordinatorChannel": "icefloe_redis.coordinator_channel",
        "RedisStateLostError": "icefloe_redis.writer_channel",
        "RedisWriterChannel": "icefloe_redis.writer_channel",
    },
)
__all__ = [
    "RedisBackend",
    "RedisConfig",
    "RedisCoordinatorChannel",
    "RedisStateLostError",
    "RedisWriterChannel",
]
