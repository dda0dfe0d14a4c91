"""Channel identity and reset detection on a real PostgreSQL: a recreated schema is a new
channel whose numbers start from the clock; a schema rolled back (restored from a backup) is
the same channel with fewer events, and the coordinator refuses to run on it."""

from __future__ import annotations

import uuid

import psycopg
from psycopg import sql
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import WriterBatch
from icefloe.errors import ChannelChangedError, ChannelResetError
from icefloe.events import DataComplete, Event, SourcePosition, WriterRef
from icefloe.testing.fixtures import assert_exactly_once
from icefloe.testing.fixtures import sqlite_catalog as sqlite_catalog  # fixture
from icefloe.testing.harness import RowSource, commit_batches, refused_restart
from icefloe_postgres.testing import BackendMaker, drop_schema

TABLE = "ns.t"


def one_event_batch(group_id: str, ref: WriterRef, seq: int) -> WriterBatch:
    pos = (SourcePosition("src", 0, seq + 1),)
    return WriterBatch(ref, seq, (Event(group_id, DataComplete(pos), ref, seq),), pos)


def test_recreated_schema_is_a_new_channel_counting_on_from_the_clock(
    make_backend: BackendMaker, fresh_schema: str, pg_dsn: str
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    first = make_backend(group, schema=fresh_schema)
    writer = first.writer("w")
    ref = WriterRef("w", writer.open())
    writer.publish(one_event_batch(group, ref, 0))
    coord = first.coordinator("c")
    lease = coord.acquire(10)
    assert lease is not None
    old_id, old_end = coord.channel_id(), coord.end_position()["0"]
    coord.close()
    writer.close()
    first.close()

    drop_schema(pg_dsn, fresh_schema)
    second = make_backend(group, schema=fresh_schema)
    writer = second.writer("w")
    epoch = writer.open()
    coord = second.coordinator("c")
    new_lease = coord.acquire(10)
    assert new_lease is not None
    assert coord.channel_id() != old_id
    assert coord.channel_id().startswith("postgres:")
    # nothing the old schema issued can be issued again
    assert coord.end_position()["0"] > old_end
    assert epoch > ref.epoch
    assert new_lease.token > lease.token


def test_schema_restored_from_an_older_backup_is_refused(
    make_backend: BackendMaker, fresh_schema: str, pg_dsn: str, sqlite_catalog: SqlCatalog
) -> None:
    """Same identity, counter and events rolled back below what the table recorded: new
    events would get offsets the table already counts as committed."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    source = RowSource.create(sqlite_catalog, [TABLE])
    backend = make_backend(group, schema=fresh_schema)
    s = sql.Identifier(fresh_schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the "backup" taken now
        row = conn.execute(
            sql.SQL("SELECT next_offset FROM {}.groups WHERE group_id = %s").format(s), (group,)
        ).fetchone()
    assert row is not None
    commit_batches(backend, sqlite_catalog, group, source, range(3))
    committed = list(source.expected[TABLE])
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # ... restored
        conn.execute(sql.SQL("DELETE FROM {}.events WHERE group_id = %s").format(s), (group,))
        conn.execute(sql.SQL("DELETE FROM {}.batches WHERE group_id = %s").format(s), (group,))
        conn.execute(sql.SQL("DELETE FROM {}.positions WHERE group_id = %s").format(s), (group,))
        conn.execute(
            sql.SQL("UPDATE {}.groups SET next_offset = %s WHERE group_id = %s").format(s),
            (row[0], group),
        )
    error = refused_restart(
        make_backend(group, schema=fresh_schema), sqlite_catalog, group, source, 3
    )
    assert isinstance(error, ChannelResetError), error
    assert "docs/operations.md" in str(error)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_pipeline_moved_to_a_recreated_schema_is_refused_until_drained(
    make_backend: BackendMaker, fresh_schema: str, pg_dsn: str, sqlite_catalog: SqlCatalog
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    source = RowSource.create(sqlite_catalog, [TABLE])
    commit_batches(make_backend(group, schema=fresh_schema), sqlite_catalog, group, source, [0])
    committed = list(source.expected[TABLE])
    drop_schema(pg_dsn, fresh_schema)
    error = refused_restart(
        make_backend(group, schema=fresh_schema), sqlite_catalog, group, source, 1
    )
    assert isinstance(error, ChannelChangedError), error
    assert_exactly_once(sqlite_catalog, TABLE, committed)
