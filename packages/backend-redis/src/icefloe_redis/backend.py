"""The Redis backend: a stream of writer events and a stream of broadcasts per pipeline,
checked and written by Lua scripts (see :mod:`icefloe_redis.scripts`).

Positions: the events stream is one ordered log, so it is channel partition ``"0"``; an
event's offset is the sequence part of its stream id ``0-<offset>``, given by a counter the
publishing script increments (explicit ids, so offsets are plain integers that only grow).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from icefloe.channel import (
    Backend,
    BackendStatus,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
)
from icefloe.errors import (
    ChannelError,
    ConfigError,
    EventDecodeError,
    NotLeaderError,
    WriterFencedError,
)
from icefloe.events import Event, SourcePosition, WriterRef, decode_event, encode_event
from icefloe.wakeups import Wakeups
from icefloe_redis import scripts
from icefloe_redis.config import RedisConfig
from icefloe_redis.durability import persistence_warnings, safely, server_warnings
from icefloe_redis.keys import PipelineKeys

log = logging.getLogger(__name__)

PARTITION = "0"
# redis-py types command replies as ``Awaitable[Any] | Any`` (sync and async share stubs), so
# replies are handled as Any and checked where they are used.
Client = Any


class RedisStateLostError(WriterFencedError):
    """The writer's registration vanished from Redis: the server restarted without
    persistence (or the keys were deleted), and batches published but not committed are gone.
    The writer must restart from the source offsets committed in the tables."""


@contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py's errors into the retryable ChannelError callers expect."""
    try:
        yield
    except RedisError as exc:
        raise ChannelError(f"redis {what} failed: {type(exc).__name__}: {exc}") from exc


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _offset_of(entry_id: Any) -> int | None:
    """The offset of an event stream id ``0-<offset>``; None for ids this backend never
    writes."""
    ms, _, seq = _s(entry_id).partition("-")
    if ms != "0" or not seq.isdigit():
        return None
    return int(seq)


POOL_MAX_CONNECTIONS = 100  # per backend (process); callers beyond it wait their turn
#: a writer whose flag stays down still reads the broadcasts once per this many max_block_s
#: (a safety net: the shared reader wakes everyone on any failure of its own)
FALLBACK_READS = 5


def connect(config: RedisConfig) -> Client:
    """A redis-py client for ``config``; errors name the key and never show the password."""
    kwargs = config.client_kwargs()
    try:
        if config.cluster:
            return RedisCluster.from_url(config.url, **kwargs)
        # a blocking pool: many writers of one process (publishing, answering, reading
        # broadcasts when woken) share the pool; redis-py's default pool raises MaxConnectionsError
        # past 100 concurrent calls instead of waiting for a connection
        pool = redis.BlockingConnectionPool.from_url(
            config.url,
            max_connections=POOL_MAX_CONNECTIONS,
            timeout=config.socket_timeout_s,
            **kwargs,
        )
        return redis.Redis(connection_pool=pool)
    except ValueError as exc:
        raise ConfigError(
            "coordination.redis.url",
            f"is not a usable Redis URL ({type(exc).__name__})",
            "use redis://[user:password@]host:port/db, rediss://... or unix:///path",
            config.safe_url,
        ) from None
    except RedisError as exc:
        raise ChannelError(f"cannot connect to Redis at {config.safe_url}: {exc}") from exc


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


class _Scripts:
    """The backend's Lua scripts, registered once per client (EVALSHA, loaded on demand)."""

    def __init__(self, client: Client) -> None:
        self.open_writer = client.register_script(scripts.OPEN_WRITER)
        self.publish = client.register_script(scripts.PUBLISH)
        self.acquire = client.register_script(scripts.ACQUIRE)
        self.renew = client.register_script(scripts.RENEW)
        self.release = client.register_script(scripts.RELEASE)
        self.store_position = client.register_script(scripts.STORE_POSITION)
        self.broadcast = client.register_script(scripts.BROADCAST)
        self.prune = client.register_script(scripts.PRUNE)


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
        self.keys = PipelineKeys(config.key_prefix, group_id)
        self._owns_client = client is None
        self.client: Client = connect(config) if client is None else client
        self.scripts = _Scripts(self.client)
        self.broadcast_watch = BroadcastWatch(self)
        if config.warn_no_persistence:
            where = config.safe_url
            _warn_once(where, safely(lambda: persistence_warnings(self.client, where), where))

    def writer(self, writer_id: str) -> RedisWriterChannel:
        return RedisWriterChannel(self, writer_id)

    def coordinator(self, coordinator_id: str) -> RedisCoordinatorChannel:
        return RedisCoordinatorChannel(self, coordinator_id)

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Conformance-suite hook: one raw entry at the next offset of the events stream (the
        same counter a publish takes), as a foreign client writing to the stream could."""
        script = (
            "if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('no events') end\n"
            "local n = redis.call('INCRBY', KEYS[1], 1)\n"
            "redis.call('XADD', KEYS[2], '0-' .. string.format('%d', n), 'e', ARGV[1])\n"
            "return n"
        )
        with _redis_errors("inject"):
            self.client.eval(script, 2, self.keys.event_seq, self.keys.events, data)

    def describe(self) -> BackendStatus:
        """The lease key (token, holder, TTL) and the registered writers' epochs."""
        with _redis_errors("status"):
            raw = self.client.get(self.keys.lease)
            ttl_ms = self.client.pttl(self.keys.lease)
            writers = sorted(
                w.decode() if isinstance(w, bytes) else str(w)
                for w in self.client.hkeys(self.keys.epochs)
            )
        token: int | None = None
        holder: str | None = None
        if raw:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            first, _, holder = text.partition("\n")
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
        with _redis_errors("drop_state"):
            found = list(self.client.scan_iter(match=self.keys.match_all(), count=1000))
            for key in found:
                self.client.delete(key)
        return len(found)

    def read_stream(
        self, key: str, after: str, timeout: float, count: int
    ) -> list[tuple[str, bytes]]:
        """Entries of ``key`` after id ``after`` as (id, event bytes), waiting up to
        ``timeout`` in XREAD BLOCKs of at most ``max_block_s`` each."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            # BLOCK 0 would wait forever: no BLOCK at all when no time is left
            block = (
                None
                if remaining <= 0
                else max(1, int(min(remaining, self.config.max_block_s) * 1000))
            )
            with _redis_errors("XREAD"):
                reply = self.client.xread({key: after}, count=count, block=block)
            if reply:
                # RESP2: [[key, entries]]; RESP3 (protocol=3 in the URL): {key: [entries]}
                entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
                return [(_s(entry_id), fields.get(b"e", b"")) for entry_id, fields in entries]
            if block is None or time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        self.broadcast_watch.close()
        if self._owns_client:
            self.client.close()


class BroadcastWatch:
    """One blocking reader of the broadcast stream for every writer of a backend (process).

    Why: each writer's responder polls several times a second; with an XREAD per writer and
    poll, 256 idle writers cost 0.58 cores. This thread blocks in ``XREAD BLOCK`` (at most
    ``max_block_s`` at a time) on the stream's newest entry and raises every subscribed
    writer's flag when entries arrive; writers read the stream themselves only when their flag
    is up (or, as a fallback, every ``FALLBACK_READS`` x ``max_block_s``). It starts from the
    stream's last id read before it wakes everyone, so every later entry wakes the writers; on
    an error it wakes everyone (they read once) and ends; the next writer's poll restarts it.
    """

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self.wakeups = Wakeups()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def ensure(self) -> bool:
        """Start the reader thread when it is not running; False once closed."""
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="icefloe-redis-broadcasts", daemon=True
                )
                self._thread.start()
            return True

    def _run(self) -> None:
        b = self._backend
        key = b.keys.broadcasts
        block_ms = max(1, int(b.config.max_block_s * 1000))
        try:
            with _redis_errors("XREVRANGE"):
                last = b.client.xrevrange(key, count=1)
            after = _s(last[0][0]) if last else "0-0"
            self.wakeups.wake_all()  # entries up to ``after`` are found by the writers' reads
            while True:
                with self._lock:
                    if self._closed or not len(self.wakeups):
                        self._thread = None
                        return
                with _redis_errors("XREAD"):
                    reply = b.client.xread({key: after}, count=1000, block=block_ms)
                if reply:
                    entries = (
                        reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
                    )
                    after = _s(entries[-1][0])
                    self.wakeups.wake_all()
        except Exception as exc:  # any failure: the writers fall back to polling
            with self._lock:
                self._thread = None
                closed = self._closed
            if not closed:
                log.warning("redis broadcast reader stopped (%s); writers poll meanwhile", exc)
            self.wakeups.wake_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wakeups.wake_all()


def _decode(raw: bytes, where: str) -> Event | None:
    """A broadcast event, or None (logged) for bytes that are not one: a writer only acts on
    StartCommit, so a foreign entry there must not stop it."""
    try:
        return decode_event(raw)
    except EventDecodeError as exc:
        log.warning("skipping undecodable entry %s: %s", where, exc)
        return None


class RedisWriterChannel(WriterChannel):
    """A writer instance: epoch-checked, idempotent publishes through one script."""

    def __init__(self, backend: RedisBackend, writer_id: str) -> None:
        self._backend = backend
        self.writer_id = writer_id
        self._epoch: int | None = None
        self._broadcast_after = "0-0"
        self._keys = backend.keys
        self._woken = backend.broadcast_watch.wakeups.subscribe()

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def open(self) -> int:
        with _redis_errors("open"):
            epoch, last_broadcast = self._backend.scripts.open_writer(
                keys=[self._keys.epochs, self._keys.broadcasts], args=[self.writer_id]
            )
        self._epoch = int(epoch)
        self._broadcast_after = _s(last_broadcast)
        return self._epoch

    def _check_writer(self, ref: WriterRef | None) -> int:
        """The epoch to publish under; events of an older instance are fenced here."""
        if self._epoch is None:
            raise ChannelError(f"writer '{self.writer_id}': call open() before publishing")
        if ref is None or ref.writer_id != self.writer_id:
            raise ValueError(f"event of writer {ref!r} published through writer '{self.writer_id}'")
        if ref.epoch < self._epoch:
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {ref.epoch} is fenced by epoch {self._epoch}"
            )
        if ref.epoch > self._epoch:
            raise ValueError(
                f"writer '{self.writer_id}': event claims epoch {ref.epoch}, "
                f"this instance holds {self._epoch}"
            )
        return self._epoch

    def _run(
        self,
        ref: WriterRef | None,
        batch_seq: str,
        events: Sequence[Event],
        extra: Sequence[str | bytes],
    ) -> bool:
        epoch = self._check_writer(ref)
        for e in events:
            self._check_writer(e.writer)
        keys = self._keys
        args: list[str | bytes] = [self.writer_id, str(epoch), batch_seq, str(len(events))]
        args.extend(encode_event(e) for e in events)
        args.extend(extra)
        with _redis_errors("publish"):
            reply = self._backend.scripts.publish(
                keys=[
                    keys.epochs,
                    keys.event_seq,
                    keys.events,
                    keys.batches,
                    keys.batch_floors,
                    keys.sources(self.writer_id),
                ],
                args=args,
            )
        code = _s(reply[0])
        if code == "ok":
            return True
        if code == "dup":
            return False
        if code == "fenced":
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {epoch} is fenced by epoch {_s(reply[1])}"
            )
        if code == "lost":
            raise RedisStateLostError(
                f"writer '{self.writer_id}' of pipeline '{self._backend.group_id}' is no longer "
                f"registered in Redis at {self._backend.config.safe_url}: the server lost its "
                "data (restart without persistence?). Batches published but not committed are "
                "gone: restart the writer from the source offsets committed in the tables (a "
                'new spark.checkpoint_location with source.starting_offsets = "table"); see '
                "docs/backends/redis.md"
            )
        raise ChannelError(
            f"redis stream {keys.events} holds entries icefloe did not write; "
            "use a key_prefix of its own for icefloe"
        )

    def publish(self, batch: WriterBatch) -> bool:
        extra: list[str | bytes] = []
        for p in batch.source_positions:
            extra.append(f"{p.topic}\n{p.partition}")
            extra.append(json.dumps({"offset": p.offset, "max_timestamp_ms": p.max_timestamp_ms}))
        return self._run(batch.writer, str(batch.batch_seq), batch.events, extra)

    def respond(self, event: Event) -> None:
        self._run(event.writer, "", (event,), ())

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        """Read the broadcast stream only when the backend's shared reader saw new entries
        since this writer's last read (or the fallback interval passed): an idle writer waits on its
        flag without a command. The flag is lowered before the read, so an entry added during
        the read raises it again."""
        if self._epoch is None:
            raise ChannelError(f"writer '{self.writer_id}': call open() before polling")
        return self._woken.read(
            self._read_broadcasts,
            self._backend.broadcast_watch.ensure,
            timeout,
            FALLBACK_READS * self._backend.config.max_block_s,
        )

    def _read_broadcasts(self) -> list[Event]:
        entries = self._backend.read_stream(self._keys.broadcasts, self._broadcast_after, 0, 1000)
        out: list[Event] = []
        for entry_id, raw in entries:
            self._broadcast_after = entry_id
            event = _decode(raw, f"{self._keys.broadcasts} {entry_id}")
            if event is not None:
                out.append(event)
        return out

    def source_positions(self) -> list[SourcePosition]:
        """The source positions stored with this writer's newest published batches."""
        with _redis_errors("HGETALL"):
            stored = self._backend.client.hgetall(self._keys.sources(self.writer_id))
        out = []
        for field, value in stored.items():
            topic, _, partition = _s(field).rpartition("\n")
            data = json.loads(value)
            out.append(
                SourcePosition(topic, int(partition), data["offset"], data["max_timestamp_ms"])
            )
        return sorted(out, key=lambda p: (p.topic, p.partition))

    def close(self) -> None:
        """Leave the shared broadcast reader (it stops with its last writer); connections
        belong to the backend's pool."""
        self._woken.close()


class RedisCoordinatorChannel(CoordinatorChannel):
    """A coordinator: leases and fencing by script, reads by XREAD."""

    def __init__(self, backend: RedisBackend, coordinator_id: str) -> None:
        self._backend = backend
        self.coordinator_id = coordinator_id
        # unique per instance: two channels with one coordinator_id must not share a lease
        self._holder = f"{coordinator_id}#{uuid.uuid4().hex[:12]}"
        self._lease: Lease | None = None
        self._after = "0-0"
        self._keys = backend.keys
        self._ttl_ms = max(1, int(backend.lease_ttl_s * 1000))

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def acquire(self, timeout: float) -> Lease | None:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            started = time.monotonic()
            with _redis_errors("acquire"):
                reply = self._backend.scripts.acquire(
                    keys=[self._keys.lease, self._keys.token], args=[self._holder, self._ttl_ms]
                )
            code = _s(reply[0])
            if code in ("ok", "held"):
                token = int(reply[1])
                if code == "ok":
                    log.info(
                        "coordinator %s leads pipeline %s with fencing token %d",
                        self.coordinator_id,
                        self._backend.group_id,
                        token,
                    )
                self._lease = Lease(token, self.coordinator_id, started + self._ttl_ms / 1000)
                return self._lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            pttl = int(reply[2])
            # the holder may release early, so look again at least every 250 ms
            wait = 0.25 if pttl < 0 else max(pttl, 5) / 1000
            time.sleep(min(remaining, wait, 0.25))

    def _require_lease(self) -> Lease:
        if self._lease is None:
            raise NotLeaderError(f"coordinator {self.coordinator_id} does not hold the lease")
        return self._lease

    def _lost(self, what: str) -> NotLeaderError:
        lease = self._lease
        self._lease = None
        token = lease.token if lease else "-"
        return NotLeaderError(
            f"coordinator {self.coordinator_id} (token {token}) lost the lease of pipeline "
            f"'{self._backend.group_id}': {what}"
        )

    def renew(self) -> Lease:
        lease = self._require_lease()
        started = time.monotonic()
        with _redis_errors("renew"):
            reply = self._backend.scripts.renew(
                keys=[self._keys.lease, self._keys.token],
                args=[self._holder, str(lease.token), self._ttl_ms],
            )
        if _s(reply[0]) != "ok":
            raise self._lost("another coordinator took over or the lease expired")
        self._lease = Lease(lease.token, lease.holder, started + self._ttl_ms / 1000)
        return self._lease

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        with _redis_errors("release"):
            self._backend.scripts.release(
                keys=[self._keys.lease], args=[self._holder, str(lease.token)]
            )

    def seek(self, position: ChannelPosition | None) -> None:
        nxt = 0 if position is None else int(position.get(PARTITION, 0))
        self._after = f"0-{nxt - 1}" if nxt > 0 else "0-0"

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        """Events after the read position. An entry that is not an icefloe event stops the
        read there (EventDecodeError, raised by the poll that reaches it first): skipping it
        could skip a DataWritten, which is silent data loss."""
        entries = self._backend.read_stream(self._keys.events, self._after, timeout, max_records)
        out: list[ChannelRecord] = []
        for entry_id, raw in entries:
            try:
                offset = _offset_of(entry_id)
                if offset is None:
                    raise EventDecodeError(f"stream id {entry_id} was not written by icefloe")
                event = decode_event(raw)
            except EventDecodeError as exc:
                if out:
                    return out
                raise EventDecodeError(
                    f"entry {entry_id} of {self._keys.events} is not an icefloe event ({exc}); "
                    "delete it (XDEL) to let the coordinator continue"
                ) from exc
            self._after = entry_id
            out.append(ChannelRecord(PARTITION, offset, event))
        return out

    def _fenced_call(self, what: str, script: Any, key: str, *args: Any) -> Any:
        """Run a script that writes only while this coordinator is still the leader."""
        lease = self._require_lease()
        with _redis_errors(what):
            reply = script(
                keys=[self._keys.lease, self._keys.token, key],
                args=[self._holder, str(lease.token), *args],
            )
        if _s(reply[0]) == "stale":
            raise self._lost(f"{what} refused: a newer fencing token exists")
        return reply

    def broadcast(self, event: Event) -> None:
        self._fenced_call(
            "broadcast",
            self._backend.scripts.broadcast,
            self._keys.broadcasts,
            self._backend.config.broadcast_max_len,
            encode_event(event),
        )

    def store_position(self, position: ChannelPosition) -> None:
        data = json.dumps({str(k): int(v) for k, v in position.items()}, sort_keys=True)
        self._fenced_call(
            "store_position", self._backend.scripts.store_position, self._keys.position, data
        )

    def stored_position(self) -> ChannelPosition | None:
        with _redis_errors("GET position"):
            raw = self._backend.client.get(self._keys.position)
        if raw is None:
            return None
        data: dict[str, int] = json.loads(raw)
        return data

    def prune(self, before: ChannelPosition) -> int:
        """Trim events before ``before``, never past the stored (committed) position and
        keeping ``retain_committed_events``."""
        stored = self.stored_position()
        if stored is None:
            return 0
        upto = min(int(before.get(PARTITION, 0)), int(stored.get(PARTITION, 0)))
        upto -= self._backend.config.retain_committed_events
        if upto <= 1:
            return 0
        keys = self._keys
        with _redis_errors("prune"):
            trimmed = self._backend.scripts.prune(
                keys=[keys.events, keys.batches, keys.batch_floors], args=[str(upto)]
            )
        return int(trimmed)

    def channel_id(self) -> str:
        key = self._keys.channel_id
        with _redis_errors("channel id"):
            self._backend.client.set(key, uuid.uuid4().hex, nx=True)
            raw = self._backend.client.get(key)
        if raw is None:  # deleted between the two calls: storage is being wiped right now
            raise ChannelError(f"redis key {key} vanished while it was read; retry")
        return f"redis:{_s(raw)}"

    def end_position(self) -> ChannelPosition:
        with _redis_errors("GET event-seq"):
            raw = self._backend.client.get(self._keys.event_seq)
        return {PARTITION: 0 if raw is None else int(raw) + 1}

    def close(self) -> None:
        try:
            self.release()
        except ChannelError as exc:
            log.warning("coordinator %s could not release its lease: %s", self.coordinator_id, exc)
