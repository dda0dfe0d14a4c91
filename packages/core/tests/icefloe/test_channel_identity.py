"""Channel identity: positions recorded through one channel never decide what is committed
for another, a switch needs a drained old channel, and a channel that lost events is refused.

Real SQLite catalog and Parquet files; the reference channel stands in for "a backend" (the
per-backend identity and reset tests live with each backend). Rows are counted by scanning
the table with pyiceberg (``assert_exactly_once``), not through the committer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import CoordinatorChannel
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.summary import drained_property
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ChannelChangedError, ChannelResetError
from icefloe.events import SourcePosition
from icefloe.ops.drain import DrainResult, drain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import assert_exactly_once, create_rows_table, write_rows
from icefloe.testing.harness import RowSource, drive, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryCoordinatorChannel, MemoryServer

GROUP = "pipe"
TABLE = "ns.t"
SETTINGS = CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=5.0)


class _BeforeIdentities(MemoryBackend):
    """The reference channel as a backend of contract 1 left it in the tables: summaries
    without ``icefloe.channel-id`` (what a core before channel identities recorded)."""

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        class Unnamed(MemoryCoordinatorChannel):
            def channel_id(self) -> str:
                return None  # type: ignore[return-value]

        return Unnamed(self.server, self.group_id, coordinator_id, self.lease_ttl_s)


class Pipeline:
    """One pipeline's writer and coordinator on one channel (a MemoryServer)."""

    def __init__(
        self,
        server: MemoryServer,
        catalog: SqlCatalog,
        name: str,
        backend: type[MemoryBackend] = MemoryBackend,
    ) -> None:
        self.backend = backend(server, GROUP, lease_ttl_s=5.0)
        self.writer = WriterClient(self.backend.writer("w"), GROUP, "w")
        self.writer.start()
        self.coordinator = Coordinator(
            GROUP,
            self.backend.coordinator(name),
            catalog,
            SETTINGS,
            coordinator_id=name,
            plugins=new_plugins(autoload=False),
        )

    def close(self) -> None:
        self.writer.close()
        self.coordinator.close()


@pytest.fixture
def source(sqlite_catalog: SqlCatalog) -> RowSource:
    return RowSource.create(sqlite_catalog, [TABLE])


@pytest.fixture
def closers() -> Iterator[list[Pipeline]]:
    todo: list[Pipeline] = []
    yield todo
    for p in todo:
        p.close()


def run_on(
    server: MemoryServer,
    catalog: SqlCatalog,
    closers: list[Pipeline],
    backend: type[MemoryBackend] = MemoryBackend,
) -> Pipeline:
    p = Pipeline(server, catalog, f"c{len(closers)}", backend)
    closers.append(p)
    return p


def drain_server(
    server: MemoryServer, catalog: SqlCatalog, settings: CoordinatorSettings = SETTINGS
) -> DrainResult:
    """What `icefloe drain` does, against the reference channel."""
    drainer = Coordinator(
        GROUP,
        MemoryBackend(server, GROUP, 5.0).coordinator("drain"),
        catalog,
        settings,
        plugins=new_plugins(autoload=False),
    )
    try:
        return drain(drainer, IcebergCommitter(catalog, GROUP), [TABLE], 60.0, 0.3)
    finally:
        drainer.close()


def commit_batches(p: Pipeline, source: RowSource, seqs: range) -> None:
    lead(p.coordinator, 10)
    for seq in seqs:
        source.publish(p.writer, seq)
    wait_pending(p.coordinator, len(seqs), 10)
    assert not p.coordinator.commit_now().failed


def commit_then_drain(
    server: MemoryServer,
    catalog: SqlCatalog,
    source: RowSource,
    closers: list[Pipeline],
    seqs: range,
) -> None:
    """Commit ``seqs`` through ``server``, stop that pipeline and drain the channel."""
    p = run_on(server, catalog, closers)
    commit_batches(p, source, seqs)
    p.close()
    closers.remove(p)
    drain_server(server, catalog)


def test_swap_after_drain_commits_every_row_exactly_once(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """The new channel numbers events from 0 again, below the positions the table recorded
    through the old one: its files must still be committed, once."""
    old_server = MemoryServer()
    old = run_on(old_server, sqlite_catalog, closers)
    commit_batches(old, source, range(4))
    source.publish(old.writer, 4)  # published, not committed when the pipeline stops
    old.close()
    closers.remove(old)

    result = drain_server(old_server, sqlite_catalog)
    assert result.marked == (TABLE,)
    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])

    new = run_on(MemoryServer(), sqlite_catalog, closers)
    # Spark replays its last batch after a restart: batch 4 again, with new files
    replay = source.batch("w", 4, ids=source.expected_ids_of("w", 4))
    new.writer.publish(4, replay.files, replay.positions)
    source.publish(new.writer, 5)
    source.publish(new.writer, 6)
    lead(new.coordinator, 10)
    wait_pending(new.coordinator, 2, 10)
    assert not new.coordinator.commit_now().failed
    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])
    state = IcebergCommitter(sqlite_catalog, GROUP).state(TABLE)
    assert state is not None
    assert state.boundary.channel_id == new.coordinator.channel.channel_id()


def test_after_a_swap_a_refused_file_is_quarantined_not_retried_forever(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """Found by the commit-path simulation (test_simulation.py). The new channel numbers events
    below the positions the table recorded through the old one, so screening must judge
    "already committed" through the new channel as the commit does: else a file the table
    refuses passes screening as covered, the commit then refuses the whole request, and the
    table fails every cycle with its good files held back, never quarantining the bad one."""
    commit_then_drain(MemoryServer(), sqlite_catalog, source, closers, range(3))
    new = run_on(MemoryServer(), sqlite_catalog, closers)
    create_rows_table(sqlite_catalog, "ns.elsewhere")
    misplaced = write_rows(sqlite_catalog.load_table("ns.elsewhere"), [900, 901], "w", 3)
    new.writer.publish(3, {TABLE: misplaced}, [SourcePosition("source", 0, 100, None)])
    source.publish(new.writer, 4)
    lead(new.coordinator, 10)
    wait_pending(new.coordinator, 2, 10)
    result = new.coordinator.commit_now()
    assert dict(result.failed) == {}
    assert dict(result.quarantined) == {TABLE: 1}
    entries = Quarantine(sqlite_catalog).list(GROUP, TABLE)
    assert [(e.file_path, e.error_type) for e in entries] == [
        (misplaced[0].path, "FileOutsideTableError")
    ]
    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])


def test_swap_without_drain_is_refused_and_commits_nothing(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    old = run_on(MemoryServer(), sqlite_catalog, closers)
    commit_batches(old, source, range(2))
    committed = list(source.expected[TABLE])
    old_id = old.coordinator.channel.channel_id()
    source.publish(old.writer, 2)  # stranded in the old channel
    old.close()
    closers.remove(old)

    new = run_on(MemoryServer(), sqlite_catalog, closers)
    source.publish(new.writer, 3)
    with pytest.raises(ChannelChangedError, match="icefloe drain") as refused:
        drive(new.coordinator, lambda: False, "the refusal", 10)
    assert old_id in str(refused.value)
    assert drained_property(GROUP) in str(refused.value)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_rolled_back_channel_is_refused(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """Same identity (a restored backup), fewer events than the table saw: new events would be
    numbered below the recorded positions and dropped as committed. Stop instead."""
    server = MemoryServer()
    first = run_on(server, sqlite_catalog, closers)
    commit_batches(first, source, range(3))
    committed = list(source.expected[TABLE])
    first.close()
    closers.remove(first)

    restored = run_on(MemoryServer(identity=server.identity()), sqlite_catalog, closers)
    source.publish(restored.writer, 3)
    with pytest.raises(ChannelResetError, match="reset or rolled back"):
        drive(restored.coordinator, lambda: False, "the refusal", 10)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_drain_mark_is_cleared_once_the_drained_channel_commits_again(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """Drained, then used again (e.g. the lost-checkpoint procedure): a later switch away from
    it must need a new drain, or batches published since would be stranded."""
    server = MemoryServer()
    commit_then_drain(server, sqlite_catalog, source, closers, range(1))
    again = run_on(server, sqlite_catalog, closers)
    commit_batches(again, source, range(1, 2))
    props = sqlite_catalog.load_table(TABLE).metadata.properties
    assert drained_property(GROUP) not in props
    source.publish(again.writer, 2)  # stranded if the switch were allowed
    committed = source.expected[TABLE][:-5]
    again.close()
    closers.remove(again)

    new = run_on(MemoryServer(), sqlite_catalog, closers)
    source.publish(new.writer, 3)
    with pytest.raises(ChannelChangedError):
        drive(new.coordinator, lambda: False, "the refusal", 10)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_drain_under_the_memory_bound_commits_every_batch_before_marking(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """With ``max_pending_files`` below what the channel holds, the reader holds events back
    until a cycle commits; the drain must not take "nothing new was read" for "drained" while
    events wait in that queue (they would be stranded behind the mark)."""
    server = MemoryServer()
    old = run_on(server, sqlite_catalog, closers)
    for seq in range(4):
        source.publish(old.writer, seq)  # never committed by the pipeline
    old.close()
    closers.remove(old)

    bounded = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=5.0, max_pending_files=1
    )
    result = drain_server(server, sqlite_catalog, bounded)
    assert result.marked == (TABLE,)
    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])
    assert result.cycles >= 4  # one batch per cycle under the bound


def _committed_before_identities(
    server: MemoryServer, catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> list[int]:
    """Batches 0-2 committed by a core that recorded no channel id; batch 3 published, not
    committed, when the pipeline stops. Returns the committed ids."""
    old = run_on(server, catalog, closers, _BeforeIdentities)
    commit_batches(old, source, range(3))
    state = IcebergCommitter(catalog, GROUP).state(TABLE)
    assert state is not None
    assert state.boundary.channel_id is None
    committed = list(source.expected[TABLE])
    source.publish(old.writer, 3)
    old.close()
    closers.remove(old)
    return committed


def test_a_table_committed_before_channel_ids_is_adopted_by_the_channel_that_reads_it(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """docs/backend-authors.md ("Tables committed before a backend had ids"): positions
    without an identity are taken to belong to the channel that reads them, and the first
    commit records its id. An upgrade in place (same store) loses and repeats nothing."""
    server = MemoryServer()
    _committed_before_identities(server, sqlite_catalog, source, closers)
    upgraded = run_on(server, sqlite_catalog, closers)
    lead(upgraded.coordinator, 10)
    wait_pending(upgraded.coordinator, 1, 10)  # batch 3; batches 0-2 are recognised
    assert not upgraded.coordinator.commit_now().failed
    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])
    state = IcebergCommitter(sqlite_catalog, GROUP).state(TABLE)
    assert state is not None
    assert state.boundary.channel_id == f"memory:{server.identity()}"


def test_a_table_committed_before_channel_ids_refuses_a_store_that_lost_its_events(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """The same adoption on a store recreated during the upgrade: its log ends before the
    recorded positions, so the coordinator stops (it cannot tell the new events from the
    committed ones). A store numbering offsets from the clock never gets here silently."""
    server = MemoryServer()
    committed = _committed_before_identities(server, sqlite_catalog, source, closers)
    server.recreate()  # batch 3 is lost with it
    upgraded = run_on(server, sqlite_catalog, closers)
    source.publish(upgraded.writer, 4)  # numbered from 0 again, below the recorded positions
    with pytest.raises(ChannelResetError, match="reset or rolled back"):
        drive(upgraded.coordinator, lambda: False, "the refusal", 10)
    assert_exactly_once(sqlite_catalog, TABLE, committed)


def test_after_a_swap_a_replay_of_a_quarantined_batch_stays_out_of_the_table(
    sqlite_catalog: SqlCatalog, source: RowSource, closers: list[Pipeline]
) -> None:
    """Found by the commit-path simulation (test_simulation.py, seed 23003). A batch whose
    file was quarantined (it lies outside the table) is decided: its records are in the
    quarantine. Spark replays the batch after a restart, the same records in new files under
    the same batch number; the old channel would refuse it, the new one never saw it, and no
    watermark covers a batch nothing of which was committed: it must not be committed too."""
    old_server = MemoryServer()
    old = run_on(old_server, sqlite_catalog, closers)
    lead(old.coordinator, 10)
    create_rows_table(sqlite_catalog, "ns.elsewhere")
    misplaced = write_rows(sqlite_catalog.load_table("ns.elsewhere"), [900, 901], "w", 0)
    old.writer.publish(0, {TABLE: misplaced}, [SourcePosition("source", 0, 1, None)])
    wait_pending(old.coordinator, 1, 10)
    assert dict(old.coordinator.commit_now().quarantined) == {TABLE: 1}
    old.close()
    closers.remove(old)
    drain_server(old_server, sqlite_catalog)

    new = run_on(MemoryServer(), sqlite_catalog, closers)
    replay = write_rows(sqlite_catalog.load_table(TABLE), [900, 901], "w", 0)
    new.writer.publish(0, {TABLE: replay}, [SourcePosition("source", 0, 1, None)])
    source.publish(new.writer, 1)
    lead(new.coordinator, 10)
    wait_pending(new.coordinator, 1, 10)
    assert not new.coordinator.commit_now().failed

    assert_exactly_once(sqlite_catalog, TABLE, source.expected[TABLE])
    entries = Quarantine(sqlite_catalog).list(GROUP, TABLE)
    assert [e.file_path for e in entries] == [misplaced[0].path]
