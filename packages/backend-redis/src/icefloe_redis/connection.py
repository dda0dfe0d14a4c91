"""The connection the Redis channel ends share: a pooled client, the Lua scripts registered on
it, the pipeline's key names, and the blocking stream read both ends make.

The ends take a :class:`RedisConnection` rather than the backend, as the Kafka ends take
:class:`~icefloe_kafka.clients.KafkaClients`: it is all they use.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from icefloe.errors import ChannelError, ConfigError
from icefloe_redis import scripts
from icefloe_redis.config import RedisConfig
from icefloe_redis.keys import PipelineKeys

# redis-py types command replies as ``Awaitable[Any] | Any`` (sync and async share stubs), so
# replies are handled as Any and checked where they are used.
Client = Any

POOL_MAX_CONNECTIONS = 100  # per backend (process); callers beyond it wait their turn


@contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py's errors into the retryable ChannelError callers expect."""
    try:
        yield
    except RedisError as exc:
        raise ChannelError(f"redis {what} failed: {type(exc).__name__}: {exc}") from exc


def reply_text(value: Any) -> str:
    """A reply value as text: redis-py returns bytes unless the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_entries(reply: Any) -> list[Any]:
    """The entries of a non-empty XREAD reply for one stream, as ``(id, fields)`` pairs."""
    # RESP2: [[key, entries]]; RESP3 (protocol=3 in the URL): {key: [entries]}
    entries: list[Any] = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
    return entries


def _without_client_setinfo() -> dict[str, Any]:
    """What stops redis-py from sending CLIENT SETINFO on connect (Redis 7.2+): a command the
    least-privileged user of :mod:`icefloe_redis.permissions` is not granted, whose refusal on
    every connection would fill the server's ACL LOG. redis-py 8 takes ``driver_info=None``
    and warns about the older ``lib_name``/``lib_version``, which 5 to 7 take."""
    parameters = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    if "driver_info" in parameters:
        return {"driver_info": None}
    return {"lib_name": None, "lib_version": None}


def connect(config: RedisConfig) -> Client:
    """A redis-py client for ``config``; errors name the key and never show the password."""
    kwargs = {**config.client_kwargs(), **_without_client_setinfo()}
    try:
        if config.cluster:
            return RedisCluster.from_url(config.url, **kwargs)
        # a blocking pool: many writers of one process (publishing, answering, reading
        # broadcasts when woken) share the pool; redis-py's default pool raises MaxConnectionsError
        # past 100 concurrent calls instead of waiting for a connection
        pool = redis.BlockingConnectionPool.from_url(
            config.url,
            max_connections=POOL_MAX_CONNECTIONS,
            timeout=config.socket_timeout_s,
            **kwargs,
        )
        return redis.Redis(connection_pool=pool)
    except ValueError as exc:
        raise ConfigError(
            "coordination.redis.url",
            f"is not a usable Redis URL ({type(exc).__name__})",
            "use redis://[user:password@]host:port/db, rediss://... or unix:///path",
            config.safe_url,
        ) from None
    except RedisError as exc:
        raise ChannelError(f"cannot connect to Redis at {config.safe_url}: {exc}") from exc


class Scripts:
    """The backend's Lua scripts, registered once per client (EVALSHA, loaded on demand)."""

    def __init__(self, client: Client) -> None:
        self.open_writer = client.register_script(scripts.OPEN_WRITER)
        self.publish = client.register_script(scripts.PUBLISH)
        self.acquire = client.register_script(scripts.ACQUIRE)
        self.renew = client.register_script(scripts.RENEW)
        self.release = client.register_script(scripts.RELEASE)
        self.store_position = client.register_script(scripts.STORE_POSITION)
        self.broadcast = client.register_script(scripts.BROADCAST)
        self.prune = client.register_script(scripts.PRUNE)


class RedisConnection:
    """One pipeline (``group_id``) on one client: what the writer end, the coordinator end and
    the shared broadcast reader use. A client given by the caller stays the caller's to
    close."""

    def __init__(self, config: RedisConfig, group_id: str, client: Client | None = None) -> None:
        self.config = config
        self.group_id = group_id
        self.keys = PipelineKeys(config.key_prefix, group_id)  # checked before connecting
        self._owns_client = client is None
        self.client: Client = connect(config) if client is None else client
        self.scripts = Scripts(self.client)

    def read_stream(
        self, key: str, after: str, timeout: float, count: int
    ) -> list[tuple[str, bytes]]:
        """Entries of ``key`` after id ``after`` as (id, event bytes), waiting up to
        ``timeout`` in XREAD BLOCKs of at most ``max_block_s`` each."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            # BLOCK 0 would wait forever: no BLOCK at all when no time is left
            block = (
                None
                if remaining <= 0
                else max(1, int(min(remaining, self.config.max_block_s) * 1000))
            )
            with redis_errors("XREAD"):
                reply = self.client.xread({key: after}, count=count, block=block)
            if reply:
                return [
                    (reply_text(entry_id), fields.get(b"e", b""))
                    for entry_id, fields in stream_entries(reply)
                ]
            if block is None or time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
