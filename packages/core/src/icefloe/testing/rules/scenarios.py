"""The coordinator end to end on the backend, with a real Iceberg catalog (SQLite ``SqlCatalog``
in ``tmp_path``) and real Parquet files, the coordinators on another Backend object than the
writers (as in production): every row once over many cycles and a replay, a crash between the
Iceberg commit and the position store, a stale leader after a takeover, ``icefloe drain``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import Backend
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.summary import drained_property
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import NotLeaderError
from icefloe.ops.drain import drain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, group_snapshots
from icefloe.testing.harness import RowSource, SimulatedCrash, crash, lead, wait_pending
from icefloe.testing.rules.support import SuiteBase, rule


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One pipeline of a scenario: writer clients on ``backend``, coordinators on
    ``other_backend``, the suite's tables in ``catalog`` fed with the rows of ``source``;
    what it starts is closed at teardown (``closers``)."""

    suite: CoordinatorScenarios
    group_id: str
    backend: Backend
    other_backend: Backend
    catalog: SqlCatalog
    closers: list[Callable[[], None]]
    source: RowSource

    def writers(self, n: int) -> list[WriterClient]:
        return self.suite.writer_clients(self.backend, self.group_id, self.closers, n)

    def coordinator(
        self,
        name: str,
        hooks: CoordinatorHooks | None = None,
        settings: CoordinatorSettings | None = None,
    ) -> Coordinator:
        return self.suite.coordinator(
            self.other_backend, self.catalog, self.group_id, self.closers, name, hooks, settings
        )

    def assert_tables(self, snapshots: int | None = None) -> None:
        """Every table has each row of ``source`` exactly once and, when given, ``snapshots``
        snapshots of this pipeline."""
        for t in self.suite.tables:
            if snapshots is not None:
                assert len(group_snapshots(self.catalog, t, self.group_id)) == snapshots
            assert_exactly_once(self.catalog, t, self.source.expected[t])


class CoordinatorScenarios(SuiteBase):
    """The coordinator's guarantees (every row once, no commit by a stale leader) on top of
    the channel rules."""

    tables: ClassVar[tuple[str, ...]] = ("conformance.orders", "conformance.events")
    #: how long ``icefloe drain`` may take in :meth:`test_drain_commits_what_is_left_and_ends`
    drain_timeout_s: ClassVar[float] = 90.0

    @pytest.fixture
    def closers(self) -> Iterator[list[Callable[[], None]]]:
        """Writer clients and coordinators to close at teardown, newest first."""
        todo: list[Callable[[], None]] = []
        yield todo
        for close in reversed(todo):
            with contextlib.suppress(Exception):
                close()

    @pytest.fixture
    def scenario(
        self,
        backend: Backend,
        other_backend: Backend,
        catalog: SqlCatalog,
        group_id: str,
        closers: list[Callable[[], None]],
    ) -> Scenario:
        source = RowSource.create(catalog, self.tables)
        return Scenario(self, group_id, backend, other_backend, catalog, closers, source)

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

    @rule(None)  # rests on every rule: skipped when something it needs is missing
    def test_n_writers_m_cycles_commit_every_row_exactly_once(self, scenario: Scenario) -> None:
        n_writers, m_cycles = 3, 3
        source = scenario.source
        writers = scenario.writers(n_writers)
        coord = scenario.coordinator("c1")
        lead(coord, self.read_timeout_s)
        for cycle in range(m_cycles):
            files = sum(source.publish(w, cycle).file_count for w in writers)
            wait_pending(coord, files, self.read_timeout_s)
            result = coord.commit_now()
            assert result.complete, "every writer answers StartCommit"
            assert result.valid_through_ms is not None
            assert not result.failed
            assert {r.table for r in result.tables if r.snapshot_id is not None} == set(self.tables)
        scenario.assert_tables(snapshots=m_cycles)

        # a restarted writer replays its first batch with freshly written files of the same
        # rows (what a re-run Spark batch does), then continues with a new batch
        writers[0].close()
        restarted = WriterClient(scenario.backend.writer("writer-0"), scenario.group_id, "writer-0")
        restarted.start()
        scenario.closers.append(restarted.close)
        replay = source.batch("writer-0", 0, ids=source.expected_ids_of("writer-0", 0))
        restarted.publish(0, replay.files, replay.positions)
        fresh = source.publish(restarted, m_cycles)
        wait_pending(coord, fresh.file_count, self.read_timeout_s)
        result = coord.commit_now()
        assert not result.failed
        scenario.assert_tables(snapshots=m_cycles + 1)

    @rule(None)  # rests on every rule: skipped when something it needs is missing
    def test_parallel_commit_threads_commit_every_row_exactly_once(
        self, scenario: Scenario
    ) -> None:
        """``coordination.commit_parallelism``: the tables of a cycle committed by threads,
        each renewing the lease on this backend's channel before its catalog commit (from
        threads other than the channel's creator, one at a time)."""
        writers = scenario.writers(2)
        settings = dataclasses.replace(self.settings(), commit_parallelism=len(self.tables))
        coord = scenario.coordinator("c1", settings=settings)
        lead(coord, self.read_timeout_s)
        for cycle in range(2):
            files = sum(scenario.source.publish(w, cycle).file_count for w in writers)
            wait_pending(coord, files, self.read_timeout_s)
            result = coord.commit_now()
            assert not result.failed
            assert {r.table for r in result.tables if r.snapshot_id is not None} == set(self.tables)
        scenario.assert_tables(snapshots=2)

    @rule(None)  # rests on every rule: skipped when something it needs is missing
    def test_crash_between_iceberg_commit_and_position_store_loses_and_duplicates_nothing(
        self, scenario: Scenario
    ) -> None:
        source = scenario.source
        writers = scenario.writers(2)
        doomed = scenario.coordinator("c1", CoordinatorHooks(after_iceberg_commits=crash))
        lead(doomed, self.read_timeout_s)
        first_token = doomed.lease.token if doomed.lease else -1
        files = sum(source.publish(w, seq).file_count for seq in range(2) for w in writers)
        wait_pending(doomed, files, self.read_timeout_s)
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()
        # the tables have the rows; the channel position was never stored
        scenario.assert_tables()
        doomed.channel.simulate_crash()

        heir = scenario.coordinator("c2")
        lead(heir, self.read_timeout_s * 2)
        assert heir.lease is not None
        assert heir.lease.token > first_token
        result = heir.commit_now()
        assert not result.failed
        assert all(r.snapshot_id is None for r in result.tables), "re-committed a table"
        scenario.assert_tables(snapshots=1)
        files = sum(source.publish(w, 2).file_count for w in writers)
        wait_pending(heir, files, self.read_timeout_s)
        assert not heir.commit_now().failed
        scenario.assert_tables()

    @rule(None)  # rests on every rule: skipped when something it needs is missing
    def test_stale_leader_cannot_commit_after_takeover(self, scenario: Scenario) -> None:
        (writer,) = scenario.writers(1)
        zombie = scenario.coordinator("c1")
        lead(zombie, self.read_timeout_s)
        files = scenario.source.publish(writer, 0).file_count
        wait_pending(zombie, files, self.read_timeout_s)
        # the zombie pauses (stops renewing) while holding pending files; its lease expires
        heir = scenario.coordinator("c2")
        lead(heir, self.read_timeout_s * 2)
        wait_pending(heir, files, self.read_timeout_s)
        assert not heir.commit_now().failed
        # the zombie wakes up and tries to commit what it read
        with pytest.raises(NotLeaderError):
            zombie.commit_now()
        assert not zombie.is_leader
        scenario.assert_tables(snapshots=1)

    @rule(None)  # rests on every rule: skipped when something it needs is missing
    def test_drain_commits_what_is_left_and_ends(self, scenario: Scenario) -> None:
        """``icefloe drain`` (writers stopped) commits the batches left in the channel once,
        marks the tables and ends, whatever the channel carries besides writer events (its own
        broadcasts and transaction markers, on Kafka's control topic)."""
        source, catalog, group_id = scenario.source, scenario.catalog, scenario.group_id
        (writer,) = scenario.writers(1)
        first = scenario.coordinator("c1")
        lead(first, self.read_timeout_s)
        wait_pending(first, source.publish(writer, 0).file_count, self.read_timeout_s)
        assert not first.commit_now().failed
        left = sum(source.publish(writer, seq).file_count for seq in (1, 2))
        wait_pending(first, left, self.read_timeout_s)  # read, never committed
        writer.close()
        first.close()

        # the pipeline's own cadence (cycles due every half second, as in a real config)
        cadence = dataclasses.replace(self.settings(), commit_interval_s=0.5)
        drainer = scenario.coordinator("drain", settings=cadence)
        result = drain(
            drainer, IcebergCommitter(catalog, group_id), self.tables, self.drain_timeout_s, 0.5
        )
        channel_id = drainer.channel.channel_id()
        assert result.channel_id == channel_id
        assert sorted(result.marked) == sorted(self.tables)
        scenario.assert_tables()
        for t in self.tables:
            props = catalog.load_table(t).metadata.properties
            assert props.get(drained_property(group_id)) == channel_id
