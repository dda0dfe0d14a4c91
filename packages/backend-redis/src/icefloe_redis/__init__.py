"""Redis coordination backend for icefloe."""

from icefloe_redis.backend import RedisBackend
from icefloe_redis.config import RedisConfig
from icefloe_redis.coordinator_channel import RedisCoordinatorChannel
from icefloe_redis.writer_channel import RedisStateLostError, RedisWriterChannel

__all__ = [
    "RedisBackend",
    "RedisConfig",
    "RedisCoordinatorChannel",
    "RedisStateLostError",
    "RedisWriterChannel",
]
