"""The backend's SQL statements, on the tables :mod:`icefloe_postgres.migrations` creates."""

from __future__ import annotations

from psycopg import sql

from icefloe_postgres.migrations import TABLES

# the database clock in milliseconds, the floor of every epoch and fencing token
_CLOCK_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


class Queries:
    """Every statement, composed once per schema with quoted identifiers."""

    def __init__(self, schema: str) -> None:
        def q(text: str) -> sql.Composed:
            return sql.SQL(text).format(**{n: sql.Identifier(schema, n) for n in TABLES})

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
        # one snapshot: no event left at or after the reader's offset, so it has read through
        # the counter (publishes insert and move it in one transaction)
        self.read_through = q(
            "SELECT g.next_offset FROM {groups} g WHERE g.group_id = %s AND NOT EXISTS"
            " (SELECT 1 FROM {events} e WHERE e.group_id = g.group_id AND e.event_offset >= %s)"
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
