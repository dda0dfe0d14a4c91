"""The in-process reference channel: every rule of :mod:`icefloe.channel`, in plain Python.

It exists for core's own tests (coordinator, writer client, conformance suite self-test) and as
a readable model of what a real backend must do. It is not durable and not for production.

* :class:`MemoryServer` holds the state of any number of pipelines: per pipeline one ordered
  log (partition ``"0"``), writer epochs, the set of published batch keys, the lease, the
  stored position and the broadcasts. Events are stored as encoded bytes, so everything the
  coordinator reads went through the real codec. The server is the store: its identity is
  the channel's, and :meth:`MemoryServer.recreate` makes it a new one (what dropping a
  schema or a topic does to a real backend). Epochs and fencing tokens start from the clock,
  so a recreated server never issues one again (offsets start at 0: tests rely on them).
* :class:`MemoryBackend` is a :class:`icefloe.channel.Backend` over a server - the server
  object itself, or a proxy of one living in another process (:func:`serve_memory_server`),
  which is how tests kill a coordinator process for real while the channel state survives.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from typing import Any, cast

from pydantic import BaseModel, ConfigDict

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
    ChannelResetError,
    EventDecodeError,
    NotLeaderError,
    WriterFencedError,
)
from icefloe.events import Event, WriterRef, decode_event, encode_event
from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl

PARTITION = "0"


def clock_us() -> int:
    """The wall clock in microseconds: where epochs and fencing tokens start (rule Numbering
    of docs/backend-authors.md), as in the PostgreSQL and Redis backends."""
    return time.time_ns() // 1000


@dataclass
class _Group:
    """One pipeline's state inside the server."""

    log: list[bytes] = field(default_factory=list)  # log[i] sits at offset base + i
    base: int = 0
    epochs: dict[str, int] = field(default_factory=dict)
    published: set[tuple[str, int]] = field(default_factory=set)
    broadcasts: list[bytes] = field(default_factory=list)
    token: int = field(default_factory=clock_us)  # highest fencing token ever issued
    holder: str | None = None
    expires_at: float = 0.0  # time.monotonic() deadline of the current lease
    acquired_at: float = 0.0  # time.monotonic() when the holder took the lease
    stored: dict[str, int] | None = None

    @property
    def end(self) -> int:
        return self.base + len(self.log)


class MemoryServer:
    """Shared state of the reference channel. Thread-safe; every method takes and returns only
    picklable plain values so a :class:`multiprocessing.managers.BaseManager` can proxy it."""

    def __init__(self, identity: str | None = None) -> None:
        self._cond = threading.Condition()
        self._groups: dict[str, _Group] = {}
        # created with the storage: a new server is a new channel. ``identity`` makes this
        # server a restored copy of another one's storage (tests of rollback detection)
        self._identity = identity or uuid.uuid4().hex

    def identity(self) -> str:
        return self._identity

    def recreate(self) -> None:
        """Lose every pipeline's state and become a new store with a new identity (the
        conformance suite's ``recreate_store``; a real backend's dropped schema or topic)."""
        with self._cond:
            self._groups.clear()
            self._identity = uuid.uuid4().hex
            self._cond.notify_all()

    def end(self, group_id: str) -> int:
        with self._cond:
            return self._group(group_id).end

    def _group(self, group_id: str) -> _Group:
        return self._groups.setdefault(group_id, _Group())

    def _wait(self, ready: Any, timeout: float) -> None:
        """Wait on the condition (held by the caller) until ``ready()`` or the timeout."""
        self._cond.wait_for(ready, timeout=max(0.0, timeout))

    # ------------------------------------------------------------------ writer side

    def open_writer(self, group_id: str, writer_id: str) -> tuple[int, int]:
        """Fence older instances; return (new epoch, broadcast cursor)."""
        with self._cond:
            g = self._group(group_id)
            epoch = g.epochs.get(writer_id, clock_us()) + 1
            g.epochs[writer_id] = epoch
            return epoch, len(g.broadcasts)

    def _check_epoch(self, g: _Group, writer_id: str, epoch: int) -> None:
        current = g.epochs.get(writer_id, 0)
        if epoch != current:
            raise WriterFencedError(
                f"writer {writer_id!r} epoch {epoch} is fenced by epoch {current}"
            )

    def publish(
        self, group_id: str, writer_id: str, epoch: int, batch_seq: int, events: list[bytes]
    ) -> bool:
        """Append a batch atomically; False if its key was published before."""
        with self._cond:
            g = self._group(group_id)
            if not self._claim_key(g, writer_id, epoch, batch_seq):
                return False
            g.log.extend(events)
            self._cond.notify_all()
            return True

    def _claim_key(self, g: _Group, writer_id: str, epoch: int, batch_seq: int) -> bool:
        """Under the lock: check the epoch and record the batch key; False if it was seen."""
        self._check_epoch(g, writer_id, epoch)
        key = (writer_id, batch_seq)
        if key in g.published:
            return False
        g.published.add(key)
        return True

    def append(self, group_id: str, writer_id: str, epoch: int, event: bytes) -> None:
        """Append one writer event that is not a batch (a DataComplete answer)."""
        with self._cond:
            g = self._group(group_id)
            self._check_epoch(g, writer_id, epoch)
            g.log.append(event)
            self._cond.notify_all()

    def read_broadcasts(
        self, group_id: str, cursor: int, timeout: float
    ) -> tuple[list[bytes], int]:
        """Broadcasts from ``cursor`` on (waiting up to ``timeout``) and the next cursor."""
        with self._cond:
            g = self._group(group_id)
            self._wait(lambda: len(g.broadcasts) > cursor, timeout)
            return list(g.broadcasts[cursor:]), len(g.broadcasts)

    # ------------------------------------------------------------------ coordinator side

    def acquire(
        self, group_id: str, holder: str, ttl_s: float, timeout: float
    ) -> tuple[int, float] | None:
        """Take the lease when free or expired (a new, higher token) or keep it when ``holder``
        has it; return (token, seconds left) or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            g = self._group(group_id)
            while True:
                now = time.monotonic()
                if g.holder == holder and now < g.expires_at:
                    g.expires_at = now + ttl_s
                    return g.token, ttl_s
                if g.holder is None or now >= g.expires_at:
                    g.token += 1
                    g.holder = holder
                    g.expires_at = now + ttl_s
                    g.acquired_at = now
                    return g.token, ttl_s
                if now >= deadline:
                    return None
                self._cond.wait(timeout=min(deadline, g.expires_at) - now)

    def _is_leader(self, g: _Group, holder: str, token: int) -> bool:
        """The token is still the newest one issued and still ours. An expired lease that no
        one took over stays valid: nothing newer exists to be fenced by."""
        return g.holder == holder and g.token == token

    def renew(self, group_id: str, holder: str, token: int, ttl_s: float) -> float | None:
        """Extend the lease; seconds left, or None when it was lost."""
        with self._cond:
            g = self._group(group_id)
            if not self._is_leader(g, holder, token):
                return None
            g.expires_at = time.monotonic() + ttl_s
            return ttl_s

    def release(self, group_id: str, holder: str, token: int) -> None:
        with self._cond:
            g = self._group(group_id)
            if self._is_leader(g, holder, token):
                g.holder = None
                g.expires_at = 0.0
                self._cond.notify_all()

    def read(
        self, group_id: str, start: int, timeout: float, max_records: int
    ) -> tuple[int, list[bytes]]:
        """Up to ``max_records`` events from offset ``start`` (moved up to the oldest retained
        one); returns (offset of the first returned event, events)."""
        with self._cond:
            g = self._group(group_id)
            self._wait(lambda: g.end > max(start, g.base), timeout)
            first = max(start, g.base)
            i = first - g.base
            return first, list(g.log[i : i + max_records])

    def broadcast(self, group_id: str, holder: str, token: int, event: bytes) -> bool:
        with self._cond:
            g = self._group(group_id)
            if not self._is_leader(g, holder, token):
                return False
            g.broadcasts.append(event)
            self._cond.notify_all()
            return True

    def store_position(
        self, group_id: str, holder: str, token: int, position: dict[str, int]
    ) -> bool:
        with self._cond:
            g = self._group(group_id)
            if not self._is_leader(g, holder, token):
                return False
            g.stored = dict(position)
            return True

    def stored_position(self, group_id: str) -> dict[str, int] | None:
        with self._cond:
            stored = self._group(group_id).stored
            return None if stored is None else dict(stored)

    def describe(self, group_id: str) -> dict[str, Any]:
        """What `icefloe status` shows (``BackendStatus`` fields), read without changing
        anything. A lease past its TTL that nobody took over still counts as held: nothing
        newer fences it (see :meth:`_is_leader`)."""
        with self._cond:
            g = self._group(group_id)
            now = time.monotonic()
            held = g.holder is not None
            return {
                # the holder is "<coordinator id>/<channel uuid>"
                "leader": g.holder.rsplit("/", 1)[0] if g.holder is not None else None,
                "token": g.token if held else None,
                "lease_age_s": now - g.acquired_at if held else None,
                "lease_expires_in_s": max(0.0, g.expires_at - now) if held else None,
                "writers": tuple(sorted(g.epochs)),
                "stored_position": None if g.stored is None else dict(g.stored),
            }

    def prune(self, group_id: str, before: int) -> int:
        with self._cond:
            g = self._group(group_id)
            n = max(0, min(before, g.end) - g.base)
            del g.log[:n]
            g.base += n
            return n

    # ------------------------------------------------------------------ test helpers

    def inject(self, group_id: str, data: bytes) -> int:
        """Append raw bytes to a pipeline's log, bypassing every check (foreign or corrupt
        events, as another client of a shared channel might write); returns the offset."""
        with self._cond:
            g = self._group(group_id)
            g.log.append(bytes(data))
            self._cond.notify_all()
            return g.end - 1

    def log_size(self, group_id: str) -> tuple[int, int]:
        """(oldest retained offset, next offset) of a pipeline's log."""
        with self._cond:
            g = self._group(group_id)
            return g.base, g.end


class MemoryWriterChannel(WriterChannel):
    """A writer instance's end of the reference channel."""

    def __init__(self, server: MemoryServer, group_id: str, writer_id: str) -> None:
        self._server = server
        self._group_id = group_id
        self._writer_id = writer_id
        self._epoch: int | None = None
        self._cursor = 0

    def _opened(self) -> int:
        if self._epoch is None:
            raise RuntimeError("call open() before publishing")
        return self._epoch

    def open(self) -> int:
        self._epoch, self._cursor = self._server.open_writer(self._group_id, self._writer_id)
        return self._epoch

    def publish(self, batch: WriterBatch) -> bool:
        epoch = self._opened()
        if batch.writer != WriterRef(self._writer_id, epoch):
            raise ValueError(f"batch of {batch.writer} published through {self._writer_id}")
        return self._server.publish(
            self._group_id,
            self._writer_id,
            epoch,
            batch.batch_seq,
            [encode_event(e) for e in batch.events],
        )

    def respond(self, event: Event) -> None:
        self._server.append(self._group_id, self._writer_id, self._opened(), encode_event(event))

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        self._opened()
        raw, self._cursor = self._server.read_broadcasts(self._group_id, self._cursor, timeout)
        return [decode_event(b) for b in raw]

    def close(self) -> None:
        """Nothing to release: the server owns all state."""


class MemoryCoordinatorChannel(CoordinatorChannel):
    """A coordinator's end of the reference channel."""

    def __init__(
        self, server: MemoryServer, group_id: str, coordinator_id: str, lease_ttl_s: float
    ) -> None:
        self._server = server
        self._group_id = group_id
        self._coordinator_id = coordinator_id
        # two channels with one coordinator_id are still two contenders
        self._holder = f"{coordinator_id}/{uuid.uuid4().hex}"
        self._ttl = lease_ttl_s
        self._token: int | None = None
        self._next = 0
        self.closed = False

    def _lease(self, token: int, left: float) -> Lease:
        return Lease(token, self._coordinator_id, time.monotonic() + left)

    def _leader_token(self) -> int:
        if self._token is None:
            raise NotLeaderError(f"{self._coordinator_id} does not hold the lease")
        return self._token

    def acquire(self, timeout: float) -> Lease | None:
        got = self._server.acquire(self._group_id, self._holder, self._ttl, timeout)
        if got is None:
            return None
        self._token = got[0]
        return self._lease(*got)

    def renew(self) -> Lease:
        token = self._leader_token()
        left = self._server.renew(self._group_id, self._holder, token, self._ttl)
        if left is None:
            self._token = None
            raise NotLeaderError(f"{self._coordinator_id} lost the lease (token {token})")
        return self._lease(token, left)

    def release(self) -> None:
        if self._token is not None:
            self._server.release(self._group_id, self._holder, self._token)
            self._token = None

    def seek(self, position: ChannelPosition | None) -> None:
        self._next = 0 if position is None else int(position.get(PARTITION, 0))
        end = self._server.end(self._group_id)
        if self._next > end:
            raise ChannelResetError(
                f"position {self._next} lies past the end of pipeline {self._group_id}'s log "
                f"({end}): the server was replaced or rolled back and lost events"
            )

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        first, raw = self._server.read(self._group_id, self._next, timeout, max_records)
        # decode before moving on: corrupt bytes raise EventDecodeError on every poll that
        # reaches them and are never skipped; the events before them are returned first
        records: list[ChannelRecord] = []
        for i, b in enumerate(raw):
            try:
                records.append(ChannelRecord(PARTITION, first + i, decode_event(b)))
            except EventDecodeError:
                if not records:
                    raise
                break
        self._next = first + len(records)
        return records

    def broadcast(self, event: Event) -> None:
        token = self._leader_token()
        if not self._server.broadcast(self._group_id, self._holder, token, encode_event(event)):
            self._token = None
            raise NotLeaderError(f"{self._coordinator_id} was fenced (token {token})")

    def store_position(self, position: ChannelPosition) -> None:
        token = self._leader_token()
        if not self._server.store_position(self._group_id, self._holder, token, dict(position)):
            self._token = None
            raise NotLeaderError(f"{self._coordinator_id} was fenced (token {token})")

    def stored_position(self) -> ChannelPosition | None:
        return self._server.stored_position(self._group_id)

    def prune(self, before: ChannelPosition) -> int:
        return self._server.prune(self._group_id, int(before.get(PARTITION, 0)))

    def channel_id(self) -> str:
        return f"memory:{self._server.identity()}"

    def end_position(self) -> ChannelPosition:
        return {PARTITION: self._server.end(self._group_id)}

    def close(self) -> None:
        self.release()
        self.closed = True


class MemoryBackend(Backend):
    """The reference backend for one pipeline over a :class:`MemoryServer` (or its proxy)."""

    def __init__(self, server: MemoryServer, group_id: str, lease_ttl_s: float = 10.0) -> None:
        self.server = server
        self.group_id = group_id
        self.lease_ttl_s = lease_ttl_s

    def writer(self, writer_id: str) -> WriterChannel:
        return MemoryWriterChannel(self.server, self.group_id, writer_id)

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        return MemoryCoordinatorChannel(
            self.server, self.group_id, coordinator_id, self.lease_ttl_s
        )

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        self.server.inject(self.group_id, data)

    def probe(self) -> None:
        """A call to the server (in another process, through its proxy, it may be gone)."""
        try:
            self.server.identity()
        except (OSError, EOFError) as exc:
            raise ChannelError(f"the memory server is unreachable: {exc}") from exc

    def describe(self) -> BackendStatus:
        return BackendStatus(**self.server.describe(self.group_id))


def recreate_memory_store(backend: Backend) -> None:
    """The conformance suite's ``recreate_store`` for the reference backend: its server (the
    store) forgets everything and takes a new identity."""
    if not isinstance(backend, MemoryBackend):
        raise TypeError(f"not a MemoryBackend: {backend!r}")
    backend.server.recreate()


# --------------------------------------------------------------------------- other processes


class _Manager(BaseManager):
    """Serves one MemoryServer to other processes."""


_SERVED: MemoryServer | None = None


def _served_server() -> MemoryServer:
    global _SERVED
    if _SERVED is None:
        _SERVED = MemoryServer()
    return _SERVED


_Manager.register("server", callable=_served_server)


@dataclass(frozen=True)
class MemoryServerAddress:
    """Where a served MemoryServer listens (picklable, passed to child processes)."""

    host: str
    port: int
    authkey: bytes


@contextmanager
def serve_memory_server() -> Iterator[tuple[MemoryServer, MemoryServerAddress]]:
    """Run a MemoryServer in its own process (spawned) and yield a proxy of it plus its
    address, so the channel state outlives any coordinator process a test kills."""
    authkey = uuid.uuid4().bytes
    manager = _Manager(address=("127.0.0.1", 0), authkey=authkey, ctx=_spawn())
    manager.start()
    try:
        host, port = cast(tuple[str, int], manager.address)
        proxy = cast(MemoryServer, manager.server())  # type: ignore[attr-defined]
        yield proxy, MemoryServerAddress(host, port, authkey)
    finally:
        manager.shutdown()


def connect_memory_server(address: MemoryServerAddress) -> MemoryServer:
    """A proxy of a MemoryServer served by :func:`serve_memory_server` in another process."""
    manager = _Manager(address=(address.host, address.port), authkey=address.authkey)
    manager.connect()
    return cast(MemoryServer, manager.server())  # type: ignore[attr-defined]


def _spawn() -> Any:
    # fork would copy the test process's threads and locks; spawn starts clean
    return multiprocessing.get_context("spawn")


# --------------------------------------------------------------------------- as a plugin


class MemoryBackendConfig(BaseModel):
    """``[coordination.memory]``: where a served MemoryServer listens (test runs only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int
    authkey: str  # hex


def _factory(config: MemoryBackendConfig, context: BackendContext) -> Backend:
    server = connect_memory_server(
        MemoryServerAddress(config.host, config.port, bytes.fromhex(config.authkey))
    )
    return MemoryBackend(server, context.group_id, context.lease_ttl_s)


class MemoryPlugin:
    """Registers the reference channel as backend ``memory`` (tests register it by hand; it is
    deliberately not an entry point, so no user ever selects it by accident)."""

    @hookimpl
    def icefloe_register_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                "memory",
                MemoryBackendConfig,
                _factory,
                "in-process reference channel served to other processes (tests only)",
                contract=2,
            )
        ]


def memory_backend_options(address: MemoryServerAddress) -> Mapping[str, Any]:
    """The ``[coordination.memory]`` table for a served server."""
    return {"host": address.host, "port": address.port, "authkey": address.authkey.hex()}
