"""Deliberately broken variants of the in-memory reference backend, one broken rule each.

``test_conformance_mutants.py`` runs the conformance suite against every variant and checks
that the suite fails it, in the test of the rule that is broken (the suite's own mutation
test). Each variant is the reference backend with the smallest change that breaks one rule of
``docs/backend-authors.md``; ``MUTANTS`` maps its name to (factory maker, tests that must fail).
``MISSING`` holds variants that lack part of the contract (a method, the ``recreate_store``
fixture): the suite must report each missing part once, under the rule that needs it, and
skip the other tests that need it instead of failing them all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from icefloe.channel import (
    BackendStatus,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
)
from icefloe.errors import EventDecodeError
from icefloe.events import decode_event
from icefloe.testing.conformance import BackendFactory
from icefloe.testing.memory import (
    PARTITION,
    MemoryBackend,
    MemoryCoordinatorChannel,
    MemoryServer,
    MemoryWriterChannel,
    _Group,
)

# --------------------------------------------------------------------------- servers


class _OutOfOrder(MemoryServer):
    """Takes its offset, then appends later: under concurrency an event lands below a position
    a reader has already passed."""

    def publish(
        self, group_id: str, writer_id: str, epoch: int, batch_seq: int, events: list[bytes]
    ) -> bool:
        with self._cond:
            g = self._group(group_id)
            if not self._claim_key(g, writer_id, epoch, batch_seq):
                return False
            at = len(g.log)
        time.sleep(0.03)  # another writer appends (and a reader reads) meanwhile
        with self._cond:
            g.log[at:at] = events
            self._cond.notify_all()
        return True


class _PartialBatch(MemoryServer):
    """Makes a batch visible in two steps."""

    def publish(
        self, group_id: str, writer_id: str, epoch: int, batch_seq: int, events: list[bytes]
    ) -> bool:
        with self._cond:
            g = self._group(group_id)
            if not self._claim_key(g, writer_id, epoch, batch_seq):
                return False
            g.log.append(events[0])
            self._cond.notify_all()
        time.sleep(0.03)
        with self._cond:
            g.log.extend(events[1:])
            self._cond.notify_all()
        return True


class _BroadcastsLostOnPrune(MemoryServer):
    """Prunes broadcasts together with events, whether writers read them or not."""

    def prune(self, group_id: str, before: int) -> int:
        with self._cond:
            self._group(group_id).broadcasts.clear()
        return super().prune(group_id, before)


class _KeysForgottenOnPrune(MemoryServer):
    """Forgets the batch keys of pruned events: a replay after a prune is taken as new."""

    def prune(self, group_id: str, before: int) -> int:
        with self._cond:
            self._group(group_id).published.clear()
        return super().prune(group_id, before)


class _CrossPipeline(MemoryServer):
    """Keeps every pipeline in one state (epochs, keys, log, lease, positions, broadcasts)."""

    def _group(self, group_id: str) -> _Group:
        return self._groups.setdefault("all", _Group())


class _LeaseNotFencing(MemoryServer):
    """An old leader keeps renewing, broadcasting and storing positions after a takeover."""

    def _is_leader(self, g: _Group, holder: str, token: int) -> bool:
        return token <= g.token


class _ReleaseDoesNothing(MemoryServer):
    """``release`` keeps the lease: the next coordinator waits for the TTL."""

    def release(self, group_id: str, holder: str, token: int) -> None:
        pass


class _NumbersFromOne(MemoryServer):
    """Counts epochs and fencing tokens from 1 in every new store, as contract 1 allowed."""

    def _group(self, group_id: str) -> _Group:
        return self._groups.setdefault(group_id, _Group(token=0))

    def open_writer(self, group_id: str, writer_id: str) -> tuple[int, int]:
        with self._cond:
            g = self._group(group_id)
            g.epochs[writer_id] = g.epochs.get(writer_id, 0) + 1
            return g.epochs[writer_id], len(g.broadcasts)


# --------------------------------------------------------------------------- channels


class _SkippingCoordinator(MemoryCoordinatorChannel):
    """Skips undecodable records instead of stopping at them."""

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        first, raw = self._server.read(self._group_id, self._next, timeout, max_records)
        out = []
        for i, b in enumerate(raw):
            try:
                out.append(ChannelRecord(PARTITION, first + i, decode_event(b)))
            except EventDecodeError:
                continue
        self._next = first + len(raw)
        return out


class _ConstantIdCoordinator(MemoryCoordinatorChannel):
    """Names the channel by configuration (a constant here), not by its storage."""

    def channel_id(self) -> str:
        return "memory:the-pipeline-channel"


class _EndTooFarCoordinator(MemoryCoordinatorChannel):
    """Reports an end past the newest event (e.g. the next offset to allocate, plus one)."""

    def end_position(self) -> ChannelPosition:
        return {p: o + 1 for p, o in super().end_position().items()}


class _SeekAnywhereCoordinator(MemoryCoordinatorChannel):
    """Seeks past the end without a word, as contract 1 allowed."""

    def seek(self, position: ChannelPosition | None) -> None:
        self._next = 0 if position is None else int(position.get(PARTITION, 0))


class _Contract1Coordinator(MemoryCoordinatorChannel):
    """A coordinator end of contract 1: no channel_id, no end_position (the upgrade trial's
    SQLite backend)."""

    channel_id = CoordinatorChannel.channel_id  # abstract again
    end_position = CoordinatorChannel.end_position


class _WallClockCoordinator(MemoryCoordinatorChannel):
    """Returns ``expires_at`` on the wall clock, meaningless to the monotonic deadline readers."""

    def _lease(self, token: int, left: float) -> Lease:
        return Lease(token, self._coordinator_id, time.time() + left)


class _SameHolderCoordinator(MemoryCoordinatorChannel):
    """Uses the coordinator id alone as the lease holder: a second channel with that id (a
    restarted process) inherits a live lease."""

    def __init__(
        self, server: MemoryServer, group_id: str, coordinator_id: str, lease_ttl_s: float
    ) -> None:
        super().__init__(server, group_id, coordinator_id, lease_ttl_s)
        self._holder = coordinator_id


class _EndOutOfReach(MemoryCoordinatorChannel):
    """Reports an end one past its newest event, which no reader ever reaches."""

    def end_position(self) -> dict[str, int]:
        return {p: o + 1 for p, o in super().end_position().items()}


class _ThreadBoundError(Exception):
    pass


def _check_thread(owner: int) -> None:
    if threading.get_ident() != owner:
        raise _ThreadBoundError("channel used from a thread other than the one that made it")


class _ThreadBoundWriter(MemoryWriterChannel):
    """Works only on the thread that created it (like a client bound to a thread-local)."""

    def __init__(self, server: MemoryServer, group_id: str, writer_id: str) -> None:
        super().__init__(server, group_id, writer_id)
        self._owner = threading.get_ident()

    def open(self) -> int:
        _check_thread(self._owner)
        return super().open()

    def publish(self, batch: WriterBatch) -> bool:
        _check_thread(self._owner)
        return super().publish(batch)


# --------------------------------------------------------------------------- backends


class _StaleDescribeBackend(MemoryBackend):
    """``describe`` answers from a cache filled once: after a takeover it names the old leader
    and token."""

    _cached: BackendStatus | None = None

    def describe(self) -> BackendStatus:
        if self._cached is None or self._cached.leader is None:
            self._cached = super().describe()
        return self._cached


class _WritingProbeBackend(MemoryBackend):
    """``probe`` checks the server by appending a record to the pipeline's log."""

    def probe(self) -> None:
        self.server.inject(self.group_id, b"ping")


class _Backend(MemoryBackend):
    """The reference backend with replaceable channel classes."""

    coordinator_class: type[MemoryCoordinatorChannel] = MemoryCoordinatorChannel
    writer_class: type[MemoryWriterChannel] = MemoryWriterChannel

    def writer(self, writer_id: str) -> WriterChannel:
        return self.writer_class(self.server, self.group_id, writer_id)

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        return self.coordinator_class(self.server, self.group_id, coordinator_id, self.lease_ttl_s)


def _with(
    server_class: type[MemoryServer] = MemoryServer,
    coordinator: type[MemoryCoordinatorChannel] = MemoryCoordinatorChannel,
    writer: type[MemoryWriterChannel] = MemoryWriterChannel,
    backend: type[MemoryBackend] = MemoryBackend,
) -> Callable[[], BackendFactory]:
    """A maker of factories: one server per test, shared by every Backend the factory makes."""

    class Variant(_Backend, backend):  # type: ignore[misc, valid-type]
        coordinator_class = coordinator
        writer_class = writer

    def make() -> BackendFactory:
        server = server_class()
        return lambda group_id, ttl: Variant(server, group_id, ttl)

    return make


def _served(
    coordinator: type[MemoryCoordinatorChannel],
) -> Callable[[MemoryServer], BackendFactory]:
    """A maker of factories on a served reference server (the whole channel suite runs against
    these, its forked publishers included)."""

    class Variant(_Backend):
        coordinator_class = coordinator

    return lambda server: lambda group_id, ttl: Variant(server, group_id, ttl)


def _unshared() -> BackendFactory:
    """A new, private store on every factory call: writer and coordinator never meet."""
    return lambda group_id, ttl: MemoryBackend(MemoryServer(), group_id, ttl)


#: name -> (factory maker, tests of the suite that must fail, the rule they name)
MUTANTS: dict[str, tuple[Callable[[], BackendFactory], list[str], str]] = {
    "skips_undecodable": (
        _with(coordinator=_SkippingCoordinator),
        ["test_poll_stops_at_undecodable_bytes"],
        "Bytes",
    ),
    "unshared_store": (
        _unshared,
        ["test_backends_from_the_factory_share_one_store"],
        "Shared store",
    ),
    "out_of_order_visibility": (
        _with(_OutOfOrder),
        ["test_concurrent_publishers_from_threads"],
        "Order and positions",
    ),
    "partial_batch": (
        _with(_PartialBatch),
        ["test_concurrent_publishers_from_threads"],
        "Atomic batches",
    ),
    "broadcasts_lost": (
        _with(_BroadcastsLostOnPrune),
        ["test_broadcasts_are_kept_for_writers_opened_before_them"],
        "Retention",
    ),
    "keys_forgotten": (
        _with(_KeysForgottenOnPrune),
        ["test_batch_keys_survive_prune"],
        "Retention",
    ),
    "cross_pipeline_leak": (
        _with(_CrossPipeline),
        ["test_pipelines_are_isolated"],
        "Pipelines are isolated",
    ),
    "lease_not_fencing": (
        _with(_LeaseNotFencing),
        ["test_paused_leader_is_fenced_after_takeover"],
        "One leader",
    ),
    "release_does_nothing": (
        _with(_ReleaseDoesNothing),
        ["test_release_and_close_free_the_lease_before_it_expires"],
        "One leader",
    ),
    "same_holder_id": (
        _with(coordinator=_SameHolderCoordinator),
        ["test_two_channels_with_one_coordinator_id_are_two_contenders"],
        "One leader",
    ),
    "wall_clock_lease": (
        _with(coordinator=_WallClockCoordinator),
        ["test_lease_expires_at_is_a_local_monotonic_deadline"],
        "Lease clock",
    ),
    "end_out_of_reach": (
        _with(coordinator=_EndOutOfReach),
        ["test_a_reader_that_read_everything_reaches_end_position"],
        "End position",
    ),
    "thread_bound_channels": (
        _with(writer=_ThreadBoundWriter),
        ["test_channels_work_from_threads_other_than_their_creator"],
        "Threading",
    ),
    # the rules of contract 2 (docs/backend-authors.md, "From contract 1 to contract 2")
    "constant_channel_id": (
        _with(coordinator=_ConstantIdCoordinator),
        ["test_a_recreated_store_is_a_new_channel"],
        "Identity",
    ),
    "numbers_from_one": (
        _with(_NumbersFromOne),
        ["test_epochs_and_tokens_grow_across_a_recreated_store"],
        "Numbering",
    ),
    "end_past_the_newest_event": (
        _with(coordinator=_EndTooFarCoordinator),
        ["test_end_position_is_not_past_the_newest_event"],
        "End position",
    ),
    "seek_past_the_end_accepted": (
        _with(coordinator=_SeekAnywhereCoordinator),
        ["test_seek_past_the_end_raises_channel_reset"],
        "End position",
    ),
    "stale_describe": (
        _with(backend=_StaleDescribeBackend),
        ["test_describe_tells_the_leader_token_writers_and_position"],
        "Probe and describe",
    ),
    "writing_probe": (
        _with(backend=_WritingProbeBackend),
        ["test_probe_and_describe_change_nothing"],
        "Probe and describe",
    ),
}

#: name -> (factory maker on a served server, whether the test class provides
#: ``recreate_store``, the tests that must fail -> the rule each names); every other test of
#: the channel suite must pass or be skipped naming the test that reports what is missing
MISSING: dict[str, tuple[Callable[[MemoryServer], BackendFactory], bool, dict[str, str]]] = {
    "contract_1_coordinator": (
        _served(_Contract1Coordinator),
        True,
        {
            "test_channel_id_is_one_per_storage_and_stable": "Identity",
            "test_end_position_is_past_every_event_read": "End position",
        },
    ),
    "no_recreate_store": (
        _served(MemoryCoordinatorChannel),
        False,
        {"test_a_recreated_store_is_a_new_channel": "Identity"},
    ),
}
