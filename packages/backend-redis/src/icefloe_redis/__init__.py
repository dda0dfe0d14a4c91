"""Redis coordination backend for icefloe."""

from icefloe_redis.backend import (
    RedisBackend,
    RedisCoordinatorChannel,
    RedisStateLostError,
    RedisWriterChannel,
)
from icefloe_redis.config import RedisConfig

__all__ = [
    "RedisBackend",
    "RedisConfig",
    "RedisCoordinatorChannel",
    "RedisStateLostError",
    "RedisWriterChannel",
]
