"""Persistence warnings (doctor and start-up) on private servers with known settings, and what
a restart without persistence does to the pipeline's state."""

from __future__ import annotations

import logging

import pytest

from icefloe.errors import NotLeaderError
from icefloe.events import WriterRef
from icefloe_redis import RedisBackend, RedisConfig, RedisStateLostError


def _backend(url: str, group: str = "pipe", ttl: float = 2.0) -> RedisBackend:
    return RedisBackend(RedisConfig(url=url, key_prefix="t", max_block_s=0.5), group, ttl)


def test_no_persistence_is_warned_at_startup_and_by_doctor(private_redis, caplog):
    server = private_redis()  # --save "" --appendonly no
    with caplog.at_level(logging.WARNING, logger="icefloe_redis"):
        backend = _backend(server.url)
    try:
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(logged) == 1
        assert "has no persistence" in logged[0]
        assert "RedisStateLostError" in logged[0]
        assert "icefloe.source-offsets" in logged[0]
        warnings = backend.doctor()
        assert any("has no persistence" in w for w in warnings)
    finally:
        backend.close()


def test_aof_always_gives_no_warning(private_redis):
    server = private_redis("--appendonly", "yes", "--appendfsync", "always")
    backend = _backend(server.url)
    try:
        assert backend.doctor() == []
    finally:
        backend.close()


def test_rdb_only_and_lazy_fsync_are_warned(private_redis):
    rdb = private_redis("--save", "60 1")
    backend = _backend(rdb.url)
    try:
        assert any("RDB snapshots only" in w for w in backend.doctor())
    finally:
        backend.close()
    aof = private_redis("--appendonly", "yes", "--appendfsync", "everysec")
    backend = _backend(aof.url)
    try:
        (warning,) = backend.doctor()
        assert "everysec" in warning
    finally:
        backend.close()


def test_disabled_config_command_falls_back_to_info(private_redis):
    """Managed services rename or disable CONFIG: persistence is judged from INFO."""
    server = private_redis("--rename-command", "CONFIG", "")
    backend = _backend(server.url)
    try:
        warnings = backend.doctor()
        assert any("AOF off" in w and "CONFIG is disabled" in w for w in warnings)
    finally:
        backend.close()


def test_eviction_of_all_keys_is_warned(private_redis):
    server = private_redis(
        "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "allkeys-lru"
    )
    backend = _backend(server.url)
    try:
        (warning,) = backend.doctor()
        assert "allkeys-lru" in warning
    finally:
        backend.close()


def test_unreachable_server_is_a_doctor_warning_not_a_crash(private_redis):
    server = private_redis()
    backend = _backend(server.url)
    server.stop()
    try:
        (warning,) = backend.doctor()
        assert "could not check Redis" in warning
    finally:
        backend.close()


def test_restart_without_persistence_keeps_counters_growing_and_stops_writers(
    private_redis, batch_of
):
    """After a data-losing restart: the old writer stops with RedisStateLostError, the old
    leader loses the lease, and new epochs, tokens and offsets are above the old ones, so the
    Iceberg summaries and table properties written before keep de-duplicating and fencing."""
    server = private_redis()
    backend = _backend(server.url, "pipe", ttl=30.0)
    try:
        w = backend.writer("w")
        old_epoch = w.open()
        w.publish(batch_of("pipe", WriterRef("w", old_epoch), 1))
        c = backend.coordinator("c")
        old_lease = c.acquire(1.0)
        assert old_lease is not None
        old_records = c.poll(1.0)
        c.store_position({"0": old_records[-1].offset + 1})

        server.restart()

        with pytest.raises(RedisStateLostError, match="restart the writer"):
            w.publish(batch_of("pipe", WriterRef("w", old_epoch), 2))
        with pytest.raises(NotLeaderError):
            c.renew()
        assert c.stored_position() is None

        w2 = backend.writer("w")
        new_epoch = w2.open()
        assert new_epoch > old_epoch
        assert w2.publish(batch_of("pipe", WriterRef("w", new_epoch), 2))
        new_lease = c.acquire(1.0)
        assert new_lease is not None
        assert new_lease.token > old_lease.token
        # the old leader's read position is below every new offset: nothing new is skipped
        new_records = c.poll(1.0)
        assert [r.event.batch_seq for r in new_records] == [2, 2]
        assert new_records[0].offset > old_records[-1].offset
    finally:
        backend.close()
