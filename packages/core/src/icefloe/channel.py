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

The contract has a version (:data:`CONTRACT_VERSION`). A backend declares the one it was written
for in its ``BackendSpec``; core refuses, when it loads the backend, one it cannot drive, naming
what changed (:data:`CONTRACT_CHANGES`) and the section of docs/backend-authors.md to read.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from icefloe.errors import MissingBackendMethodError
from icefloe.events import Event, SourcePosition, WriterRef

ChannelPosition = Mapping[str, int]

# ------------------------------------------------------------------ the contract's version

#: The version of the backend contract this module defines: the abstract classes below, the
#: rules of docs/backend-authors.md and the test hooks. It moves with every change a backend
#: has to follow, and icefloe-core's minor version (its major version from 1.0 on) moves with
#: it. A backend declares the version it implements as a number in ``BackendSpec(contract=2)``,
#: never as this constant: that would claim every future contract without reading it.
CONTRACT_VERSION = 2
#: The oldest contract this core still drives; a backend of an older one is refused at load.
OLDEST_CONTRACT_VERSION = 2
#: What a backend that declares no version implements: the contract before it had versions.
UNVERSIONED_CONTRACT = 1
#: The guide to the contract and its versions.
CONTRACT_DOCS = "docs/backend-authors.md"


@dataclass(frozen=True)
class ContractChange:
    """One change a backend has to follow to implement a new contract version: the rule of
    docs/backend-authors.md it belongs to (None: no rule of the conformance suite), what to
    do, and the methods it adds (qualified, e.g. ``CoordinatorChannel.channel_id``)."""

    rule: str | None
    what: str
    methods: tuple[str, ...] = ()


#: What each contract version changed from the one before, as the refusal of an outdated
#: backend lists it (docs/backend-authors.md has the upgrade guide, CHANGELOG.md the history).
CONTRACT_CHANGES: Mapping[int, tuple[ContractChange, ...]] = {
    2: (
        ContractChange(
            "Identity",
            "implement CoordinatorChannel.channel_id(), an identity created with the storage",
            ("CoordinatorChannel.channel_id",),
        ),
        ContractChange(
            "End position",
            "implement CoordinatorChannel.end_position(), exactly past the newest event; seek "
            "past it raises ChannelResetError",
            ("CoordinatorChannel.end_position",),
        ),
        ContractChange(
            "Bytes",
            "poll returns the events before an undecodable record, then raises "
            "EventDecodeError at it; implement the test hook Backend.inject_undecodable()",
            ("Backend.inject_undecodable",),
        ),
        ContractChange(
            "Numbering",
            "issue epochs and fencing tokens (and offsets) from the clock, so a recreated "
            "store never issues numbers again",
        ),
        ContractChange(
            "Probe and describe",
            "probe() and describe() tell the truth and change nothing (both stay optional)",
        ),
        ContractChange(
            None,
            "resolve relative paths of the backend's section with BackendContext.resolve()",
        ),
        ContractChange(None, "declare the contract version: BackendSpec(..., contract=2)"),
    ),
}

#: The rule of docs/backend-authors.md each required method carries: a missing method is
#: reported under it (by the conformance suite and in :class:`MissingBackendMethodError`).
METHOD_RULES: Mapping[str, str] = {
    "Backend.writer": "Shared store",
    "Backend.coordinator": "Shared store",
    "Backend.inject_undecodable": "Bytes",
    "WriterChannel.open": "Epochs and fencing",
    "WriterChannel.publish": "Atomic batches",
    "WriterChannel.respond": "Epochs and fencing",
    "WriterChannel.poll_broadcasts": "Broadcasts",
    "WriterChannel.close": "Epochs and fencing",
    "CoordinatorChannel.acquire": "One leader",
    "CoordinatorChannel.renew": "One leader",
    "CoordinatorChannel.release": "One leader",
    "CoordinatorChannel.close": "One leader",
    "CoordinatorChannel.seek": "Order and positions",
    "CoordinatorChannel.poll": "Order and positions",
    "CoordinatorChannel.store_position": "Order and positions",
    "CoordinatorChannel.stored_position": "Order and positions",
    "CoordinatorChannel.broadcast": "Broadcasts",
    "CoordinatorChannel.prune": "Retention",
    "CoordinatorChannel.channel_id": "Identity",
    "CoordinatorChannel.end_position": "End position",
}


def upgrade_section(version: int) -> str:
    """Where docs/backend-authors.md says how to upgrade a backend to contract ``version``."""
    return f"{CONTRACT_DOCS}#from-contract-{version - 1}-to-contract-{version}"


def introduced_in(method: str) -> int | None:
    """The contract version that added ``method`` (None: it was there from the start)."""
    for version, changes in CONTRACT_CHANGES.items():
        if any(method in change.methods for change in changes):
            return version
    return None


def missing_methods_error(cls: type, missing: Iterable[str]) -> MissingBackendMethodError:
    """The error naming the methods ``cls`` lacks, the rule each carries and where to read."""
    names = tuple(missing)
    parts = []
    for name in names:
        rule = METHOD_RULES.get(name)
        added = introduced_in(name)
        part = f"{name}()" + (f" (rule '{rule}')" if rule else "")
        if added is not None:
            part += f", new in contract {added}: see {upgrade_section(added)}"
        parts.append(part)
    return MissingBackendMethodError(
        f"{cls.__module__}.{cls.__qualname__} does not implement "
        + "; ".join(parts)
        + f" (backend contract {CONTRACT_VERSION}: see {CONTRACT_DOCS}#1-implement-the-channel)",
        names,
    )


class _ContractClass(abc.ABC):  # noqa: B024 - abstract through its three subclasses
    """Base of the three contract classes: instantiating a backend's class that lacks an
    abstract method raises :class:`MissingBackendMethodError` naming the methods and their
    rules, instead of Python's bare ``TypeError`` (which named neither the rule nor the
    upgrade guide, and reached users of an outdated plugin as a traceback)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        if cls.__abstractmethods__:
            base = next(k.__name__ for k in cls.__mro__ if k in _CONTRACT_CLASSES)
            raise missing_methods_error(
                cls, [f"{base}.{m}" for m in sorted(cls.__abstractmethods__)]
            )
        return super().__new__(cls)


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


class WriterChannel(_ContractClass):
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


class CoordinatorChannel(_ContractClass):
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

    def broadcast_all(self, events: Sequence[Event]) -> None:
        """Send ``events`` to every writer, in order, as :meth:`broadcast` sends one: a cycle's
        CommitToTable events, one per table it committed. The default sends them one by one;
        a backend whose broadcast is a round trip of its own (a transaction) should send them
        in one, since a cycle of 1,000 tables sends 1,000. Raises NotLeaderError when fenced
        (having sent none, or, by default, those before)."""
        for event in events:
            self.broadcast(event)

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

    def simulate_crash(self) -> None:
        """Test hook (the conformance suite's only crash simulation): make this channel look
        like its process died - cut its connections, never release the lease, so another
        coordinator takes over only after the lease expires. The default abandons the channel,
        which is what a dead process does for backends without live connections."""


class Backend(_ContractClass):
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

    def close(self) -> None:
        """Release shared resources (pools)."""

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Test hook used only by the conformance suite: append ``data`` - bytes that are not
        an encoded event - to this pipeline's channel after everything published so far, where
        ``writer_id``'s next event would go (its partition, where there are several),
        bypassing every check, as a corrupt record or a foreign client would. The suite uses
        it to check that ``poll`` stops at such a record (raises EventDecodeError) instead of
        skipping it; a backend that does not implement it fails that test (rule Bytes)."""
        raise missing_methods_error(type(self), ["Backend.inject_undecodable"])


#: The classes a backend subclasses (what :class:`_ContractClass` names a missing method by).
_CONTRACT_CLASSES = (WriterChannel, CoordinatorChannel, Backend)
