"""The backend conformance suite: what every coordination backend must pass against its real
server. Each test checks one rule of ``docs/backend-authors.md`` and, when it fails, says which
(``rule 'Atomic batches' of docs/backend-authors.md is broken: ...``).

How a backend author uses it (the built-in Kafka, PostgreSQL and Redis backends do exactly
this; see ``docs/backend-authors.md``; needs ``icefloe-core[test]``)::

    # packages/my-backend/tests/my_backend/test_conformance.py
    import pytest
    from icefloe.testing.conformance import BackendConformance, BackendFactory

    class TestMyBackendConformance(BackendConformance):
        @pytest.fixture
        def backend_factory(self, my_server) -> BackendFactory:
            # (group_id, lease_ttl_s) -> a NEW Backend connected to the same real server; also
            # called in forked child processes, so it must connect when called
            return lambda group_id, ttl: MyBackend(my_server.url, group_id, lease_ttl_s=ttl)

The backend itself provides the two test hooks declared on the abstract classes of
:mod:`icefloe.channel`: ``Backend.inject_undecodable`` (required) and
``CoordinatorChannel.simulate_crash`` (optional).

Every test uses a fresh random ``group_id``, so tests never see each other's events, leases or
positions even on a shared server. Lease TTLs are short (:attr:`lease_ttl_s`) and every wait
polls with a deadline (:attr:`read_timeout_s`), so no test depends on timing.

What is checked (one or more tests per rule, see :data:`RULES`):

* channel contract: epochs grow and fence older writer instances (a fenced publish adds
  nothing); a batch's events are all visible, in publish order, contiguous for the writer;
  re-publishing a batch key is a no-op or yields exact duplicates (the coordinator drops them);
  positions grow and a seek to a stored position resumes exactly after it; concurrent
  publishers (threads of one Backend, and child processes with their own Backend) never make
  an event visible below a position already read, leave no gaps and show whole batches; one
  leader at a time with a fencing token that grows across takeovers, re-acquire, release,
  close, two channels with one coordinator id; lease takeover after the leader dies;
  broadcasts reach writers opened before them and are kept; batch keys survive ``prune``;
  Backend objects from the factory share one store; channels work from any thread; pipelines
  are isolated; ``poll`` stops at undecodable bytes;
* the coordinator end to end with a real Iceberg catalog (SQLite ``SqlCatalog`` in
  ``tmp_path``) and real Parquet files, the coordinator's Backend object being another one
  than the writers' (as in production): N writers x M cycles give exactly M snapshots per table
  and every row once; a replayed batch adds no rows; a coordinator crash between the Iceberg
  commit and the position store loses and duplicates nothing; a stale leader cannot commit
  after a takeover.

New tests are appended per section below; decorate each with :func:`rule`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import (
    Backend,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
)
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.summary import drained_property
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import EventDecodeError, NotLeaderError, WriterFencedError
from icefloe.events import (
    CommitComplete,
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    SourcePosition,
    StartCommit,
    WriterRef,
)
from icefloe.ops.drain import drain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, group_snapshots, make_sqlite_catalog
from icefloe.testing.harness import RowSource, SimulatedCrash, crash, lead, wait_pending

#: (group_id, lease_ttl_s) -> a new Backend on the shared real server.
BackendFactory = Callable[[str, float], Backend]

#: The rules of ``docs/backend-authors.md`` (section 1), by the name a failing test reports.
RULES = (
    "Shared store",
    "Epochs and fencing",
    "Atomic batches",
    "Idempotent batches",
    "Order and positions",
    "One leader",
    "Lease clock",
    "Broadcasts",
    "Retention",
    "Pipelines are isolated",
    "Zero timeouts do not block",
    "Identity",
    "End position",
    "Bytes",
    "Threading",
)

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def broken(name: str) -> Iterator[None]:
    """Report any failure inside the block as rule ``name`` being broken (the first rule
    named wins when checks nest)."""
    assert name in RULES, f"unknown rule {name!r}"
    prefix = f"rule '{name}' of docs/backend-authors.md is broken: "
    try:
        yield
    except Exception as exc:  # any failure breaks the rule
        pytest.fail(f"{prefix}{type(exc).__name__}: {exc}")
    except pytest.fail.Exception as exc:
        if str(exc).startswith("rule '"):
            raise
        pytest.fail(f"{prefix}{exc}")


def rule(name: str) -> Callable[[_F], _F]:
    """Mark a test as the check of one documented rule: any failure (assertion, timeout or an
    exception of the backend) is reported as that rule being broken, so an author knows which
    paragraph of the docs to read."""
    assert name in RULES, f"unknown rule {name!r}"

    def decorate(test: _F) -> _F:
        @functools.wraps(test)
        def checked(*args: Any, **kwargs: Any) -> Any:
            with broken(name):
                return test(*args, **kwargs)

        checked.rule = name  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


def position_after(records: list[ChannelRecord]) -> dict[str, int]:
    """The position right after ``records`` (next offset per partition)."""
    pos: dict[str, int] = {}
    for r in records:
        pos[r.partition] = max(pos.get(r.partition, 0), r.offset + 1)
    return pos


def assert_same_position(got: ChannelPosition | None, want: ChannelPosition) -> None:
    """Positions are equal when every partition's next offset is (absent means 0)."""
    assert got is not None, f"no stored position, expected {dict(want)}"
    parts = set(got) | set(want)
    assert {p: got.get(p, 0) for p in parts} == {p: want.get(p, 0) for p in parts}, (
        f"stored position {dict(got)} is not {dict(want)}"
    )


def fake_file(name: str) -> DataFileMeta:
    """File metadata for channel-only tests (channels never look inside)."""
    return DataFileMeta(
        path=f"file:///conformance/{name}.parquet", record_count=1, file_size_in_bytes=1
    )


def make_batch(
    group_id: str, ref: WriterRef, seq: int, tables: tuple[str, ...] = ("ns.a",)
) -> WriterBatch:
    """A writer batch like the WriterClient builds: one DataWritten per table, one
    DataComplete."""
    pos = (SourcePosition("src", 0, seq + 1, 1000 + seq),)
    events = [
        Event(group_id, DataWritten(t, (fake_file(f"{ref.writer_id}-{seq}-{t}"),)), ref, seq)
        for t in tables
    ]
    events.append(Event(group_id, DataComplete(pos), ref, seq))
    return WriterBatch(ref, seq, tuple(events), pos)


def event_ids(batches: Sequence[WriterBatch]) -> set[str]:
    """Every event id of the given batches."""
    return {e.event_id for b in batches for e in b.events}


T = TypeVar("T")


def in_thread(call: Callable[[], T], timeout: float) -> T:
    """Run ``call`` on a new thread and return its result (or raise its exception)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # re-raised on the caller's thread
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if err:
        raise err[0]
    if not out:
        pytest.fail(f"a call on another thread did not return within {timeout}s")
    return out[0]


@contextlib.contextmanager
def opened_backend(factory: BackendFactory, group_id: str, ttl: float) -> Iterator[Backend]:
    """A Backend from the factory, closed afterwards."""
    b = factory(group_id, ttl)
    try:
        yield b
    finally:
        b.close()


def publish_run(backend: Backend, group_id: str, writer_id: str, n: int) -> list[list[str]]:
    """Open a writer and publish ``n`` two-table batches; the event ids of each batch."""
    ch = backend.writer(writer_id)
    try:
        ref = WriterRef(writer_id, ch.open())
        out = []
        for seq in range(n):
            batch = make_batch(group_id, ref, seq, tables=("ns.a", "ns.b"))
            if ch.publish(batch) is not True:
                raise AssertionError(f"{writer_id} batch {seq} was refused as a replay")
            out.append([e.event_id for e in batch.events])
        return out
    finally:
        ch.close()


def _publish_in_child(
    factory: BackendFactory, group_id: str, ttl: float, writer_id: str, n: int, conn: Connection
) -> None:
    """Child process: its own Backend from the factory, as a Spark executor builds one."""
    try:
        with opened_backend(factory, group_id, ttl) as backend:
            conn.send(("ok", publish_run(backend, group_id, writer_id, n)))
    except BaseException as exc:  # reported to the parent
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


class BackendConformance:
    """Base class of a backend's conformance tests; see the module docstring."""

    #: lease TTL given to every backend made by the factory
    lease_ttl_s: ClassVar[float] = 1.5
    #: how long a test waits for events, broadcasts or a lease before failing
    read_timeout_s: ClassVar[float] = 20.0

    # ------------------------------------------------------------------ what subclasses provide

    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        """Override: return ``(group_id, lease_ttl_s) -> Backend`` on the real server."""
        raise NotImplementedError(
            "subclass BackendConformance and provide a `backend_factory` fixture"
        )

    #: True for backends whose pipelines share one log (Kafka's control topic): ``poll`` may
    #: then return other pipelines' events, which the coordinator skips by group id.
    shared_log: ClassVar[bool] = False
    #: writers (threads, and processes) and batches each in the concurrency tests
    concurrent_writers: ClassVar[int] = 3
    concurrent_batches: ClassVar[int] = 8

    # ------------------------------------------------------------------ shared fixtures

    @pytest.fixture
    def group_id(self) -> str:
        return f"conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def backend(self, backend_factory: BackendFactory, group_id: str) -> Iterator[Backend]:
        with opened_backend(backend_factory, group_id, self.lease_ttl_s) as b:
            yield b

    @pytest.fixture
    def other_backend(self, backend_factory: BackendFactory, group_id: str) -> Iterator[Backend]:
        """A second Backend object of the same pipeline, as another process would build."""
        with opened_backend(backend_factory, group_id, self.lease_ttl_s) as b:
            yield b

    @pytest.fixture
    def channels(self) -> Iterator[list[WriterChannel | CoordinatorChannel]]:
        """Channels a test opens; closed at teardown (errors ignored: some are fenced or
        'dead')."""
        opened: list[WriterChannel | CoordinatorChannel] = []
        yield opened
        for ch in reversed(opened):
            # teardown of channels a test fenced or "killed" may fail; that is expected
            with contextlib.suppress(Exception):
                ch.close()

    @pytest.fixture
    def catalog(self, tmp_path: Path) -> SqlCatalog:
        return make_sqlite_catalog(tmp_path / "iceberg")

    # ------------------------------------------------------------------ helpers

    def writer(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel], writer_id: str
    ) -> tuple[WriterChannel, WriterRef]:
        ch = backend.writer(writer_id)
        channels.append(ch)
        return ch, WriterRef(writer_id, ch.open())

    def publish_batches(
        self,
        backend: Backend,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
        n: int,
    ) -> list[WriterBatch]:
        """``n`` batches (seq 0..n-1) published by a fresh writer ``w``, each accepted."""
        w, ref = self.writer(backend, channels, "w")
        batches = [make_batch(group_id, ref, seq) for seq in range(n)]
        for b in batches:
            assert w.publish(b) is True
        return batches

    def leader(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel], name: str
    ) -> tuple[CoordinatorChannel, Lease]:
        ch = backend.coordinator(name)
        channels.append(ch)
        lease = ch.acquire(self.read_timeout_s)
        assert lease is not None, f"{name} could not acquire the lease of a fresh pipeline"
        return ch, lease

    def take_over(
        self,
        backend: Backend,
        channels: list[WriterChannel | CoordinatorChannel],
        name: str,
        before: Lease,
        why: str,
    ) -> tuple[CoordinatorChannel, Lease]:
        """A new coordinator ``name`` acquires the lease after ``before``'s holder gave it up
        (``why`` says how it must have been freed) with a greater token."""
        ch = backend.coordinator(name)
        channels.append(ch)
        lease = ch.acquire(self.read_timeout_s)
        assert lease is not None, why
        assert lease.token > before.token
        return ch, lease

    def read_until(
        self,
        channel: CoordinatorChannel,
        group_id: str,
        done: Callable[[list[ChannelRecord]], bool],
    ) -> list[ChannelRecord]:
        """Poll (this pipeline's records only) until ``done(records)`` or fail at the
        deadline."""
        got: list[ChannelRecord] = []
        deadline = time.monotonic() + self.read_timeout_s
        while not done(got):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {self.read_timeout_s}s; read {len(got)} records")
            got.extend(r for r in channel.poll(0.2) if r.event.group_id == group_id)
        return got

    def broadcasts_until(
        self, channel: WriterChannel, done: Callable[[list[Event]], bool]
    ) -> list[Event]:
        got: list[Event] = []
        deadline = time.monotonic() + self.read_timeout_s
        while not done(got):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out after {self.read_timeout_s}s; got {len(got)} broadcasts: {got[:3]}"
                )
            got.extend(channel.poll_broadcasts(0.2))
        return got

    @staticmethod
    def has_events(ids: set[str]) -> Callable[[list[ChannelRecord]], bool]:
        return lambda recs: ids <= {r.event.event_id for r in recs}

    # ------------------------------------------------------------------ channel contract

    @rule("Epochs and fencing")
    def test_open_fences_older_instances_with_growing_epochs(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        _, r1 = self.writer(backend, channels, "w")
        _, r2 = self.writer(backend, channels, "w")
        _, r3 = self.writer(backend, channels, "w")
        assert r1.epoch < r2.epoch < r3.epoch

    @rule("Epochs and fencing")
    def test_fenced_writer_publishes_nothing(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        old, old_ref = self.writer(backend, channels, "w")
        new, new_ref = self.writer(backend, channels, "w")
        stale = make_batch(group_id, old_ref, 1)
        with pytest.raises(WriterFencedError):
            old.publish(stale)
        with pytest.raises(WriterFencedError):
            old.respond(Event(group_id, DataComplete((), "c"), old_ref, None))
        marker = make_batch(group_id, new_ref, 2)
        assert new.publish(marker) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        recs = self.read_until(
            coord, group_id, self.has_events({e.event_id for e in marker.events})
        )
        seen = {r.event.event_id for r in recs}
        assert not seen & {e.event_id for e in stale.events}, "a fenced publish became visible"
        assert all(r.event.writer == new_ref for r in recs)

    @rule("Atomic batches")
    def test_batches_are_whole_ordered_and_contiguous_per_writer(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        writers = [self.writer(backend, channels, f"w{i}") for i in range(2)]
        published: dict[str, list[str]] = {ref.writer_id: [] for _, ref in writers}
        for seq in range(5):
            for ch, ref in writers:
                batch = make_batch(group_id, ref, seq, tables=("ns.a", "ns.b"))
                assert ch.publish(batch) is True
                published[ref.writer_id].extend(e.event_id for e in batch.events)
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        wanted = {i for ids in published.values() for i in ids}
        recs = self.read_until(coord, group_id, self.has_events(wanted))
        for writer_id, ids in published.items():
            order = [
                r.event.event_id
                for r in recs
                if r.event.writer and r.event.writer.writer_id == writer_id
            ]
            # exactly the published events, each once, in publish order: every batch is whole
            # and no other batch of this writer sits inside it
            assert order == ids
        by_partition: dict[str, list[int]] = {}
        for r in recs:
            by_partition.setdefault(r.partition, []).append(r.offset)
        for offsets in by_partition.values():
            assert offsets == sorted(offsets)
            assert len(set(offsets)) == len(offsets)

    @rule("Idempotent batches")
    def test_republishing_a_batch_adds_nothing_or_exact_duplicates(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        first, ref1 = self.writer(backend, channels, "w")
        batch = make_batch(group_id, ref1, 7)
        assert first.publish(batch) is True
        again = first.publish(batch)
        # a restarted instance replays the same batch key (what Spark does after a crash)
        second, ref2 = self.writer(backend, channels, "w")
        replay = make_batch(group_id, ref2, 7)
        replayed = second.publish(replay)
        marker = make_batch(group_id, ref2, 8)
        assert second.publish(marker) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        recs = self.read_until(
            coord, group_id, self.has_events({e.event_id for e in marker.events})
        )
        ids = [r.event.event_id for r in recs]
        for e in batch.events:
            assert ids.count(e.event_id) == 1 + int(again), "re-publish must be all or nothing"
        for e in replay.events:
            assert ids.count(e.event_id) == int(replayed)
        seven = [r for r in recs if r.event.batch_seq == 7]
        assert len(seven) == len(batch.events) * (1 + int(again) + int(replayed))

    @rule("Order and positions")
    def test_positions_grow_and_seek_resumes_exactly_after_stored_position(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        batches = self.publish_batches(backend, group_id, channels, 6)
        coord, _ = self.leader(backend, channels, "c1")
        assert coord.stored_position() is None, "a new pipeline has no stored position"
        coord.seek(None)
        recs = self.read_until(coord, group_id, self.has_events(event_ids(batches)))
        cut = len(recs) // 2
        pos = position_after(recs[:cut])
        coord.store_position(pos)
        assert_same_position(coord.stored_position(), pos)
        coord.release()
        coord2, _ = self.leader(backend, channels, "c2")
        stored = coord2.stored_position()
        assert_same_position(stored, pos)
        assert stored is not None
        coord2.seek(stored)
        expected = [r for r in recs if not r.is_before(pos)]
        again = self.read_until(
            coord2, group_id, self.has_events({r.event.event_id for r in expected})
        )
        assert [r.event.event_id for r in again] == [r.event.event_id for r in expected]
        assert [(r.partition, r.offset) for r in again] == [
            (r.partition, r.offset) for r in expected
        ]

    @rule("Zero timeouts do not block")
    def test_zero_timeout_polls_do_not_block(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A zero timeout means "do not wait" (not "wait forever", as some clients read 0):
        the writer client polls broadcasts this way while holding its publish lock."""
        w, _ = self.writer(backend, channels, "w")
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        returned = threading.Event()

        def polls() -> None:
            w.poll_broadcasts(0.0)
            coord.poll(0.0)
            returned.set()

        threading.Thread(target=polls, daemon=True).start()
        assert returned.wait(self.read_timeout_s), "poll with timeout 0 did not return"

    @rule("One leader")
    def test_single_leader_with_growing_fencing_token(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        w, ref = self.writer(backend, channels, "w")
        batch = make_batch(group_id, ref, 1)
        assert w.publish(batch) is True
        c1, l1 = self.leader(backend, channels, "c1")
        c2 = backend.coordinator("c2")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a second coordinator got the lease of a live leader"
        assert c1.renew().token == l1.token
        c1.seek(None)
        pos = position_after(
            self.read_until(c1, group_id, self.has_events({e.event_id for e in batch.events}))
        )
        c1.store_position(pos)
        c1.release()
        l2 = c2.acquire(self.read_timeout_s)
        assert l2 is not None
        assert l2.token > l1.token
        with pytest.raises(NotLeaderError):
            c1.renew()
        with pytest.raises(NotLeaderError):
            c1.broadcast(Event(group_id, StartCommit("stale")))
        with pytest.raises(NotLeaderError):
            c1.store_position({p: o + 100 for p, o in pos.items()})
        assert_same_position(c2.stored_position(), pos)
        c2.release()
        l3 = c1.acquire(self.read_timeout_s)
        assert l3 is not None
        assert l3.token > l2.token

    @rule("One leader")
    def test_lease_takeover_after_leader_dies(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        c1, l1 = self.leader(backend, channels, "c1")
        c1.simulate_crash()
        self.take_over(backend, channels, "c2", l1, "no takeover after the leader died")

    @rule("One leader")
    def test_paused_leader_is_fenced_after_takeover(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A leader that stops renewing (a long GC pause) and wakes up after another took over
        must fail to renew, broadcast or store a position."""
        c1, l1 = self.leader(backend, channels, "c1")
        c1.store_position({"0": 0})
        c2, _ = self.take_over(
            backend, channels, "c2", l1, "no takeover after the leader stopped renewing"
        )
        with pytest.raises(NotLeaderError):
            c1.store_position({"0": 1})
        with pytest.raises(NotLeaderError):
            c1.broadcast(Event(group_id, StartCommit("zombie")))
        with pytest.raises(NotLeaderError):
            c1.renew()
        assert_same_position(c2.stored_position(), {"0": 0})

    @rule("Broadcasts")
    def test_broadcasts_reach_writers_opened_before_them(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        writers = [self.writer(backend, channels, f"w{i}")[0] for i in range(2)]
        coord, _ = self.leader(backend, channels, "c")
        sent = [
            Event(group_id, StartCommit("c-1")),
            Event(group_id, CommitComplete("c-1", 123)),
        ]
        for e in sent:
            coord.broadcast(e)
        want = [e.event_id for e in sent]
        for w in writers:
            got = self.broadcasts_until(w, lambda evs: set(want) <= {e.event_id for e in evs})
            mine = [e.event_id for e in got if e.group_id == group_id]
            assert mine == want
            assert got[0].payload == StartCommit("c-1")

    @rule("Retention")
    def test_prune_drops_only_events_before_the_position(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        batches = self.publish_batches(backend, group_id, channels, 4)
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        recs = self.read_until(coord, group_id, self.has_events(event_ids(batches)))
        cut = len(recs) // 2
        pos: ChannelPosition = position_after(recs[:cut])
        coord.store_position(pos)
        dropped = coord.prune(pos)
        assert dropped >= 0
        coord.seek(None)
        kept = [r for r in recs if not r.is_before(pos)]
        again = self.read_until(coord, group_id, self.has_events({r.event.event_id for r in kept}))
        before = [r for r in again if r.is_before(pos)]
        assert len(before) <= cut
        if dropped:
            assert len(before) <= cut - min(dropped, cut), "prune reported drops it did not make"

    # ------------------------------------------------------------------ shared store, bytes

    @rule("Shared store")
    def test_backends_from_the_factory_share_one_store(
        self,
        backend: Backend,
        other_backend: Backend,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """The writer's and the coordinator's Backend objects are different (different
        processes, in production) yet meet in one store: events, epochs, lease, broadcasts."""
        assert other_backend is not backend, "the factory must return a new Backend per call"
        w, ref = self.writer(backend, channels, "w")
        batch = make_batch(group_id, ref, 0)
        assert w.publish(batch) is True
        coord, _ = self.leader(other_backend, channels, "c")
        coord.seek(None)
        pos = position_after(self.read_until(coord, group_id, self.has_events(event_ids([batch]))))
        sent = Event(group_id, StartCommit("shared"))
        coord.broadcast(sent)
        got = self.broadcasts_until(w, lambda evs: sent.event_id in {e.event_id for e in evs})
        assert sent.event_id in {e.event_id for e in got}
        rival = backend.coordinator("rival")
        channels.append(rival)
        assert rival.acquire(0.3) is None, "another Backend object's leader was not seen"
        _, ref2 = self.writer(other_backend, channels, "w")
        assert ref2.epoch > ref.epoch, "another Backend object's writer epoch was not seen"
        with pytest.raises(WriterFencedError):
            w.publish(make_batch(group_id, ref, 1))
        coord.store_position(pos)
        reader = backend.coordinator("reader")
        channels.append(reader)
        assert_same_position(reader.stored_position(), pos)

    @rule("Bytes")
    def test_poll_stops_at_undecodable_bytes(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A record that does not decode raises EventDecodeError from ``poll`` - on every poll,
        at that record - and is never skipped: what follows it may be a DataWritten the
        coordinator must not lose."""
        w, ref = self.writer(backend, channels, "w")
        before = make_batch(group_id, ref, 0)
        after = make_batch(group_id, ref, 1)
        assert w.publish(before) is True
        backend.inject_undecodable(b"\x00\xffnot an icefloe event", "w")
        assert w.publish(after) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        got: list[ChannelRecord] = []
        deadline = time.monotonic() + self.read_timeout_s
        raised = 0
        while raised < 2:
            if time.monotonic() > deadline:
                pytest.fail(
                    "poll never raised EventDecodeError for the injected bytes "
                    f"(read {len(got)} records): it skips undecodable records"
                )
            try:
                got.extend(r for r in coord.poll(0.2) if r.event.group_id == group_id)
            except EventDecodeError:
                raised += 1  # and again: the record is not consumed by raising
            seen = {r.event.event_id for r in got}
            assert not seen & event_ids([after]), "poll skipped the undecodable record"
        assert event_ids([before]) <= {r.event.event_id for r in got}, (
            "events before the undecodable record were not returned first"
        )

    # ------------------------------------------------------------------ concurrency, threads

    def _concurrent_read(
        self, coord: CoordinatorChannel, group_id: str, running: Callable[[], bool]
    ) -> tuple[list[ChannelRecord], dict[str, int | None]]:
        """Read while publishers run (and until the channel is quiet after): this pipeline's
        records, and for each event the poll that returned it - None when that poll was cut by
        ``max_records``, which may legitimately end inside a batch."""
        records: list[ChannelRecord] = []
        poll_of: dict[str, int | None] = {}
        quiet, n = 0, 0
        deadline = time.monotonic() + self.read_timeout_s * 3
        while running() or quiet < 3:
            if time.monotonic() > deadline:
                pytest.fail(f"publishers did not finish within {self.read_timeout_s * 3}s")
            got = coord.poll(0.2, max_records=100)
            n += 1
            for r in got:
                if r.event.group_id == group_id:
                    records.append(r)
                    poll_of[r.event.event_id] = None if len(got) >= 100 else n
            quiet = 0 if (got or running()) else quiet + 1
        return records, poll_of

    def _check_concurrent_visibility(
        self,
        backend: Backend,
        channels: list[WriterChannel | CoordinatorChannel],
        group_id: str,
        read: tuple[list[ChannelRecord], dict[str, int | None]],
        published: dict[str, list[list[str]]],
    ) -> None:
        records, poll_of = read
        wanted = {i for batches in published.values() for b in batches for i in b}
        missing = wanted - {r.event.event_id for r in records}
        # read again from the start: anything that became visible behind the concurrent reader
        # (below a position it had already passed) shows up here but was missed above
        fresh = backend.coordinator("re-reader")
        channels.append(fresh)
        fresh.seek(None)
        again = self.read_until(fresh, group_id, self.has_events(wanted))
        assert not missing, (
            f"{len(missing)} events became visible at positions the reader had already passed "
            "(visibility order must equal position order)"
        )
        last: dict[str, int] = {}
        for r in records:
            assert r.offset > last.get(r.partition, -1), (
                f"poll went backwards or repeated: {r.partition}@{r.offset} after "
                f"{last.get(r.partition)}"
            )
            last[r.partition] = r.offset
        for part in {r.partition for r in records} | {r.partition for r in again}:
            assert [(r.offset, r.event.event_id) for r in again if r.partition == part] == [
                (r.offset, r.event.event_id) for r in records if r.partition == part
            ], f"partition {part} re-read from the start differs from what was read while "
            "publishing (gaps)"
        for writer_id, batches in published.items():
            order = [
                r.event.event_id
                for r in records
                if r.event.writer and r.event.writer.writer_id == writer_id
            ]
            assert order == [i for b in batches for i in b], (
                f"writer {writer_id}'s events are not its batches whole and in publish order"
            )
        for b in (b for batches in published.values() for b in batches):
            with broken("Atomic batches"):
                where = {poll_of[e] for e in b}
                assert len(where) == 1 or None in where, (
                    "a batch became visible in parts: its events came in separate polls "
                    f"{sorted(w for w in where if w is not None)}"
                )

    @rule("Order and positions")
    def test_concurrent_publishers_from_threads(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """Writer channels of one Backend publish from several threads at once while the
        coordinator reads: no event appears below a position already read, nothing is
        skipped, batches are whole, each writer's batches keep their order."""
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        published: dict[str, list[list[str]]] = {}
        errors: list[BaseException] = []

        def run(writer_id: str) -> None:
            try:
                published[writer_id] = publish_run(
                    backend, group_id, writer_id, self.concurrent_batches
                )
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(f"t{i}",), daemon=True)
            for i in range(self.concurrent_writers)
        ]
        for t in threads:
            t.start()
        read = self._concurrent_read(coord, group_id, lambda: any(t.is_alive() for t in threads))
        assert not errors, f"a publisher thread failed: {errors[0]!r}"
        self._check_concurrent_visibility(backend, channels, group_id, read, published)

    @rule("Order and positions")
    def test_concurrent_publishers_from_processes(
        self,
        backend: Backend,
        backend_factory: BackendFactory,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """The same with writers in forked child processes, each with its own Backend from the
        factory (how Spark executors publish)."""
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        ctx = multiprocessing.get_context("fork")
        pipes = []
        procs = []
        for i in range(self.concurrent_writers):
            parent, child = ctx.Pipe(duplex=False)
            args = (backend_factory, group_id, self.lease_ttl_s, f"p{i}", self.concurrent_batches)
            proc = ctx.Process(target=_publish_in_child, args=(*args, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        try:
            try:
                # publishing ends when a child sends its result; closing its clients after
                # that is not what the read must outlast (the finally below reaps them)
                read = self._concurrent_read(
                    coord,
                    group_id,
                    lambda: any(
                        p.is_alive() and not pipe.poll(0)
                        for p, pipe in zip(procs, pipes, strict=True)
                    ),
                )
            except pytest.fail.Exception as exc:
                # say where the publishers were: still publishing, or done but not exited
                where = [
                    f"p{i}: {'result sent' if pipe.poll(0) else 'no result'}, "
                    f"{'alive' if proc.is_alive() else f'exit {proc.exitcode}'}"
                    for i, (pipe, proc) in enumerate(zip(pipes, procs, strict=True))
                ]
                pytest.fail(f"{exc} ({'; '.join(where)})")
            published: dict[str, list[list[str]]] = {}
            for i, pipe in enumerate(pipes):
                assert pipe.poll(self.read_timeout_s), f"child p{i} sent no result"
                status, value = pipe.recv()
                assert status == "ok", f"publisher process p{i} failed: {value}"
                published[f"p{i}"] = value
        finally:
            for proc in procs:
                proc.join(self.read_timeout_s)
                if proc.is_alive():
                    proc.kill()
        self._check_concurrent_visibility(backend, channels, group_id, read, published)

    @rule("Threading")
    def test_channels_work_from_threads_other_than_their_creator(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """Every call below runs on a new thread, none on the one that made the channel (the
        writer client and the coordinator call from their own threads)."""
        w = backend.writer("w")
        coord = backend.coordinator("c")
        channels.extend([w, coord])
        ref = WriterRef("w", in_thread(w.open, self.read_timeout_s))
        batch = make_batch(group_id, ref, 0)
        assert in_thread(lambda: w.publish(batch), self.read_timeout_s) is True
        assert in_thread(lambda: coord.acquire(self.read_timeout_s), self.read_timeout_s * 2)
        in_thread(lambda: coord.seek(None), self.read_timeout_s)
        recs = in_thread(
            lambda: self.read_until(coord, group_id, self.has_events(event_ids([batch]))),
            self.read_timeout_s * 2,
        )
        sent = Event(group_id, StartCommit("threads"))
        in_thread(lambda: coord.broadcast(sent), self.read_timeout_s)
        in_thread(lambda: coord.renew(), self.read_timeout_s)
        in_thread(lambda: coord.store_position(position_after(recs)), self.read_timeout_s)
        got = in_thread(
            lambda: self.broadcasts_until(w, lambda evs: sent in evs), self.read_timeout_s * 2
        )
        assert sent in got
        in_thread(lambda: w.respond(Event(group_id, DataComplete((), "threads"), ref, 0)), 20)
        in_thread(coord.release, self.read_timeout_s)

    # ------------------------------------------------------------------ lease

    @rule("One leader")
    def test_reacquire_by_the_leader_keeps_the_lease(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        c1, l1 = self.leader(backend, channels, "c1")
        again = c1.acquire(self.read_timeout_s)
        assert again is not None, "the leader could not re-acquire its own lease"
        assert again.token >= l1.token
        c2 = backend.coordinator("c2")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a re-acquire let a second coordinator in"
        assert c1.renew().token == again.token

    @rule("One leader")
    def test_release_and_close_free_the_lease_before_it_expires(
        self,
        backend_factory: BackendFactory,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """With a lease far longer than the test waits, only a real release lets the next
        coordinator in."""
        long_ttl = max(120.0, self.read_timeout_s * 4)
        with opened_backend(backend_factory, group_id, long_ttl) as b:
            c1, l1 = self.leader(b, channels, "c1")
            c1.release()
            with pytest.raises(NotLeaderError):
                c1.renew()
            c2, l2 = self.take_over(b, channels, "c2", l1, "release() did not free the lease")
            c2.close()
            self.take_over(b, channels, "c3", l2, "close() did not release the lease")

    @rule("One leader")
    def test_two_channels_with_one_coordinator_id_are_two_contenders(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A restarted process reuses its coordinator id; it must not inherit the lease."""
        c1, _ = self.leader(backend, channels, "same")
        c2 = backend.coordinator("same")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a second channel with the same id got a live lease"
        with pytest.raises(NotLeaderError):
            c2.renew()
        with pytest.raises(NotLeaderError):
            c2.store_position({"0": 1})
        with pytest.raises(NotLeaderError):
            c2.broadcast(Event(group_id, StartCommit("same")))
        c1.renew()

    @rule("Lease clock")
    def test_lease_expires_at_is_a_local_monotonic_deadline(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        before = time.monotonic()
        c, lease = self.leader(backend, channels, "c")
        renewed = c.renew()
        after = time.monotonic()
        for got in (lease, renewed):
            assert before < got.expires_at <= after + self.lease_ttl_s + 5.0, (
                f"Lease.expires_at {got.expires_at} is not a time.monotonic() deadline of this "
                f"process (now {after}, lease TTL {self.lease_ttl_s}s)"
            )

    # ------------------------------------------------------------------ retention, isolation

    @rule("Retention")
    def test_batch_keys_survive_prune(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A writer replays its last batches after a restart, possibly after the coordinator
        committed and pruned them: the key must still be known (or, for backends that cannot
        check keys, the replay yields exact duplicates the coordinator drops)."""
        w, ref = self.writer(backend, channels, "w")
        batches = [make_batch(group_id, ref, seq) for seq in range(3)]
        for b in batches:
            assert w.publish(b) is True
        checks_keys = w.publish(batches[-1]) is False
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        pos = position_after(self.read_until(coord, group_id, self.has_events(event_ids(batches))))
        coord.store_position(pos)
        coord.prune(pos)
        w2, ref2 = self.writer(backend, channels, "w")
        replays = [make_batch(group_id, ref2, seq) for seq in range(3)]
        accepted = [w2.publish(b) for b in replays]
        marker = make_batch(group_id, ref2, 3)
        assert w2.publish(marker) is True
        coord.seek(pos)
        recs = self.read_until(coord, group_id, self.has_events(event_ids([marker])))
        if checks_keys:
            assert accepted == [False] * 3, "a pruned batch key was forgotten"
            assert not {r.event.event_id for r in recs} & event_ids(replays)
        else:
            ids = [r.event.event_id for r in recs]
            for b, ok in zip(replays, accepted, strict=True):
                for e in b.events:
                    assert ids.count(e.event_id) == int(ok)

    @rule("Retention")
    def test_broadcasts_are_kept_for_writers_opened_before_them(
        self, backend: Backend, group_id: str, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        """A writer busy with a long batch polls late: every broadcast sent after it opened is
        still there, also after ``prune`` and many later broadcasts."""
        w, ref = self.writer(backend, channels, "w")
        batch = make_batch(group_id, ref, 0)
        assert w.publish(batch) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        sent = [Event(group_id, StartCommit("kept-0"))]
        coord.broadcast(sent[0])
        pos = position_after(self.read_until(coord, group_id, self.has_events(event_ids([batch]))))
        coord.store_position(pos)
        coord.prune(pos)
        for i in range(1, 50):
            sent.append(Event(group_id, CommitComplete(f"kept-{i}", i)))
            coord.broadcast(sent[-1])
        want = [e.event_id for e in sent]
        got = self.broadcasts_until(w, lambda evs: len(evs) >= len(want))
        assert [e.event_id for e in got if e.group_id == group_id] == want, (
            "broadcasts were lost or reordered before a writer opened earlier read them"
        )

    @rule("Pipelines are isolated")
    def test_pipelines_are_isolated(
        self,
        backend: Backend,
        backend_factory: BackendFactory,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """Same writer id and batch key, leases, positions and broadcasts in two pipelines of
        one server never interfere."""
        other_id = f"{group_id}-other"
        with opened_backend(backend_factory, other_id, self.lease_ttl_s) as other:
            wa, ra = self.writer(backend, channels, "w")
            wb, rb = self.writer(other, channels, "w")
            a, b = make_batch(group_id, ra, 0), make_batch(other_id, rb, 0)
            assert wa.publish(a) is True
            assert wb.publish(b) is True, "a batch key of another pipeline was taken as a replay"
            ca, _ = self.leader(backend, channels, "c")
            cb, _ = self.leader(other, channels, "c")
            ca.seek(None)
            pos = position_after(self.read_until(ca, group_id, self.has_events(event_ids([a]))))
            ca.store_position(pos)
            assert cb.stored_position() is None, "a position stored in another pipeline"
            if not self.shared_log:
                ca.seek(None)
                leaked = [r for r in ca.poll(0.5) if r.event.group_id != group_id]
                assert not leaked, f"poll returned events of another pipeline: {leaked[:3]}"
            ca.broadcast(Event(group_id, StartCommit("a-only")))
            mark = Event(other_id, StartCommit("b-mark"))
            cb.broadcast(mark)
            got = self.broadcasts_until(wb, lambda evs: mark in evs)
            assert all(e.group_id == other_id for e in got), "a broadcast crossed pipelines"

    # ------------------------------------------------------------------ coordinator scenarios

    tables: ClassVar[tuple[str, ...]] = ("conformance.orders", "conformance.events")

    @pytest.fixture
    def closers(self) -> Iterator[list[Callable[[], None]]]:
        """Writer clients and coordinators to close at teardown, newest first."""
        todo: list[Callable[[], None]] = []
        yield todo
        for close in reversed(todo):
            with contextlib.suppress(Exception):
                close()

    def settings(self) -> CoordinatorSettings:
        """Cycles only when a test asks (commit_now); bounded waits."""
        return CoordinatorSettings(
            commit_interval_s=3600.0,
            commit_timeout_s=self.read_timeout_s,
            writer_timeout_s=600.0,
        )

    def coordinator(
        self,
        backend: Backend,
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
        name: str,
        hooks: CoordinatorHooks | None = None,
        settings: CoordinatorSettings | None = None,
    ) -> Coordinator:
        c = Coordinator(
            group_id,
            backend.coordinator(name),
            catalog,
            settings or self.settings(),
            coordinator_id=name,
            plugins=new_plugins(autoload=False),
            hooks=hooks,
        )
        closers.append(c.close)
        return c

    def writer_clients(
        self, backend: Backend, group_id: str, closers: list[Callable[[], None]], n: int
    ) -> list[WriterClient]:
        out = []
        for i in range(n):
            w = WriterClient(backend.writer(f"writer-{i}"), group_id, f"writer-{i}")
            w.start()
            closers.append(w.close)
            out.append(w)
        return out

    def test_n_writers_m_cycles_commit_every_row_exactly_once(
        self,
        backend: Backend,
        other_backend: Backend,
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        n_writers, m_cycles = 3, 3
        source = RowSource.create(catalog, self.tables)
        writers = self.writer_clients(backend, group_id, closers, n_writers)
        coord = self.coordinator(other_backend, catalog, group_id, closers, "c1")
        lead(coord, self.read_timeout_s)
        for cycle in range(m_cycles):
            files = sum(source.publish(w, cycle).file_count for w in writers)
            wait_pending(coord, files, self.read_timeout_s)
            result = coord.commit_now()
            assert result.complete, "every writer answers StartCommit"
            assert result.valid_through_ms is not None
            assert not result.failed
            assert {r.table for r in result.tables if r.snapshot_id is not None} == set(self.tables)
        for t in self.tables:
            assert len(group_snapshots(catalog, t, group_id)) == m_cycles
            assert_exactly_once(catalog, t, source.expected[t])

        # a restarted writer replays its first batch with freshly written files of the same
        # rows (what a re-run Spark batch does), then continues with a new batch
        writers[0].close()
        restarted = WriterClient(backend.writer("writer-0"), group_id, "writer-0")
        restarted.start()
        closers.append(restarted.close)
        replay = source.batch("writer-0", 0, ids=source.expected_ids_of("writer-0", 0))
        restarted.publish(0, replay.files, replay.positions)
        fresh = source.publish(restarted, m_cycles)
        wait_pending(coord, fresh.file_count, self.read_timeout_s)
        result = coord.commit_now()
        assert not result.failed
        for t in self.tables:
            assert len(group_snapshots(catalog, t, group_id)) == m_cycles + 1
            assert_exactly_once(catalog, t, source.expected[t])

    def test_crash_between_iceberg_commit_and_position_store_loses_and_duplicates_nothing(
        self,
        backend: Backend,
        other_backend: Backend,
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        source = RowSource.create(catalog, self.tables)
        writers = self.writer_clients(backend, group_id, closers, 2)
        doomed = self.coordinator(
            other_backend,
            catalog,
            group_id,
            closers,
            "c1",
            CoordinatorHooks(after_iceberg_commits=crash),
        )
        lead(doomed, self.read_timeout_s)
        first_token = doomed.lease.token if doomed.lease else -1
        files = sum(source.publish(w, seq).file_count for seq in range(2) for w in writers)
        wait_pending(doomed, files, self.read_timeout_s)
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()
        # the tables have the rows; the channel position was never stored
        for t in self.tables:
            assert_exactly_once(catalog, t, source.expected[t])
        doomed.channel.simulate_crash()

        heir = self.coordinator(other_backend, catalog, group_id, closers, "c2")
        lead(heir, self.read_timeout_s * 2)
        assert heir.lease is not None
        assert heir.lease.token > first_token
        result = heir.commit_now()
        assert not result.failed
        assert all(r.snapshot_id is None for r in result.tables), "re-committed a table"
        for t in self.tables:
            assert len(group_snapshots(catalog, t, group_id)) == 1
            assert_exactly_once(catalog, t, source.expected[t])
        files = sum(source.publish(w, 2).file_count for w in writers)
        wait_pending(heir, files, self.read_timeout_s)
        assert not heir.commit_now().failed
        for t in self.tables:
            assert_exactly_once(catalog, t, source.expected[t])

    def test_stale_leader_cannot_commit_after_takeover(
        self,
        backend: Backend,
        other_backend: Backend,
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        source = RowSource.create(catalog, self.tables)
        (writer,) = self.writer_clients(backend, group_id, closers, 1)
        zombie = self.coordinator(other_backend, catalog, group_id, closers, "c1")
        lead(zombie, self.read_timeout_s)
        files = source.publish(writer, 0).file_count
        wait_pending(zombie, files, self.read_timeout_s)
        # the zombie pauses (stops renewing) while holding pending files; its lease expires
        heir = self.coordinator(other_backend, catalog, group_id, closers, "c2")
        lead(heir, self.read_timeout_s * 2)
        wait_pending(heir, files, self.read_timeout_s)
        assert not heir.commit_now().failed
        # the zombie wakes up and tries to commit what it read
        with pytest.raises(NotLeaderError):
            zombie.commit_now()
        assert not zombie.is_leader
        for t in self.tables:
            assert len(group_snapshots(catalog, t, group_id)) == 1
            assert_exactly_once(catalog, t, source.expected[t])

    #: how long ``icefloe drain`` may take in :meth:`test_drain_commits_what_is_left_and_ends`
    drain_timeout_s: ClassVar[float] = 90.0

    def test_drain_commits_what_is_left_and_ends(
        self,
        catalog: SqlCatalog,
        backend: Backend,
        other_backend: Backend,
        closers: list[Callable[[], None]],
        group_id: str,
    ) -> None:
        """``icefloe drain`` (writers stopped) commits the batches left in the channel once,
        marks the tables and ends, whatever the channel carries besides writer events (its own
        broadcasts and transaction markers, on Kafka's control topic)."""
        source = RowSource.create(catalog, self.tables)
        (writer,) = self.writer_clients(backend, group_id, closers, 1)
        first = self.coordinator(other_backend, catalog, group_id, closers, "c1")
        lead(first, self.read_timeout_s)
        wait_pending(first, source.publish(writer, 0).file_count, self.read_timeout_s)
        assert not first.commit_now().failed
        left = sum(source.publish(writer, seq).file_count for seq in (1, 2))
        wait_pending(first, left, self.read_timeout_s)  # read, never committed
        writer.close()
        first.close()

        # the pipeline's own cadence (cycles due every half second, as in a real config)
        cadence = dataclasses.replace(self.settings(), commit_interval_s=0.5)
        drainer = self.coordinator(
            other_backend, catalog, group_id, closers, "drain", settings=cadence
        )
        result = drain(
            drainer, IcebergCommitter(catalog, group_id), self.tables, self.drain_timeout_s, 0.5
        )
        channel_id = drainer.channel.channel_id()
        assert result.channel_id == channel_id
        assert sorted(result.marked) == sorted(self.tables)
        for t in self.tables:
            assert_exactly_once(catalog, t, source.expected[t])
            props = catalog.load_table(t).metadata.properties
            assert props.get(drained_property(group_id)) == channel_id

    # ------------------------------------------------------------------ channel identity

    @rule("Identity")
    def test_channel_id_is_one_per_storage_and_stable(
        self,
        backend_factory: BackendFactory,
        backend: Backend,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """Every process reaching the same storage sees the same identity, before and after
        events were published; it names the backend."""
        first, _ = self.leader(backend, channels, "c1")
        before = first.channel_id()
        assert before
        assert ":" in before, f"channel id {before!r} should start with the backend's name"
        self.publish_batches(backend, group_id, channels, 2)
        other = backend_factory(group_id, self.lease_ttl_s)
        try:
            second = other.coordinator("c2")
            channels.append(second)
            assert second.channel_id() == before
        finally:
            other.close()
        assert first.channel_id() == before

    @rule("End position")
    def test_end_position_is_past_every_event_read(
        self,
        backend: Backend,
        group_id: str,
        channels: list[WriterChannel | CoordinatorChannel],
    ) -> None:
        """``end_position`` is the reset detector's yardstick: positions a reader reaches
        (and tables record) never lie beyond it."""
        batches = self.publish_batches(backend, group_id, channels, 3)
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        recs = self.read_until(coord, group_id, self.has_events(event_ids(batches)))
        end = coord.end_position()
        for partition, offset in position_after(recs).items():
            assert end.get(partition, 0) >= offset, (
                f"end {dict(end)} is behind {partition}@{offset}"
            )
