"""Channel identity and reset detection on a real Redis: a server restarted without
persistence is a new channel, and a pipeline whose tables were committed through the lost one
is refused (never silently restarted from the beginning)."""

from __future__ import annotations

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.errors import ChannelChangedError, ChannelResetError
from icefloe.testing.fixtures import assert_exactly_once
from icefloe.testing.fixtures import sqlite_catalog as sqlite_catalog  # fixture
from icefloe.testing.harness import RowSource, commit_batches, refused_restart
from icefloe_redis import RedisBackend, RedisConfig

TABLE = "ns.t"


def _backend(url: str, group: str = "pipe") -> RedisBackend:
    return RedisBackend(RedisConfig(url=url, key_prefix="t", max_block_s=0.5), group, 2.0)


def test_restart_without_persistence_is_a_new_channel_and_is_refused(
    private_redis, sqlite_catalog: SqlCatalog
) -> None:
    server = private_redis()  # --save "" --appendonly no
    source = RowSource.create(sqlite_catalog, [TABLE])
    backend = _backend(server.url)
    try:
        old_id = commit_batches(backend, sqlite_catalog, "pipe", source, range(2))
    finally:
        backend.close()
    committed = list(source.expected[TABLE])
    server.restart()
    backend = _backend(server.url)
    try:
        channel = backend.coordinator("probe")
        assert channel.channel_id() != old_id
        error = refused_restart(backend, sqlite_catalog, "pipe", source, 2)
    finally:
        backend.close()
    assert isinstance(error, ChannelChangedError), error
    assert old_id in str(error)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_rolled_back_event_counter_is_refused(make_backend, sqlite_catalog: SqlCatalog) -> None:
    """Same identity key, fewer events (e.g. an older RDB snapshot loaded): refused."""
    source = RowSource.create(sqlite_catalog, [TABLE])
    backend = make_backend()
    commit_batches(backend, sqlite_catalog, backend.group_id, source, range(2))
    committed = list(source.expected[TABLE])
    keys = backend.keys
    backend.client.delete(keys.events, keys.event_seq, keys.batches, keys.position)
    backend.client.set(keys.event_seq, "0")
    error = refused_restart(backend, sqlite_catalog, backend.group_id, source, 2)
    assert isinstance(error, ChannelResetError), error
    assert_exactly_once(sqlite_catalog, TABLE, committed)
