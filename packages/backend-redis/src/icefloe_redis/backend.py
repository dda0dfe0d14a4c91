"""The Redis backend: a stream of writer events and a stream of broadcasts per pipeline,
checked and written by Lua scripts (see :mod:`icefloe_redis.scripts`).

Positions: the events stream is one ordered log, so it is channel partition ``"0"``; an
event's offset is the sequence part of its stream id ``0-<offset>``, given by a counter the
publishing script increments (explicit ids, so offsets are plain integers that only grow).

The backend object hands out the ends (:mod:`~icefloe_redis.writer_channel`,
:mod:`~icefloe_redis.coordinator_channel`), which share its
:class:`~icefloe_redis.connection.RedisConnection` and its one broadcast reader
(:mod:`~icefloe_redis.broadcasts`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from redis.exceptions import RedisError

from icefloe.channel import Backend, BackendStatus
from icefloe.errors import ChannelError, ConfigError
from icefloe_redis.broadcasts import BroadcastWatch
from icefloe_redis.config import RedisConfig
from icefloe_redis.connection import Client, RedisConnection, redis_errors, reply_text
from icefloe_redis.coordinator_channel import RedisCoordinatorChannel
from icefloe_redis.durability import persistence_warnings, safely, server_warnings
from icefloe_redis.writer_channel import RedisWriterChannel

log = logging.getLogger(__name__)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(where: str, warnings: Sequence[str]) -> None:
    """Start-up warnings, once per server and process (tests and runners open many
    backends)."""
    with _warned_lock:
        if where in _warned:
            return
        _warned.add(where)
    for w in warnings:
        log.warning("icefloe redis backend: %s", w)


class RedisBackend(Backend):
    """One pipeline (``group_id``) on one Redis server or cluster."""

    def __init__(
        self,
        config: RedisConfig,
        group_id: str,
        lease_ttl_s: float = 10.0,
        client: Client | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ConfigError("coordination.lease_ttl_s", "must be positive", "set e.g. 10")
        self.config = config
        self.group_id = group_id
        self.lease_ttl_s = lease_ttl_s
        self.connection = RedisConnection(config, group_id, client)
        self.keys = self.connection.keys
        self.client: Client = self.connection.client
        self.broadcast_watch = BroadcastWatch(self.connection)
        if config.warn_no_persistence:
            where = config.safe_url
            _warn_once(where, safely(lambda: persistence_warnings(self.client, where), where))

    def writer(self, writer_id: str) -> RedisWriterChannel:
        return RedisWriterChannel(self.connection, writer_id, self.broadcast_watch)

    def coordinator(self, coordinator_id: str) -> RedisCoordinatorChannel:
        return RedisCoordinatorChannel(self.connection, coordinator_id, self.lease_ttl_s)

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Conformance-suite hook: one raw entry at the next offset of the events stream (the
        same counter a publish takes), as a foreign client writing to the stream could."""
        # a registered script (EVALSHA), not EVAL: the least-privileged user of
        # icefloe_redis.permissions, which the tests run this suite as, has no EVAL
        script = self.client.register_script(
            "if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('no events') end\n"
            "local n = redis.call('INCRBY', KEYS[1], 1)\n"
            "redis.call('XADD', KEYS[2], '0-' .. string.format('%d', n), 'e', ARGV[1])\n"
            "return n"
        )
        with redis_errors("inject"):
            script(keys=[self.keys.event_seq, self.keys.events], args=[data])

    def describe(self) -> BackendStatus:
        """The lease key (token, holder, TTL) and the registered writers' epochs."""
        with redis_errors("status"):
            raw = self.client.get(self.keys.lease)
            ttl_ms = self.client.pttl(self.keys.lease)
            writers = sorted(reply_text(w) for w in self.client.hkeys(self.keys.epochs))
        token: int | None = None
        holder: str | None = None
        if raw:
            first, _, holder = reply_text(raw).partition("\n")
            token = int(first)
        return BackendStatus(
            leader=holder,
            token=token,
            lease_expires_in_s=ttl_ms / 1000 if raw and ttl_ms and ttl_ms > 0 else None,
            writers=tuple(writers),
        )

    def probe(self) -> None:
        """PING the server (raises ChannelError naming the URL and the cause)."""
        try:
            self.client.ping()
        except RedisError as exc:
            raise ChannelError(
                f"cannot reach Redis at {self.config.safe_url}: {type(exc).__name__}: {exc}"
            ) from None

    def doctor(self) -> list[str]:
        where = self.config.safe_url
        return safely(lambda: server_warnings(self.client, where), where)

    def drop_state(self) -> int:
        """Delete every key of this pipeline (tests, decommissioning); returns how many."""
        with redis_errors("drop_state"):
            found = list(self.client.scan_iter(match=self.keys.match_all(), count=1000))
            for key in found:
                self.client.delete(key)
        return len(found)

    def close(self) -> None:
        self.broadcast_watch.close()
        self.connection.close()
