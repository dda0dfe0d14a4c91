"""The backend conformance suite: what every coordination backend must pass against its real
server.

How a backend author uses it (the built-in Kafka, PostgreSQL and Redis backends do exactly
this; see ``docs/backend-authors.md``)::

    # packages/my-backend/tests/my_backend/test_conformance.py
    import pytest
    from icefloe.testing.conformance import BackendConformance, BackendFactory

    class TestMyBackendConformance(BackendConformance):
        @pytest.fixture
        def backend_factory(self, my_server) -> BackendFactory:
            # (group_id, lease_ttl_s) -> a NEW Backend connected to the same real server
            return lambda group_id, ttl: MyBackend(my_server.url, group_id, lease_ttl_s=ttl)

        # optional: make a coordinator channel look dead (default: abandon it, lease expires)
        def kill_coordinator_channel(self, channel) -> None:
            channel._connection.close()

Every test uses a fresh random ``group_id``, so tests never see each other's events, leases or
positions even on a shared server. Lease TTLs are short (:attr:`lease_ttl_s`) and every wait
polls with a deadline (:attr:`read_timeout_s`), so no test depends on timing.

What is checked:

* channel contract: epochs grow and fence older writer instances (a fenced publish adds
  nothing); a batch's events are all visible, in publish order, contiguous for the writer;
  re-publishing a batch key is a no-op or yields exact duplicates (the coordinator drops them);
  positions grow and a seek to a stored position resumes exactly after it; one leader at a
  time with a fencing token that grows across takeovers; lease takeover after the leader dies;
  broadcasts reach writers opened before them; store/stored position; prune;
* the coordinator end to end with a real Iceberg catalog (SQLite ``SqlCatalog`` in
  ``tmp_path``) and real Parquet files: N writers x M cycles give exactly M snapshots per table
  and every row once; a replayed batch adds no rows; a coordinator crash between the Iceberg
  commit and the position store loses and duplicates nothing; a stale leader cannot commit
  after a takeover.

Threading note for backends: :class:`icefloe.writer.WriterClient` never calls one
``WriterChannel`` from two threads at once, and the coordinator uses its channel from one
thread, so channels need not be thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar

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
from icefloe.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.errors import NotLeaderError, WriterFencedError
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
from icefloe.plugins import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, group_snapshots, make_sqlite_catalog
from icefloe.testing.harness import RowSource, SimulatedCrash, crash, lead, wait_pending
from icefloe.writer import WriterClient

#: (group_id, lease_ttl_s) -> a new Backend on the shared real server.
BackendFactory = Callable[[str, float], Backend]


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

    def kill_coordinator_channel(self, channel: CoordinatorChannel) -> None:
        """Make a coordinator channel look like its process died (no release). The default
        abandons it: the lease expires after its TTL. Override to cut connections."""

    # ------------------------------------------------------------------ shared fixtures

    @pytest.fixture
    def group_id(self) -> str:
        return f"conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def backend(self, backend_factory: BackendFactory, group_id: str) -> Iterator[Backend]:
        b = backend_factory(group_id, self.lease_ttl_s)
        try:
            yield b
        finally:
            b.close()

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
                pytest.fail(f"timed out after {self.read_timeout_s}s; got {got}")
            got.extend(channel.poll_broadcasts(0.2))
        return got

    @staticmethod
    def has_events(ids: set[str]) -> Callable[[list[ChannelRecord]], bool]:
        return lambda recs: ids <= {r.event.event_id for r in recs}

    # ------------------------------------------------------------------ channel contract

    def test_open_fences_older_instances_with_growing_epochs(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        _, r1 = self.writer(backend, channels, "w")
        _, r2 = self.writer(backend, channels, "w")
        _, r3 = self.writer(backend, channels, "w")
        assert r1.epoch < r2.epoch < r3.epoch

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

    def test_lease_takeover_after_leader_dies(
        self, backend: Backend, channels: list[WriterChannel | CoordinatorChannel]
    ) -> None:
        c1, l1 = self.leader(backend, channels, "c1")
        self.kill_coordinator_channel(c1)
        c2 = backend.coordinator("c2")
        channels.append(c2)
        l2 = c2.acquire(self.read_timeout_s)
        assert l2 is not None, "no takeover after the leader died"
        assert l2.token > l1.token

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
    ) -> Coordinator:
        c = Coordinator(
            group_id,
            backend.coordinator(name),
            catalog,
            self.settings(),
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
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        n_writers, m_cycles = 3, 3
        source = RowSource.create(catalog, self.tables)
        writers = self.writer_clients(backend, group_id, closers, n_writers)
        coord = self.coordinator(backend, catalog, group_id, closers, "c1")
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
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        source = RowSource.create(catalog, self.tables)
        writers = self.writer_clients(backend, group_id, closers, 2)
        doomed = self.coordinator(
            backend, catalog, group_id, closers, "c1", CoordinatorHooks(after_iceberg_commits=crash)
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
        self.kill_coordinator_channel(doomed.channel)

        heir = self.coordinator(backend, catalog, group_id, closers, "c2")
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
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> None:
        source = RowSource.create(catalog, self.tables)
        (writer,) = self.writer_clients(backend, group_id, closers, 1)
        zombie = self.coordinator(backend, catalog, group_id, closers, "c1")
        lead(zombie, self.read_timeout_s)
        files = source.publish(writer, 0).file_count
        wait_pending(zombie, files, self.read_timeout_s)
        # the zombie pauses (stops renewing) while holding pending files; its lease expires
        heir = self.coordinator(backend, catalog, group_id, closers, "c2")
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

    # ------------------------------------------------------------------ channel identity

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
