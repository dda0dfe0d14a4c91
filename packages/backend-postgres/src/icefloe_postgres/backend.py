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
* **Wake-ups** use LISTEN/NOTIFY on a dedicated connection per channel end; the NOTIFY is
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
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolClosed

from icefloe.channel import (
    Backend,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
)
from icefloe.errors import ChannelError, EventDecodeError, NotLeaderError, WriterFencedError
from icefloe.events import Event, SourcePosition, decode_event, encode_event
from icefloe_postgres.config import PostgresConfig, describe_dsn
from icefloe_postgres.listener import Listener, channel_name
from icefloe_postgres.migrations import latest_version, migrate, schema_version

log = logging.getLogger(__name__)

PARTITION = "0"
T = TypeVar("T")
Conn = psycopg.Connection[Any]


class _ReplayError(Exception):
    """Raised inside a transaction to roll it back when the batch key already exists."""


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

    def close(self) -> None:
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
            )
            return sql.SQL(text).format(**{n: sql.Identifier(schema, n) for n in names})

        self.ensure_group = q(
            "INSERT INTO {groups} (group_id) VALUES (%s) ON CONFLICT (group_id) DO NOTHING"
        )
        self.open_writer = q(
            "INSERT INTO {writers} AS w (group_id, writer_id, epoch) VALUES (%s, %s, 1)"
            " ON CONFLICT (group_id, writer_id)"
            " DO UPDATE SET epoch = w.epoch + 1, opened_at = clock_timestamp()"
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
            " VALUES (%(g)s, %(holder)s, %(instance)s, 1,"
            " clock_timestamp() + make_interval(secs => %(ttl)s), %(pid)s, %(started)s)"
            " ON CONFLICT (group_id) DO NOTHING"
            " RETURNING token, extract(epoch FROM expires_at - clock_timestamp())::float8"
        )
        self.take_lease = q(
            "UPDATE {leases} SET holder = %(holder)s, instance = %(instance)s,"
            " token = token + 1, expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),"
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


def _notify(conn: Conn, channel: str) -> None:
    conn.execute("SELECT pg_notify(%s, '')", (channel,))


def _decode_events(rows: Sequence[tuple[int, bytes]]) -> list[tuple[int, Event]]:
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


def _wait_for_rows(
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


class PostgresBackend(Backend):
    """The backend for one pipeline (``group_id``); runs the migrations on creation."""

    def __init__(
        self,
        config: PostgresConfig,
        group_id: str,
        lease_ttl_s: float = 10.0,
        *,
        environ: dict[str, str] | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.config = config
        self.group_id = group_id
        self.lease_ttl_s = lease_ttl_s
        self.schema = config.schema_name
        self.db = Database(config, config.resolve_dsn(environ))
        self.q = Queries(self.schema)
        self.events_channel = channel_name("events", self.schema, group_id)
        self.broadcasts_channel = channel_name("bcast", self.schema, group_id)
        self.lease_channel = channel_name("lease", self.schema, group_id)
        self._channels: weakref.WeakSet[PostgresWriterChannel | PostgresCoordinatorChannel] = (
            weakref.WeakSet()
        )
        try:
            self.db.run("schema migration", lambda c: migrate(c, self.schema))
            self.db.run("group registration", lambda c: c.execute(self.q.ensure_group, (group_id,)))
        except BaseException:
            self.db.close()
            raise

    def writer(self, writer_id: str) -> PostgresWriterChannel:
        ch = PostgresWriterChannel(self, writer_id)
        self._channels.add(ch)
        return ch

    def coordinator(self, coordinator_id: str) -> PostgresCoordinatorChannel:
        ch = PostgresCoordinatorChannel(self, coordinator_id)
        self._channels.add(ch)
        return ch

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Conformance-suite hook: one raw row at the next offset, under the same append lock
        as a publish, as a foreign client writing to the table could leave it."""

        def tx(conn: Conn) -> None:
            with conn.transaction():
                row = conn.execute(self.q.take_offsets, (1, self.group_id, 1)).fetchone()
                if row is None:
                    raise ChannelError(f"pipeline '{self.group_id}' is not registered")
                conn.execute(
                    self.q.insert_events,
                    {
                        "g": self.group_id,
                        "first": int(row[0]),
                        "w": writer_id,
                        "epoch": None,
                        "seq": None,
                        "ids": [f"injected-{uuid.uuid4().hex}"],
                        "types": ["UNDECODABLE"],
                        "payloads": [data],
                    },
                )
                _notify(conn, self.events_channel)

        self.db.run("inject", tx)

    def doctor(self) -> list[str]:
        """Server settings that weaken the durability of acknowledged publishes."""

        def check(conn: Conn) -> list[str]:
            warnings: list[str] = []
            settings = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings"
                    " WHERE name IN ('synchronous_commit', 'fsync', 'full_page_writes')"
                ).fetchall()
            )
            if settings.get("synchronous_commit") == "off":
                warnings.append(
                    "synchronous_commit is off: a server crash can lose publishes and positions"
                    " that were already acknowledged; set synchronous_commit = on"
                )
            if settings.get("fsync") == "off":
                warnings.append(
                    "fsync is off: a server crash can corrupt or lose the coordination log;"
                    " set fsync = on"
                )
            if settings.get("full_page_writes") == "off":
                warnings.append("full_page_writes is off: a crash can leave torn pages; set it on")
            version = schema_version(conn, self.schema)
            if version != latest_version():
                warnings.append(
                    f"schema '{self.schema}' is at version {version}, expected {latest_version()}"
                )
            return warnings

        try:
            return self.db.run("doctor", check, timeout=self.config.connect_timeout_s)
        except ChannelError as exc:
            return [f"cannot check PostgreSQL settings: {exc}"]

    def close(self) -> None:
        for ch in list(self._channels):
            ch.close()
        self.db.close()


class PostgresWriterChannel(WriterChannel):
    """A writer instance's end: fenced by epoch, publishes in one transaction."""

    def __init__(self, backend: PostgresBackend, writer_id: str) -> None:
        self._b = backend
        self.writer_id = writer_id
        self.epoch: int | None = None
        self._broadcast_seq = 0
        self._listener = backend.db.listener([backend.broadcasts_channel])

    def open(self) -> int:
        b = self._b

        def register(conn: Conn) -> tuple[int, int]:
            with conn.transaction():
                row = conn.execute(b.q.open_writer, (b.group_id, self.writer_id)).fetchone()
                head = conn.execute(b.q.broadcast_head, (b.group_id,)).fetchone()
            assert row is not None
            return int(row[0]), int(head[0]) if head else 0

        # Listen first so that no broadcast committed after open() can be missed.
        self._listener.ensure()
        self.epoch, self._broadcast_seq = b.db.run("writer open", register)
        return self.epoch

    def _check_epoch(self, conn: Conn, epoch: int) -> None:
        row = conn.execute(self._b.q.writer_epoch, (self._b.group_id, self.writer_id)).fetchone()
        if row is None:
            raise ChannelError(f"writer '{self.writer_id}' was never opened; call open() first")
        current = int(row[0])
        if current > epoch:
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {epoch} is fenced by epoch {current}"
            )
        if current < epoch:
            raise ChannelError(
                f"writer '{self.writer_id}' epoch {epoch} was never issued (newest {current})"
            )

    def _append(
        self,
        conn: Conn,
        events: Sequence[Event],
        epoch: int,
        batch_seq: int | None,
    ) -> int:
        """Take the pipeline's append lock, assign offsets and insert; returns the first."""
        q = self._b.q
        row = conn.execute(q.take_offsets, (len(events), self._b.group_id, len(events))).fetchone()
        if row is None:
            raise ChannelError(
                f"pipeline '{self._b.group_id}' is not registered in schema '{self._b.schema}'"
            )
        first = int(row[0])
        conn.execute(
            q.insert_events,
            {
                "g": self._b.group_id,
                "first": first,
                "w": self.writer_id,
                "epoch": epoch,
                "seq": batch_seq,
                "ids": [e.event_id for e in events],
                "types": [e.type.value for e in events],
                "payloads": [encode_event(e) for e in events],
            },
        )
        return first

    def _validate(self, events: Sequence[Event]) -> None:
        for e in events:
            if e.group_id != self._b.group_id:
                raise ValueError(
                    f"event for pipeline '{e.group_id}' sent on pipeline '{self._b.group_id}'"
                )
            if e.writer is not None and e.writer.writer_id != self.writer_id:
                raise ValueError(
                    f"event of writer '{e.writer.writer_id}' sent by writer '{self.writer_id}'"
                )

    def _epoch_for(self, events: Sequence[Event]) -> int:
        for e in events:
            if e.writer is not None:
                return e.writer.epoch
        if self.epoch is None:
            raise ChannelError(f"writer '{self.writer_id}' was never opened; call open() first")
        return self.epoch

    def publish(self, batch: WriterBatch) -> bool:
        if batch.writer.writer_id != self.writer_id:
            raise ValueError(
                f"batch of writer '{batch.writer.writer_id}' sent by writer '{self.writer_id}'"
            )
        if not batch.events:
            raise ValueError("a writer batch has at least one event")
        self._validate(batch.events)
        b = self._b
        q = b.q
        epoch = batch.writer.epoch
        key = (b.group_id, self.writer_id, batch.batch_seq)
        # last position per source partition (the upsert may touch a row only once)
        sources = {(p.topic, p.partition): p for p in batch.source_positions}
        # tells a retry of this very call (after an ambiguous commit) from a replay
        publish_id = uuid.uuid4().hex

        def tx(conn: Conn) -> bool:
            try:
                with conn.transaction():
                    self._check_epoch(conn, epoch)
                    existing = conn.execute(q.batch_exists, key).fetchone()
                    if existing is not None:
                        return bool(existing[0] == publish_id)
                    first = self._append(conn, batch.events, epoch, batch.batch_seq)
                    # a concurrent publish of the same key would block here, then conflict
                    if not conn.execute(
                        q.insert_batch, (*key, epoch, first, len(batch.events), publish_id)
                    ).fetchone():
                        raise _ReplayError
                    if sources:
                        conn.execute(
                            q.upsert_sources,
                            {
                                "g": b.group_id,
                                "w": self.writer_id,
                                "seq": batch.batch_seq,
                                "topics": [t for t, _ in sources],
                                "parts": [p for _, p in sources],
                                "offs": [s.offset for s in sources.values()],
                                "tss": [s.max_timestamp_ms for s in sources.values()],
                            },
                        )
                    _notify(conn, b.events_channel)
                return True
            except _ReplayError:
                return False

        return b.db.run("publish", tx)

    def respond(self, event: Event) -> None:
        self._validate([event])
        b = self._b
        epoch = self._epoch_for([event])

        def tx(conn: Conn) -> None:
            with conn.transaction():
                self._check_epoch(conn, epoch)
                # a retry after an ambiguous commit must not append the event twice
                if conn.execute(b.q.event_exists, (b.group_id, event.event_id)).fetchone():
                    return
                self._append(conn, [event], epoch, event.batch_seq)
                _notify(conn, b.events_channel)

        b.db.run("respond", tx)

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        b = self._b

        def fetch() -> list[Event]:
            rows = b.db.run(
                "read broadcasts",
                lambda c: c.execute(
                    b.q.read_broadcasts, (b.group_id, self._broadcast_seq, 1000)
                ).fetchall(),
            )
            events: list[Event] = []
            for seq, payload in rows:
                self._broadcast_seq = int(seq)
                try:
                    events.append(decode_event(payload))
                except EventDecodeError as exc:
                    # a writer can only ignore it: an unanswered StartCommit merely times out
                    log.warning("skipping undecodable broadcast %d: %s", seq, exc)
            return events

        return _wait_for_rows(
            fetch, self._listener, [b.broadcasts_channel], timeout, b.config.poll_interval_s
        )

    def source_positions(self) -> tuple[SourcePosition, ...]:
        """The source positions stored with this writer's newest published batch: where a
        restarted writer resumes (they were committed in the same transaction as its files)."""
        b = self._b
        rows = b.db.run(
            "read source positions",
            lambda c: c.execute(b.q.source_positions, (b.group_id, self.writer_id)).fetchall(),
        )
        return tuple(SourcePosition(t, int(p), int(o), ts) for t, p, o, ts in rows)

    def close(self) -> None:
        self._listener.close()


class PostgresCoordinatorChannel(CoordinatorChannel):
    """The coordinator's end: lease row with a growing token, ordered reads, broadcasts."""

    def __init__(self, backend: PostgresBackend, coordinator_id: str) -> None:
        self._b = backend
        self.coordinator_id = coordinator_id
        # identifies this instance in the lease row (a restarted process with the same
        # coordinator_id is a different instance and must not inherit the lease)
        self.instance = uuid.uuid4().hex
        self._lease: Lease | None = None
        self._lock = threading.RLock()
        self._next = 0
        self._listener = backend.db.listener([backend.events_channel, backend.lease_channel])

    # ------------------------------------------------------------------ leadership

    def _make_lease(self, token: int, remaining: float, started: float) -> Lease:
        # measured from before the request was sent: never later than the server's deadline
        lease = Lease(token=token, holder=self.coordinator_id, expires_at=started + remaining)
        self._lease = lease
        return lease

    def _lease_params(self, token: int | None = None) -> dict[str, Any]:
        session = self._listener.session()
        return {
            "g": self._b.group_id,
            "holder": self.coordinator_id,
            "instance": self.instance,
            "ttl": self._b.lease_ttl_s,
            "pid": None if session is None else session[0],
            "started": None if session is None else session[1],
            "token": token,
        }

    def _try_acquire(self) -> tuple[Lease | None, float]:
        """One attempt; returns the lease, or None and how long the current one has left."""
        b = self._b

        def tx(conn: Conn) -> tuple[tuple[int, float] | None, float]:
            with conn.transaction():
                row = conn.execute(b.q.lease_for_update, (b.group_id,)).fetchone()
                if row is None:
                    got = conn.execute(b.q.insert_lease, self._lease_params()).fetchone()
                    return (None, 0.0) if got is None else ((int(got[0]), float(got[1])), 0.0)
                instance, token, expired, remaining, holder_gone = row
                if instance == self.instance:
                    query, params = b.q.renew_lease, self._lease_params(token)
                elif instance is None or expired or holder_gone:
                    if holder_gone and not expired:
                        log.info("lease holder's session is gone; taking over")
                    query, params = b.q.take_lease, self._lease_params()
                else:
                    return None, max(0.0, float(remaining))
                got = conn.execute(query, params).fetchone()
                assert got is not None
                return (int(got[0]), float(got[1])), 0.0

        started = time.monotonic()
        got, remaining = b.db.run("lease acquire", tx)
        if got is None:
            return None, remaining
        with self._lock:
            return self._make_lease(got[0], got[1], started), 0.0

    def acquire(self, timeout: float) -> Lease | None:
        b = self._b
        deadline = time.monotonic() + max(0.0, timeout)
        self._listener.ensure()
        while True:
            self._listener.take([b.lease_channel])
            lease, others_left = self._try_acquire()
            if lease is not None:
                return lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # woken by release(); else re-check when the holder's lease should have run out
            wait = min(remaining, b.config.poll_interval_s, max(0.01, others_left))
            self._listener.wait([b.lease_channel], wait)

    def renew(self) -> Lease:
        b = self._b
        with self._lock:
            lease = self._lease
            if lease is None:
                raise NotLeaderError(f"coordinator '{self.coordinator_id}' holds no lease")
            started = time.monotonic()
            try:
                row = b.db.run(
                    "lease renew",
                    lambda c: c.execute(
                        b.q.renew_lease, self._lease_params(lease.token)
                    ).fetchone(),
                    # past the lease's own end, leadership cannot be vouched for anyway
                    timeout=min(b.config.retry_timeout_s, max(0.0, lease.expires_at - started)),
                )
            except ChannelError as exc:
                raise NotLeaderError(f"could not renew the lease: {exc}") from exc
            if row is None:
                self._lease = None
                raise NotLeaderError(
                    f"coordinator '{self.coordinator_id}' lost the lease (token {lease.token})"
                )
            return self._make_lease(int(row[0]), float(row[1]), started)

    def release(self) -> None:
        b = self._b
        with self._lock:
            if self._lease is None:
                return
            self._lease = None

        def tx(conn: Conn) -> None:
            with conn.transaction():
                conn.execute(b.q.release_lease, (b.group_id, self.instance))
                _notify(conn, b.lease_channel)

        try:
            b.db.run("lease release", tx, timeout=min(5.0, b.config.retry_timeout_s))
        except ChannelError as exc:
            # the lease simply runs out; nothing is unsafe about that
            log.warning("could not release the lease, it will expire instead: %s", exc)

    def _token(self) -> int:
        with self._lock:
            if self._lease is None:
                raise NotLeaderError(f"coordinator '{self.coordinator_id}' holds no lease")
            return self._lease.token

    def _check_token(self, conn: Conn, token: int) -> None:
        row = conn.execute(self._b.q.lease_token_for_share, (self._b.group_id,)).fetchone()
        if row is None or int(row[0]) != token:
            current = None if row is None else int(row[0])
            raise NotLeaderError(
                f"coordinator '{self.coordinator_id}' with token {token} is fenced "
                f"(current token {current})"
            )

    # ------------------------------------------------------------------ reading

    def seek(self, position: ChannelPosition | None) -> None:
        # None: offsets start at 0 and pruned rows are simply absent
        self._next = 0 if position is None else int(position.get(PARTITION, 0))

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        b = self._b

        def fetch() -> list[ChannelRecord]:
            rows = b.db.run(
                "read events",
                lambda c: c.execute(
                    b.q.read_events, (b.group_id, self._next, max(1, max_records))
                ).fetchall(),
            )
            # never skip a bad row: a skipped DataWritten would be silent data loss (the
            # coordinator stops there until an operator removes the row)
            good = _decode_events(rows)
            if good:
                self._next = good[-1][0] + 1
            return [ChannelRecord(PARTITION, off, e) for off, e in good]

        return _wait_for_rows(
            fetch, self._listener, [b.events_channel], timeout, b.config.poll_interval_s
        )

    def position(self) -> ChannelPosition:
        """The next offset :meth:`poll` will read."""
        return {PARTITION: self._next}

    # ------------------------------------------------------------------ writing

    def broadcast(self, event: Event) -> None:
        b = self._b
        token = self._token()
        payload = encode_event(event)

        def tx(conn: Conn) -> None:
            with conn.transaction():
                # a retry after an ambiguous commit must not send the event twice
                if conn.execute(b.q.broadcast_exists, (b.group_id, event.event_id)).fetchone():
                    return
                row = conn.execute(b.q.take_broadcast_seq, (b.group_id, token)).fetchone()
                if row is None:
                    raise NotLeaderError(
                        f"coordinator '{self.coordinator_id}' with token {token} is fenced"
                    )
                conn.execute(
                    b.q.insert_broadcast,
                    (b.group_id, int(row[0]), event.event_id, event.type.value, token, payload),
                )
                _notify(conn, b.broadcasts_channel)

        b.db.run("broadcast", tx)

    def store_position(self, position: ChannelPosition) -> None:
        b = self._b
        token = self._token()
        parts = sorted(position)

        def tx(conn: Conn) -> None:
            with conn.transaction():
                self._check_token(conn, token)
                conn.execute(
                    b.q.upsert_position,
                    {
                        "g": b.group_id,
                        "token": token,
                        "parts": parts,
                        "offs": [int(position[p]) for p in parts],
                    },
                )

        b.db.run("store position", tx)

    def stored_position(self) -> ChannelPosition | None:
        b = self._b
        rows = b.db.run(
            "read position",
            lambda c: c.execute(b.q.read_positions, (b.group_id,)).fetchall(),
        )
        return {str(p): int(o) for p, o in rows} if rows else None

    def prune(self, before: ChannelPosition) -> int:
        b = self._b
        upto = int(before.get(PARTITION, 0))
        if upto <= 0:
            return 0
        cfg = b.config

        def tx(conn: Conn) -> int:
            with conn.transaction():
                cur = conn.execute(b.q.prune_events, (b.group_id, upto, cfg.retention_s))
                dropped = cur.rowcount
                conn.execute(b.q.prune_batches, (b.group_id, upto, cfg.retention_s))
                conn.execute(b.q.prune_broadcasts, (b.group_id, cfg.broadcast_retention_s))
            return max(0, dropped)

        return b.db.run("prune", tx)

    def close(self) -> None:
        self.release()
        self._listener.close()

    def simulate_crash(self) -> None:
        """A dead process: its connections vanish and it never releases; the lease row runs
        out on the database clock."""
        self._listener.close()
