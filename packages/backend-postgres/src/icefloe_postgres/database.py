"""PostgreSQL coordination backend: event log, writer fencing, leader lease, wake-ups.

Design (see ``docs/backends/postgres.md`` for the long form):

* **Ordered log without gaps in visibility.** A sequence is not committed in order, so a
  reader could skip an event whose transaction took a lower id but committed later. Every
  append therefore takes the row lock of its pipeline's ``groups`` row and assigns offsets from
  that row's counter inside the publishing transaction. The lock is held until commit, so
  commit order equals offset order, and no event ever appears below an offset the coordinator
  has already read past. The channel has one partition, ``"0"``.
* **Publish is one transaction**: the writer's epoch is checked (``FOR SHARE`` on its
  ``writers`` row, so a concurrent ``open()`` waits for it and then fences), the batch key
  (group, writer, batch_seq) is inserted under a primary key (a replay adds nothing and
  returns False), the events are appended, the batch's source positions are upserted (offsets
  stored with the data they describe, as KIP-892 argues) and a NOTIFY is queued.
* **Leadership is a lease row** (group, holder, instance, token, expires_at) judged by the
  database clock only, so clock skew between hosts does not matter. Taking over an expired or
  released lease increments ``token``; it never decreases. ``store_position`` and
  ``broadcast`` verify the token inside their own transaction (the row is locked), so a
  fenced leader gets :class:`NotLeaderError` and writes nothing. A dead leader's lease expires
  after ``lease_ttl_s``; sooner, a contender sees that the session of the holder's LISTEN
  connection (pid and start time, kept in the lease row) no longer exists in
  ``pg_stat_activity`` and takes over at once. ``release()`` hands over at once too and
  NOTIFYs waiting contenders.
* **Wake-ups** use LISTEN/NOTIFY on a dedicated connection per coordinator end and one
  connection shared by all writers of a backend (:class:`SharedListener`); the NOTIFY is
  sent by the publishing transaction, so it is delivered exactly when the rows are visible.
  Polling every ``poll_interval_s`` is the fallback.
* **Failures**: every operation runs on a pooled connection and is retried on connection
  errors for up to ``retry_timeout_s``. Retrying is safe because every write is idempotent:
  publish by batch key, respond and broadcast by event id, positions by upsert, acquire by
  the instance id stored in the lease row.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolClosed

from icefloe.errors import ChannelError, EventDecodeError
from icefloe.events import Event, decode_event
from icefloe_postgres.config import PostgresConfig, describe_dsn
from icefloe_postgres.listener import Listener, SharedListener

log = logging.getLogger(__name__)

PARTITION = "0"
# the database clock in milliseconds, the floor of every epoch and fencing token
_CLOCK_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
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


class Queries:
    """Every statement, composed once per schema with quoted identifiers."""

    def __init__(self, schema: str) -> None:
        def q(text: str) -> sql.Composed:
            names = (
                "groups",
                "writers",
                "batches",
                "events",
                "source_positions",
                "leases",
                "broadcasts",
                "positions",
                "channel_identity",
            )
            return sql.SQL(text).format(**{n: sql.Identifier(schema, n) for n in names})

        self.ensure_group = q(
            "INSERT INTO {groups} (group_id) VALUES (%s) ON CONFLICT (group_id) DO NOTHING"
        )
        # epochs and tokens start from the clock (ms), as in the other backends, so a
        # recreated schema cannot issue numbers that tables or writers already hold
        self.open_writer = q(
            "INSERT INTO {writers} AS w (group_id, writer_id, epoch)"
            f" VALUES (%s, %s, {_CLOCK_MS})"
            " ON CONFLICT (group_id, writer_id)"
            f" DO UPDATE SET epoch = greatest(w.epoch + 1, {_CLOCK_MS}),"
            " opened_at = clock_timestamp()"
            " RETURNING epoch"
        )
        self.broadcast_head = q("SELECT broadcast_seq FROM {leases} WHERE group_id = %s")
        self.writer_epoch = q(
            "SELECT epoch FROM {writers} WHERE group_id = %s AND writer_id = %s FOR SHARE"
        )
        self.batch_exists = q(
            "SELECT publish_id FROM {batches}"
            " WHERE group_id = %s AND writer_id = %s AND batch_seq = %s"
        )
        self.event_exists = q("SELECT 1 FROM {events} WHERE group_id = %s AND event_id = %s")
        # the row lock taken here is what makes commit order equal offset order
        self.take_offsets = q(
            "UPDATE {groups} SET next_offset = next_offset + %s WHERE group_id = %s"
            " RETURNING next_offset - %s"
        )
        self.insert_batch = q(
            "INSERT INTO {batches}"
            " (group_id, writer_id, batch_seq, epoch, first_offset, event_count, publish_id)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (group_id, writer_id, batch_seq) DO NOTHING RETURNING 1"
        )
        self.insert_events = q(
            "INSERT INTO {events}"
            " (group_id, event_offset, event_id, event_type, writer_id, epoch, batch_seq,"
            " payload)"
            " SELECT %(g)s, %(first)s + t.ord - 1, t.event_id, t.event_type, %(w)s, %(epoch)s,"
            " %(seq)s, t.payload"
            " FROM unnest(%(ids)s::text[], %(types)s::text[], %(payloads)s::bytea[])"
            " WITH ORDINALITY AS t(event_id, event_type, payload, ord)"
        )
        self.upsert_sources = q(
            "INSERT INTO {source_positions} AS sp"
            " (group_id, writer_id, topic, source_partition, next_offset, max_timestamp_ms,"
            " batch_seq)"
            " SELECT %(g)s, %(w)s, t.topic, t.part, t.off, t.ts, %(seq)s"
            " FROM unnest(%(topics)s::text[], %(parts)s::int[], %(offs)s::bigint[],"
            " %(tss)s::bigint[]) AS t(topic, part, off, ts)"
            " ON CONFLICT (group_id, writer_id, topic, source_partition) DO UPDATE SET"
            " next_offset = excluded.next_offset, max_timestamp_ms = excluded.max_timestamp_ms,"
            " batch_seq = excluded.batch_seq, updated_at = clock_timestamp()"
        )
        self.source_positions = q(
            "SELECT topic, source_partition, next_offset, max_timestamp_ms"
            " FROM {source_positions} WHERE group_id = %s AND writer_id = %s"
            " ORDER BY topic, source_partition"
        )
        self.read_events = q(
            "SELECT event_offset, payload FROM {events}"
            " WHERE group_id = %s AND event_offset >= %s ORDER BY event_offset LIMIT %s"
        )
        self.read_broadcasts = q(
            "SELECT seq, payload FROM {broadcasts}"
            " WHERE group_id = %s AND seq > %s ORDER BY seq LIMIT %s"
        )
        self.lease_for_update = q(
            "SELECT l.instance, l.token, l.expires_at <= clock_timestamp(),"
            " extract(epoch FROM l.expires_at - clock_timestamp())::float8,"
            # the holder's LISTEN session is gone (pid reuse can only make it look alive;
            # backend_start is NULL for other roles' sessions without pg_read_all_stats)
            " l.holder_pid IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a"
            "  WHERE a.pid = l.holder_pid AND (a.backend_start IS NULL"
            "  OR l.holder_session_start IS NULL OR a.backend_start = l.holder_session_start))"
            " FROM {leases} l WHERE l.group_id = %s FOR UPDATE OF l"
        )
        self.insert_lease = q(
            "INSERT INTO {leases} (group_id, holder, instance, token, expires_at, holder_pid,"
            " holder_session_start)"
            f" VALUES (%(g)s, %(holder)s, %(instance)s, {_CLOCK_MS},"
            " clock_timestamp() + make_interval(secs => %(ttl)s), %(pid)s, %(started)s)"
            " ON CONFLICT (group_id) DO NOTHING"
            " RETURNING token, extract(epoch FROM expires_at - clock_timestamp())::float8"
        )
        self.take_lease = q(
            "UPDATE {leases} SET holder = %(holder)s, instance = %(instance)s,"
            f" token = greatest(token + 1, {_CLOCK_MS}),"
            " expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),"
            " acquired_at = clock_timestamp(), holder_pid = %(pid)s,"
            " holder_session_start = %(started)s"
            " WHERE group_id = %(g)s"
            " RETURNING token, extract(epoch FROM expires_at - clock_timestamp())::float8"
        )
        self.renew_lease = q(
            "UPDATE {leases} SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),"
            " holder_pid = %(pid)s, holder_session_start = %(started)s"
            " WHERE group_id = %(g)s AND instance = %(instance)s AND token = %(token)s"
            " RETURNING token, extract(epoch FROM expires_at - clock_timestamp())::float8"
        )
        self.release_lease = q(
            "UPDATE {leases} SET instance = NULL, expires_at = clock_timestamp()"
            " WHERE group_id = %s AND instance = %s"
        )
        self.lease_token_for_share = q("SELECT token FROM {leases} WHERE group_id = %s FOR SHARE")
        self.broadcast_exists = q(
            "SELECT 1 FROM {broadcasts} WHERE group_id = %s AND event_id = %s"
        )
        # checks the token and assigns the next broadcast number under the lease row's lock
        self.take_broadcast_seq = q(
            "UPDATE {leases} SET broadcast_seq = broadcast_seq + 1"
            " WHERE group_id = %s AND token = %s RETURNING broadcast_seq"
        )
        self.insert_broadcast = q(
            "INSERT INTO {broadcasts} (group_id, seq, event_id, event_type, token, payload)"
            " VALUES (%s, %s, %s, %s, %s, %s)"
        )
        self.upsert_position = q(
            "INSERT INTO {positions} AS p (group_id, channel_partition, next_offset, token)"
            " SELECT %(g)s, t.part, t.off, %(token)s"
            " FROM unnest(%(parts)s::text[], %(offs)s::bigint[]) AS t(part, off)"
            " ON CONFLICT (group_id, channel_partition) DO UPDATE SET"
            " next_offset = excluded.next_offset, token = excluded.token,"
            " stored_at = clock_timestamp()"
        )
        self.channel_id = q("SELECT channel_id FROM {channel_identity}")
        self.end_offset = q("SELECT next_offset FROM {groups} WHERE group_id = %s")
        self.read_positions = q(
            "SELECT channel_partition, next_offset FROM {positions} WHERE group_id = %s"
        )
        self.prune_events = q(
            "DELETE FROM {events} WHERE group_id = %s AND event_offset < %s"
            " AND created_at < clock_timestamp() - make_interval(secs => %s)"
        )
        # keep each writer's newest batch key: that is the one a restarted writer replays
        self.prune_batches = q(
            "DELETE FROM {batches} b WHERE b.group_id = %s"
            " AND b.first_offset + b.event_count <= %s"
            " AND b.published_at < clock_timestamp() - make_interval(secs => %s)"
            " AND b.batch_seq < (SELECT max(b2.batch_seq) FROM {batches} b2"
            " WHERE b2.group_id = b.group_id AND b2.writer_id = b.writer_id)"
        )
        self.prune_broadcasts = q(
            "DELETE FROM {broadcasts} WHERE group_id = %s"
            " AND created_at < clock_timestamp() - make_interval(secs => %s)"
        )


def notify(conn: Conn, channel: str) -> None:
    conn.execute("SELECT pg_notify(%s, '')", (channel,))


def decode_events(rows: Sequence[tuple[int, bytes]]) -> list[tuple[int, Event]]:
    """Decode rows in order. A row that is not an icefloe event raises only when it comes
    first; otherwise the events before it are returned and the next read raises."""
    out: list[tuple[int, Event]] = []
    for offset, payload in rows:
        try:
            out.append((offset, decode_event(payload)))
        except EventDecodeError as exc:
            if out:
                break
            raise EventDecodeError(f"event at offset {offset}: {exc}") from exc
    return out


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
