"""The PostgreSQL backend: event log, writer fencing, leader lease, wake-ups. The backend object
runs the migrations, registers the pipeline, hands out writer and coordinator ends and checks
the server's setup (``icefloe doctor``); the ends live in :mod:`~icefloe_postgres.writer_channel`,
:mod:`~icefloe_postgres.coordinator_channel` and :mod:`~icefloe_postgres.lease`, and share a
:class:`~icefloe_postgres.database.ChannelContext`.

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

import uuid
import weakref

import psycopg

from icefloe.channel import Backend, BackendStatus
from icefloe.errors import ChannelError
from icefloe_postgres.config import PostgresConfig
from icefloe_postgres.coordinator_channel import PostgresCoordinatorChannel
from icefloe_postgres.database import ChannelContext, Conn, Database, notify
from icefloe_postgres.listener import channel_name
from icefloe_postgres.migrations import latest_version, migrate, schema_version
from icefloe_postgres.queries import Queries
from icefloe_postgres.writer_channel import PostgresWriterChannel


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
        self.context = ChannelContext(
            config,
            group_id,
            self.db,
            self.q,
            self.events_channel,
            self.broadcasts_channel,
            self.lease_channel,
        )
        self._channels: weakref.WeakSet[PostgresWriterChannel | PostgresCoordinatorChannel] = (
            weakref.WeakSet()
        )
        try:
            # one direct connection first: a down server then reads "connection refused"
            # instead of the pool's retries ending in PoolTimeout
            self.probe()
            self.db.run("schema migration", lambda c: migrate(c, self.schema))
            self.db.run("group registration", lambda c: c.execute(self.q.ensure_group, (group_id,)))
        except BaseException:
            self.db.close()
            raise

    def writer(self, writer_id: str) -> PostgresWriterChannel:
        ch = PostgresWriterChannel(self.context, writer_id)
        self._channels.add(ch)
        return ch

    def coordinator(self, coordinator_id: str) -> PostgresCoordinatorChannel:
        ch = PostgresCoordinatorChannel(self.context, coordinator_id, self.lease_ttl_s)
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
                notify(conn, self.events_channel)

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

    def describe(self) -> BackendStatus:
        """Lease row and registered writers, read in one short transaction."""

        def read(conn: Conn) -> BackendStatus:
            lease = conn.execute(
                f"SELECT holder, token, extract(epoch FROM clock_timestamp() - acquired_at),"
                f" extract(epoch FROM expires_at - clock_timestamp())"
                f" FROM {self.schema}.leases WHERE group_id = %s",
                (self.group_id,),
            ).fetchone()
            writers = conn.execute(
                f"SELECT writer_id FROM {self.schema}.writers WHERE group_id = %s"
                " ORDER BY writer_id",
                (self.group_id,),
            ).fetchall()
            holder, token, age, expires = lease if lease else (None, None, None, None)
            return BackendStatus(
                leader=holder,
                token=None if token is None else int(token),
                lease_age_s=None if age is None else float(age),
                lease_expires_in_s=None if expires is None else float(expires),
                writers=tuple(str(w[0]) for w in writers),
            )

        return self.db.run("status", read, timeout=self.config.connect_timeout_s)

    def probe(self) -> None:
        """Open one connection outside the pool (raises ChannelError with libpq's reason)."""
        try:
            with psycopg.connect(self.db.dsn, **self.db.connect_kwargs):
                pass
        except psycopg.Error as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ChannelError(
                f"cannot connect to PostgreSQL at {self.db.where}: {reason}"
            ) from None

    def close(self) -> None:
        for ch in list(self._channels):
            ch.close()
        self.db.close()
