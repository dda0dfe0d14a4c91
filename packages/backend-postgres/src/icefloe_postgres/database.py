"""The database access the backend and its ends share: a connection pool with the retry rule
every operation runs under, NOTIFY, the wait for rows that LISTEN wakes, and the context the
channel ends get."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed

from icefloe.errors import ChannelError
from icefloe_postgres.config import PostgresConfig, describe_dsn
from icefloe_postgres.listener import Listener, SharedListener
from icefloe_postgres.queries import Queries

log = logging.getLogger("icefloe_postgres.shared")

T = TypeVar("T")
Conn = psycopg.Connection[Any]


class Database:
    """A connection pool plus the retry rule shared by every operation."""

    def __init__(self, config: PostgresConfig, dsn: str) -> None:
        self.config = config
        self.dsn = dsn
        self.where = describe_dsn(dsn)
        self.connect_kwargs: dict[str, Any] = {
            "application_name": config.application_name,
            "connect_timeout": config.connect_timeout_s,
            # notice a dead peer (e.g. after a network cut) within about half a minute
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
        }
        self.pool: ConnectionPool[Conn] = ConnectionPool(
            dsn,
            min_size=config.pool_min_size,
            max_size=config.pool_max_size,
            kwargs={"autocommit": True, **self.connect_kwargs},
            configure=self._configure,
            timeout=config.pool_timeout_s,
            name=f"icefloe-postgres-{uuid.uuid4().hex[:8]}",
            open=False,
        )
        self.pool.open(wait=False)
        self._shared: dict[str, SharedListener] = {}
        self._shared_lock = threading.Lock()

    def _configure(self, conn: Conn) -> None:
        # The counter-row lock relies on READ COMMITTED re-reading the newest row version.
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        # A paused process holding the append lock must not block every writer forever.
        conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
            (str(int(self.config.transaction_timeout_s * 1000)),),
        )

    def run(self, what: str, fn: Callable[[Conn], T], timeout: float | None = None) -> T:
        """Run ``fn`` on a pooled connection, retrying on connection loss until ``timeout``
        (default ``retry_timeout_s``); then raise :class:`ChannelError`."""
        limit = time.monotonic() + (self.config.retry_timeout_s if timeout is None else timeout)
        # No pool-side check (a round trip per checkout, and a 1 s back-off when it fails): a
        # stale connection fails its first statement instead and is retried at once, because
        # every operation is safe to retry.
        delay = 0.0
        attempt = 0
        while True:
            attempt += 1
            try:
                with self.pool.connection() as conn:
                    return fn(conn)
            except PoolClosed as exc:
                raise ChannelError(f"postgres backend is closed ({what})") from exc
            except psycopg.OperationalError as exc:
                if time.monotonic() + delay > limit:
                    raise ChannelError(
                        f"PostgreSQL at {self.where}: {what} failed after {attempt} attempt(s): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                log.warning(
                    "PostgreSQL at %s: %s failed (%s), retrying",
                    self.where,
                    what,
                    type(exc).__name__,
                )
                time.sleep(delay)
                delay = min(max(delay * 2, 0.05), 1.0)

    def listener(self, channels: Sequence[str]) -> Listener:
        return Listener(self.dsn, channels, self.connect_kwargs)

    def shared_listener(self, channel: str) -> SharedListener:
        """The one LISTEN connection on ``channel`` that this backend's writers share."""
        with self._shared_lock:
            shared = self._shared.get(channel)
            if shared is None:
                shared = self._shared[channel] = SharedListener(
                    self.dsn, channel, self.connect_kwargs
                )
            return shared

    def close(self) -> None:
        with self._shared_lock:
            shared, self._shared = list(self._shared.values()), {}
        for listener in shared:
            listener.close()
        self.pool.close()


@dataclass(frozen=True)
class ChannelContext:
    """What the channel ends of one pipeline use, and nothing more of the backend (as the
    Kafka ends take ``KafkaClients``): the pool, the statements, the pipeline's NOTIFY
    channels and the settings they read."""

    config: PostgresConfig
    group_id: str
    db: Database
    q: Queries
    events_channel: str
    broadcasts_channel: str
    lease_channel: str

    @property
    def schema(self) -> str:
        return self.config.schema_name


def notify(conn: Conn, channel: str) -> None:
    conn.execute("SELECT pg_notify(%s, '')", (channel,))


def wait_for_rows(
    fetch: Callable[[], list[T]],
    listener: Listener,
    channels: Sequence[str],
    timeout: float,
    poll_interval: float,
) -> list[T]:
    """Query; if nothing, wait for a NOTIFY (or the fallback interval) and query again until
    ``timeout``. LISTEN is in place before the first query, so no commit is missed."""
    deadline = time.monotonic() + max(0.0, timeout)
    listener.ensure()
    listener.take(channels)
    while True:
        rows = fetch()
        remaining = deadline - time.monotonic()
        if rows or remaining <= 0:
            return rows
        listener.wait(channels, min(remaining, poll_interval))
