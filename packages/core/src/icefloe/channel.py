"""The channel between writers and the coordinator: what every coordination backend implements.

A backend (Kafka control topic, PostgreSQL, Redis, or a third party's) provides three objects:

* :class:`Backend` - made by the factory the backend registers through the ``icefloe``
  plugin hook; hands out the two ends below for one pipeline (``group_id``).
* :class:`WriterChannel` - publishes a writer's finished batch atomically and idempotently,
  and is fenced when a newer instance of the same writer registers.
* :class:`CoordinatorChannel` - leadership lease with a fencing token that only grows, a
  durable ordered read of the events with positions the coordinator can store, broadcasts.

Positions are ``{channel partition: next offset to read}``. Backends with a single ordered log
use the partition ``"0"``. Offsets only grow within a partition.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field

from icefloe.events import Event, SourcePosition, WriterRef

ChannelPosition = Mapping[str, int]


@dataclass(frozen=True)
class ChannelRecord:
    """An event as read by the coordinator, with where it sits in the channel."""

    partition: str
    offset: int
    event: Event

    def is_before(self, position: ChannelPosition) -> bool:
        """True when a stored position (next offset to read) has already passed this record."""
        return self.offset < position.get(self.partition, 0)


@dataclass(frozen=True)
class WriterBatch:
    """Everything one writer publishes for one finished batch, as one atomic unit.

    ``events`` carry ``writer`` and ``batch_seq`` too. The key (writer id, batch_seq) makes a
    replay recognisable: publishing the same key twice must not add events twice where the
    backend can check it, and the coordinator drops duplicates where it cannot.
    ``source_positions`` are the source offsets this batch brings the writer to; backends that
    can store them atomically with the events (KIP-892 style) do.
    """

    writer: WriterRef
    batch_seq: int
    events: tuple[Event, ...]
    source_positions: tuple[SourcePosition, ...] = ()


@dataclass(frozen=True)
class Lease:
    """Leadership of one pipeline's coordinator. ``token`` is strictly greater than any token
    issued before it for the same pipeline, so it fences older leaders everywhere it is
    recorded (backend state and Iceberg table properties)."""

    token: int
    holder: str
    #: when the lease runs out unless renewed, as a ``time.monotonic()`` reading of the process
    #: that called ``acquire``/``renew``. A local hint for when to renew, never compared across
    #: processes or hosts: the backend decides expiry on its own (server or per-process) clock.
    expires_at: float = field(default=float("inf"))


@dataclass(frozen=True)
class BackendStatus:
    """What a backend can tell `icefloe status` without taking part (read-only). ``None``
    means the backend cannot tell."""

    leader: str | None = None
    token: int | None = None
    lease_age_s: float | None = None  # since the current holder acquired it
    lease_expires_in_s: float | None = None
    writers: tuple[str, ...] | None = None  # writer ids registered for the pipeline
    stored_position: Mapping[str, int] | None = None


class WriterChannel(abc.ABC):
    """One writer instance's end of the channel."""

    @abc.abstractmethod
    def open(self) -> int:
        """Register this instance, fence every older instance of the same writer id and return
        this instance's epoch (greater than any earlier instance's)."""

    @abc.abstractmethod
    def publish(self, batch: WriterBatch) -> bool:
        """Append the batch's events atomically (all or none).

        Returns False when the backend knows the batch key was already published (nothing was
        added). Raises :class:`icefloe.errors.WriterFencedError` when a newer instance exists.
        """

    @abc.abstractmethod
    def respond(self, event: Event) -> None:
        """Send a single writer event that is not a data batch (DataComplete answering a
        StartCommit). Fenced like :meth:`publish`."""

    @abc.abstractmethod
    def poll_broadcasts(self, timeout: float) -> list[Event]:
        """Coordinator events of this pipeline sent after :meth:`open`, oldest first."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Never fences or deletes anything."""


class CoordinatorChannel(abc.ABC):
    """The coordinator's end of the channel."""

    @abc.abstractmethod
    def acquire(self, timeout: float) -> Lease | None:
        """Try to become the pipeline's leader within ``timeout`` seconds; None if another
        live leader holds the lease."""

    @abc.abstractmethod
    def renew(self) -> Lease:
        """Extend the lease. Raises :class:`icefloe.errors.NotLeaderError` if it was lost."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give up leadership so another coordinator can take over at once."""

    @abc.abstractmethod
    def seek(self, position: ChannelPosition | None) -> None:
        """Read from ``position`` on; None means from the beginning of what is retained."""

    @abc.abstractmethod
    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        """Next events in channel order (per partition), waiting up to ``timeout`` seconds."""

    @abc.abstractmethod
    def broadcast(self, event: Event) -> None:
        """Send a coordinator event to every writer. Raises NotLeaderError when fenced."""

    @abc.abstractmethod
    def store_position(self, position: ChannelPosition) -> None:
        """Durably record that everything before ``position`` is committed to its table or
        quarantined (the coordinator may store while one table is failing, never past that
        table's oldest pending event).
        Raises NotLeaderError when fenced."""

    @abc.abstractmethod
    def stored_position(self) -> ChannelPosition | None:
        """The last position stored, or None if never."""

    @abc.abstractmethod
    def prune(self, before: ChannelPosition) -> int:
        """Drop retained events before ``before`` where the backend owns retention; returns how
        many were dropped (0 where retention is the server's, as with Kafka)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (and the lease, if held)."""

    # -------------------------------------------------------- identity and reset detection
    # Why: positions are only comparable within one channel. A swapped backend, or a channel
    # whose storage was recreated or rolled back, numbers its events anew; comparing those
    # numbers with positions a table recorded earlier would drop new files as "committed".

    @abc.abstractmethod
    def channel_id(self) -> str:
        """The identity of this channel's storage, recorded with every table commit.

        Contract: the same string for every process that reaches the same storage, for as long
        as that storage lives (restarts, reconnects, fail-overs keep it); a different string
        as soon as the storage is new (first use, topic/schema/keys deleted and recreated,
        data lost). Create it together with the storage, never derive it from configuration
        alone. Prefix it with the backend's name (``kafka:``, ``postgres:`` ...)."""

    @abc.abstractmethod
    def end_position(self) -> ChannelPosition:
        """The position just past the newest event the channel holds, per partition (what a
        reader that consumed everything would have as its position). Used to detect a channel
        that was rolled back: a position recorded earlier that lies beyond it."""

    def read_through(self) -> ChannelPosition | None:
        """How far this end has read, per partition, counting log entries that are not events
        and that ``poll`` skips (Kafka's transaction markers), so that it reaches
        :meth:`end_position` once everything was read. None (the default) when the positions of
        the records ``poll`` returned already do, as for backends whose offsets number events
        only. Why: ``icefloe drain`` must prove it read the whole channel before it marks it
        drained, and a reader's record positions never reach a Kafka high watermark that lies
        past a transaction marker."""
        return None

    def simulate_crash(self) -> None:  # noqa: B027 - optional test hook
        """Test hook (the conformance suite's only crash simulation): make this channel look
        like its process died - cut its connections, never release the lease, so another
        coordinator takes over only after the lease expires. The default abandons the channel,
        which is what a dead process does for backends without live connections."""


class Backend(abc.ABC):
    """A configured coordination backend for one pipeline."""

    @abc.abstractmethod
    def writer(self, writer_id: str) -> WriterChannel:
        """A writer end for the stable identity ``writer_id``."""

    @abc.abstractmethod
    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        """A coordinator end; ``coordinator_id`` names this process in the lease."""

    def probe(self) -> None:
        """Raise :class:`~icefloe.errors.ChannelError` naming the server and the cause (e.g.
        "connection refused") when it cannot be reached. Read-only, fences nothing; used by
        `icefloe doctor` and `icefloe status`. Backends that cannot tell raise
        NotImplementedError (the default): doctor then says the check was skipped."""
        raise NotImplementedError

    def describe(self) -> BackendStatus:
        """The pipeline's coordination state for `icefloe status` (leader, token, lease age,
        writers), read without joining, fencing or renewing anything. Default: unknown."""
        return BackendStatus()

    def doctor(self) -> list[str]:
        """Warnings about the server's setup that weaken guarantees (shown by `icefloe doctor`)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless pools exist
        """Release shared resources (pools)."""

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Test hook used only by the conformance suite: append ``data`` - bytes that are not
        an encoded event - to this pipeline's channel after everything published so far, where
        ``writer_id``'s next event would go (its partition, where there are several),
        bypassing every check, as a corrupt record or a foreign client would. The suite uses
        it to check that ``poll`` stops at such a record (raises EventDecodeError) instead of
        skipping it; a backend that does not implement it fails that test."""
        raise NotImplementedError(
            f"{type(self).__name__}.inject_undecodable is not implemented: the conformance "
            "suite needs it to check that poll stops at undecodable bytes"
        )
