"""Persistence warnings (doctor and start-up) on private servers with known settings, and what
a restart without persistence does to the pipeline's state."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from icefloe.errors import NotLeaderError
from icefloe.events import WriterRef
from icefloe_redis import RedisBackend, RedisConfig, RedisStateLostError


@contextlib.contextmanager
def _opened(url: str, ttl: float = 2.0) -> Iterator[RedisBackend]:
    """A backend of pipeline ``pipe`` on the server at ``url``, closed afterwards."""
    backend = RedisBackend(RedisConfig(url=url, key_prefix="t", max_block_s=0.5), "pipe", ttl)
    try:
        yield backend
    finally:
        backend.close()


def test_no_persistence_is_warned_at_startup_and_by_doctor(private_redis, caplog):
    server = private_redis()  # --save "" --appendonly no
    with caplog.at_level(logging.WARNING, logger="icefloe_redis"), _opened(server.url) as backend:
        # read before doctor() runs: these are the start-up warnings
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(logged) == 1
        # one short line with the fix, not the whole explanation at every start
        assert "has no persistence" in logged[0]
        assert "fix: appendonly yes, appendfsync always" in logged[0]
        assert "docs/backends/redis.md" in logged[0]
        assert len(logged[0]) < 300, len(logged[0])
        with _opened(server.url):  # another backend of the process: said once
            pass
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        # doctor explains what a restart does
        warnings = backend.doctor()
        (doctor,) = [w for w in warnings if "has no persistence" in w]
        assert "RedisStateLostError" in doctor
        assert "icefloe.source-offsets" in doctor


def test_aof_always_gives_no_warning(private_redis):
    server = private_redis("--appendonly", "yes", "--appendfsync", "always")
    with _opened(server.url) as backend:
        assert backend.doctor() == []


def test_rdb_only_and_lazy_fsync_are_warned(private_redis):
    rdb = private_redis("--save", "60 1")
    with _opened(rdb.url) as backend:
        assert any("RDB snapshots only" in w for w in backend.doctor())
    aof = private_redis("--appendonly", "yes", "--appendfsync", "everysec")
    with _opened(aof.url) as backend:
        (warning,) = backend.doctor()
        assert "everysec" in warning


def test_disabled_config_command_falls_back_to_info(private_redis):
    """Managed services rename or disable CONFIG: persistence is judged from INFO."""
    server = private_redis("--rename-command", "CONFIG", "")
    with _opened(server.url) as backend:
        warnings = backend.doctor()
        assert any("AOF off" in w and "CONFIG is disabled" in w for w in warnings)


def test_eviction_of_all_keys_is_warned(private_redis):
    server = private_redis(
        "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "allkeys-lru"
    )
    with _opened(server.url) as backend:
        (warning,) = backend.doctor()
        assert "allkeys-lru" in warning


def test_unreachable_server_is_a_doctor_warning_not_a_crash(private_redis):
    server = private_redis()
    with _opened(server.url) as backend:
        server.stop()
        (warning,) = backend.doctor()
        assert "could not check Redis" in warning


def test_restart_without_persistence_keeps_counters_growing_and_stops_writers(
    private_redis, batch_of
):
    """After a data-losing restart: the old writer stops with RedisStateLostError, the old
    leader loses the lease, and new epochs, tokens and offsets are above the old ones, so the
    Iceberg summaries and table properties written before keep de-duplicating and fencing."""
    server = private_redis()
    with _opened(server.url, ttl=30.0) as backend:
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
