"""Coordinator scenarios on the reference channel with a real SQLite Iceberg catalog and real
Parquet files. The scenarios every backend shares live in the conformance suite (run here by
test_conformance_memory.py); these add the faults that need the reference channel's test
hooks: partial table failures, commit timeouts, a zombie racing a takeover, foreign and
corrupt events, and a coordinator process killed by SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import ChannelRecord, WriterBatch, WriterChannel
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.summary import FENCING_TOKEN_KEY, SOURCE_OFFSETS_KEY, VALID_THROUGH_KEY
from icefloe.config import CoordinationConfig, config_from_dict
from icefloe.coordination import cycle as cycle_module
from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ChannelError, CommitError, EventDecodeError, NotLeaderError
from icefloe.events import (
    CommitToTable,
    DataComplete,
    DataWritten,
    Event,
    SourcePosition,
    WriterRef,
    encode_event,
)
from icefloe.hookspecs import TableCommitted, hookimpl
from icefloe.ops.status import PipelineStatus, TableStatus, render_lines, table_status
from icefloe.plugins.manager import DISABLE_AUTOLOAD_ENV, Plugins, new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    catalog_warehouse,
    create_rows_table,
    group_snapshots,
    make_sqlite_catalog,
    postgres_catalog_properties,
    sqlite_catalog_properties,
    table_ids,
    write_rows,
)
from icefloe.testing.harness import (
    DoomedCoordinator,
    PipelineParts,
    RowSource,
    assert_rows_once,
    drive,
    heir_finds_every_commit,
    heir_of,
    kill_doomed_coordinator,
    lead,
    pipeline_on_disk,
    wait_pending,
)
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryCoordinatorChannel,
    MemoryServer,
    memory_backend_options,
    serve_memory_server,
)

__all__ = ["catalog_warehouse", "postgres_catalog_properties"]  # fixtures used here

TABLES = ("db.orders", "db.events")
TTL = 1.0


@pytest.fixture
def group_id() -> str:
    return f"pipe-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def backend(memory_server: MemoryServer, group_id: str) -> MemoryBackend:
    return MemoryBackend(memory_server, group_id, TTL)


@pytest.fixture
def source(sqlite_catalog: SqlCatalog) -> RowSource:
    return RowSource.create(sqlite_catalog, TABLES)


class _Recorder:
    """An after_table_commit plugin that remembers what it was told."""

    def __init__(self) -> None:
        self.events: list[TableCommitted] = []

    @hookimpl
    def icefloe_after_table_commit(self, event: TableCommitted) -> None:
        self.events.append(event)


@pytest.fixture
def recorder() -> _Recorder:
    return _Recorder()


@pytest.fixture
def plugins(recorder: _Recorder) -> Plugins:
    p = new_plugins(autoload=False)
    p.pm.register(recorder)
    return p


@pytest.fixture
def make(
    backend: MemoryBackend, sqlite_catalog: SqlCatalog, group_id: str, plugins: Plugins
) -> Iterator[PipelineParts]:
    f = PipelineParts(backend, sqlite_catalog, group_id, plugins)
    yield f
    f.close()


def test_settings_from_config() -> None:
    c = CoordinationConfig(
        commit_interval_s=3, commit_timeout_s=4, max_pending_files=5, writer_timeout_s=6, branch="b"
    )
    s = CoordinatorSettings.from_config(c)
    assert (s.commit_interval_s, s.commit_timeout_s, s.max_pending_files) == (3, 4, 5)
    assert (s.writer_timeout_s, s.branch, s.max_pending_bytes) == (6, "b", None)


def test_complete_cycle_records_vtts_and_notifies_plugins(
    make: PipelineParts, source: RowSource, group_id: str, recorder: _Recorder
) -> None:
    a, b = make.writer("a"), make.writer("b")
    coord = make.coordinator()
    lead(coord)
    files = source.publish(a, 0).file_count + source.publish(b, 0).file_count
    files += source.publish(a, 1).file_count
    wait_pending(coord, files)
    result = coord.commit_now()
    assert result.complete
    # per source partition the newest record time: a reached seq 1, b seq 0 -> min is b's
    assert result.valid_through_ms == 1_700_000_000_000
    for t in TABLES:
        (snap,) = group_snapshots(make.catalog, t, group_id)
        assert snap.summary is not None
        assert snap.summary[VALID_THROUGH_KEY] == str(result.valid_through_ms)
        assert coord.lease is not None
        assert snap.summary[FENCING_TOKEN_KEY] == str(coord.lease.token)
        assert_exactly_once(make.catalog, t, source.expected[t])
    assert sorted(e.table for e in recorder.events) == sorted(TABLES)
    assert sum(e.records for e in recorder.events) == sum(len(v) for v in source.expected.values())
    assert make.backend.server.stored_position(group_id) == coord.read_position


def test_idle_writer_answers_at_once_so_the_cycle_completes(
    make: PipelineParts, source: RowSource
) -> None:
    busy, idle = make.writer("busy"), make.writer("idle")
    never_published = make.writer("never-published")
    # a timeout far beyond the test's own: only answers can complete the cycle
    coord = make.coordinator(commit_timeout_s=3600.0)
    lead(coord)
    files = source.publish(busy, 0).file_count + source.publish(idle, 0).file_count
    wait_pending(coord, files)
    assert coord.commit_now().complete
    # its answer made 'never-published' known (and live): the next cycle expects it too
    drive(coord, lambda: "never-published" in coord.known_writers(), "its first answer")
    # second cycle: 'idle' publishes nothing but is live; it still answers
    wait_pending(coord, source.publish(busy, 1).file_count)
    result = coord.commit_now()
    assert result.complete
    assert result.valid_through_ms is not None
    assert {"busy", "idle", "never-published"} <= set(coord.known_writers())
    assert idle.answered >= 2
    assert never_published.answered >= 2
    assert_every_table_exact(make, source)


def test_commit_timeout_gives_partial_commit_and_late_files_go_to_the_next(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    answering = make.writer("answering")
    # a writer that publishes but never answers StartCommit (its responder is not running)
    silent = make.backend.writer("silent")
    ref = WriterRef("silent", silent.open())
    coord = make.coordinator(commit_timeout_s=0.5)
    lead(coord)

    def publish_silent(seq: int) -> int:
        return publish_unanswered(source, silent, ref, group_id, seq)

    files = source.publish(answering, 0).file_count + publish_silent(0)
    wait_pending(coord, files)
    first = coord.commit_now()
    assert not first.complete
    assert first.valid_through_ms is None
    for t in TABLES:
        (snap,) = group_snapshots(make.catalog, t, group_id)
        assert snap.summary is not None
        assert snap.summary[VALID_THROUGH_KEY] is None
        assert_exactly_once(make.catalog, t, source.expected[t])
    # the silent writer's late answer and its next batch arrive after the decision point
    silent.respond(Event(group_id, DataComplete((), first.commit_id), ref, 0))
    wait_pending(coord, publish_silent(1))
    second = coord.commit_now()
    assert not second.failed
    assert all(r.snapshot_id is not None for r in second.tables)
    for t in TABLES:
        assert len(group_snapshots(make.catalog, t, group_id)) == 2
        assert_exactly_once(make.catalog, t, source.expected[t])


def fail_once(failing: str) -> Callable[[str], None]:
    """A before_table_commit hook failing the first commit of table ``failing``."""
    failures: list[str] = []

    def hook(table: str) -> None:
        if table == failing and not failures:
            failures.append(table)
            raise CommitError("injected: catalog unavailable")

    return hook


def test_partial_table_failure_is_finished_later_without_duplicating_the_others(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    failing, healthy = TABLES[0], TABLES[1]
    w = make.writer("w")
    coord = make.coordinator(hooks=CoordinatorHooks(before_table_commit=fail_once(failing)))
    lead(coord)
    b0 = source.publish(w, 0)
    wait_pending(coord, b0.file_count)
    first = coord.commit_now()
    assert set(first.failed) == {failing}
    assert "injected" in first.failed[failing]
    assert [r.table for r in first.tables] == [healthy]
    # the position may advance only up to the failing table's pending event, not past it
    stored = make.backend.server.stored_position(group_id)
    assert stored is None or stored["0"] < coord.read_position["0"], "stored past a failure"
    assert_exactly_once(make.catalog, healthy, source.expected[healthy])
    assert group_snapshots(make.catalog, failing, group_id) == []
    assert coord.pending_files() == {failing: len(b0.files[failing])}

    # the coordinator dies before the next cycle (it never releases; its lease expires) and
    # its successor re-reads everything from the beginning
    heir = make.coordinator("c2")
    lead(heir)
    wait_pending(heir, source.publish(w, 1).file_count)
    second = heir.commit_now()
    assert not second.failed
    assert_every_table_exact(make, source)
    assert len(group_snapshots(make.catalog, healthy, group_id)) == 2
    assert len(group_snapshots(make.catalog, failing, group_id)) == 1
    assert make.backend.server.stored_position(group_id) == heir.read_position


def test_zombie_that_passed_its_lease_check_is_refused_by_the_table(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """The race of invariant 3: the leader renews its lease right before the catalog commit,
    then pauses; a new leader takes over and commits; the zombie resumes. The table's fencing
    token (or the changed metadata, then the token) must stop it."""
    w = make.writer("w")
    heirs: list[Coordinator] = []

    def pause_and_let_a_successor_commit(_: str) -> None:
        if not heirs:
            heirs.append(make.take_over(zombie))

    zombie = make.coordinator(
        "zombie", hooks=CoordinatorHooks(after_lease_check=pause_and_let_a_successor_commit)
    )
    lead(zombie)
    wait_pending(zombie, source.publish(w, 0).file_count)
    with pytest.raises(NotLeaderError):
        zombie.commit_now()
    assert not zombie.is_leader
    (heir,) = heirs
    assert heir.lease is not None
    for t in TABLES:
        (snap,) = group_snapshots(make.catalog, t, group_id)
        assert snap.summary is not None
        assert snap.summary[FENCING_TOKEN_KEY] == str(heir.lease.token)
        assert_exactly_once(make.catalog, t, source.expected[t])


def test_coordinator_process_killed_after_iceberg_commit_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    """A real SIGKILL of a coordinator process between the Iceberg commits and the position
    store; the channel state lives in a separate server process and survives."""
    group_id, props, catalog, source = pipeline_on_disk(tmp_path, TABLES)
    with serve_memory_server() as (server, address):
        backend = MemoryBackend(server, group_id, TTL)
        writers = [WriterClient(backend.writer(f"w{i}"), group_id, f"w{i}") for i in range(2)]
        for w in writers:
            w.start()
        try:
            files = sum(source.publish(w, seq).file_count for seq in range(2) for w in writers)
            spec = DoomedCoordinator(address, catalog.name, props, group_id, TTL, files)
            kill_doomed_coordinator(spec)
            # Iceberg has the rows; the channel never heard of it
            for t in TABLES:
                assert len(group_snapshots(catalog, t, group_id)) == 1
                assert_exactly_once(catalog, t, source.expected[t])
            assert server.stored_position(group_id) is None

            heir = heir_of(backend, catalog)
            try:
                heir_finds_every_commit(heir, server, group_id)
                wait_pending(heir, sum(source.publish(w, 2).file_count for w in writers))
                assert not heir.commit_now().failed
            finally:
                heir.close()
            for t in TABLES:
                assert len(group_snapshots(catalog, t, group_id)) == 2
                assert_exactly_once(catalog, t, source.expected[t])
        finally:
            for w in writers:
                w.close()


def test_run_loop_commits_on_interval_and_hands_over_on_stop(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    w = make.writer("w")
    first = make.coordinator("first", commit_interval_s=0.2)
    second = make.coordinator("second", commit_interval_s=0.2)
    stops = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=c.run, args=(s,), daemon=True)
        for c, s in zip((first, second), stops, strict=True)
    ]
    for th in threads:
        th.start()
    try:
        source.publish(w, 0)
        drive_until_rows(make.catalog, source)
        leader = 0 if first.is_leader else 1
        stops[leader].set()
        threads[leader].join(30)
        assert not threads[leader].is_alive()
        source.publish(w, 1)
        drive_until_rows(make.catalog, source)
        assert (second if leader == 0 else first).is_leader
    finally:
        for s in stops:
            s.set()
        for th in threads:
            th.join(30)
    assert_every_table_exact(make, source)


def assert_every_table_exact(make: PipelineParts, source: RowSource) -> None:
    """Every table holds each row the source published to it exactly once."""
    for t in TABLES:
        assert_exactly_once(make.catalog, t, source.expected[t])


def step_until_a_cycle(coord: Coordinator, failure: str, timeout: float = 30.0) -> None:
    """Step ``coord`` until one of its steps runs a commit cycle (triggers, not commit_now)."""
    deadline = time.monotonic() + timeout
    while coord.step(0.1) is None:
        assert time.monotonic() < deadline, failure


def publish_unanswered(
    source: RowSource, channel: WriterChannel, ref: WriterRef, group_id: str, seq: int
) -> int:
    """Publish batch ``seq`` of ``ref``'s rows on a bare writer channel (no responder, so
    it never answers StartCommit), count its rows as expected; return its file count."""
    b = source.batch(ref.writer_id, seq)
    events = [Event(group_id, DataWritten(t, tuple(fs)), ref, seq) for t, fs in b.files.items()]
    events.append(Event(group_id, DataComplete(tuple(b.positions)), ref, seq))
    assert channel.publish(WriterBatch(ref, seq, tuple(events)))
    for t, ids in b.ids.items():
        source.expected.setdefault(t, []).extend(ids)
    return b.file_count


def drive_until_rows(catalog: Catalog, source: RowSource, timeout: float = 30.0) -> None:
    """Wait (the coordinators run in threads) until every expected row is in every table."""
    deadline = time.monotonic() + timeout
    while any(len(table_ids(catalog, t)) < len(source.expected[t]) for t in TABLES):
        assert time.monotonic() < deadline, "rows did not arrive"
        time.sleep(0.1)


def test_size_trigger_starts_a_cycle_before_the_interval(
    make: PipelineParts, source: RowSource
) -> None:
    w = make.writer("w")
    coord = make.coordinator(max_pending_files=len(TABLES))
    lead(coord)
    source.publish(w, 0)
    step_until_a_cycle(coord, "no cycle started")
    assert_every_table_exact(make, source)


def test_idle_pipeline_commits_its_first_files_at_once_then_keeps_the_interval(
    make: PipelineParts, source: RowSource
) -> None:
    """``commit_when_idle``: with an hour's interval, the first batch after the start is
    committed by the next step; the batch after it waits for the interval (the pipeline is
    busy), and once an empty cycle has run the next batch goes at once again."""
    w = make.writer("w")
    coord = make.coordinator(commit_when_idle=True)
    lead(coord)
    source.publish(w, 0)
    step_until_a_cycle(coord, "the first files waited for the interval")
    assert_every_table_exact(make, source)
    source.publish(w, 1)
    drive(coord, lambda: len(coord.pending_files()) > 0, "the second batch")
    assert coord.step(0.1) is None, "a busy pipeline committed before its interval"
    assert not coord.commit_now().failed  # as the interval would
    assert_every_table_exact(make, source)
    assert not coord.commit_now().tables  # an empty cycle: idle again
    source.publish(w, 2)
    step_until_a_cycle(coord, "files after a quiet spell waited for the interval")
    assert_every_table_exact(make, source)


class _Clock:
    """The cycle's monotonic clock, moved forward by hand: a cycle that took a minute, with
    no minute spent (pure cadence logic, the coordinator and its channel real)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize(("count_from", "due"), [("start", True), ("end", False)])
def test_the_interval_counts_from_the_previous_cycles_start_or_end(
    make: PipelineParts,
    source: RowSource,
    monkeypatch: pytest.MonkeyPatch,
    count_from: str,
    due: bool,
) -> None:
    """``commit_interval_from``: a cycle that took 60 s of a 100 s interval, then 50 s
    more. From the start (Kafka Connect's ``commit.interval``) the next cycle is due, 110 s
    after the last one started; from the end it waits 50 s more."""
    clock = _Clock()
    monkeypatch.setattr(cycle_module, "time", clock)
    w = make.writer("w")

    def slow(_: CycleResult) -> None:
        clock.offset += 60.0

    coord = make.coordinator(
        hooks=CoordinatorHooks(after_iceberg_commits=slow),
        commit_interval_s=100.0,
        commit_interval_from=count_from,
    )
    lead(coord)
    source.publish(w, 0)
    drive(coord, lambda: len(coord.pending_files()) > 0, "the batch")
    assert coord.commit_now().tables
    clock.offset += 50.0
    assert (coord.step(0.1) is not None) is due
    clock.offset += 50.0  # 100 s after the end: due either way
    assert coord.step(0.1) is not None
    assert_every_table_exact(make, source)


def test_empty_cycle_makes_no_snapshot_but_stores_the_position(
    make: PipelineParts, group_id: str
) -> None:
    w = make.writer("w")
    coord = make.coordinator()
    lead(coord)
    w.publish(0, {}, [])  # a batch that wrote no files
    drive(coord, lambda: "w" in coord.known_writers(), "the empty batch")
    result = coord.commit_now()
    assert result.complete
    assert result.tables == ()
    stored = make.backend.server.stored_position(group_id)
    assert stored is not None
    assert stored == coord.read_position
    assert stored["0"] >= 2  # the batch and the writer's answer were read past


def test_foreign_duplicate_and_stale_events_are_ignored(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    server = make.backend.server
    table = TABLES[0]
    # the injected writer never answers StartCommit: keep the wait short
    coord = make.coordinator(commit_timeout_s=0.3)
    lead(coord)

    def inject(event: Event) -> None:
        server.inject(group_id, encode_event(event))

    first = source.batch("w", 0)
    replay = source.batch("w", 0, ids=first.ids)  # same key, other files
    other_pipeline = source.batch("x", 0)
    ref1, ref2 = WriterRef("w", 1), WriterRef("w", 2)
    inject(
        Event("another-pipeline", DataWritten(table, tuple(other_pipeline.files[table])), ref1, 0)
    )
    for copy in (first, replay):  # each copy whole, as published: DataWritten, DataComplete
        inject(Event(group_id, DataWritten(table, tuple(copy.files[table])), ref2, 0))
        inject(Event(group_id, DataComplete(()), ref2, 0))
    stale = source.batch("w", 1)
    inject(Event(group_id, DataWritten(table, tuple(stale.files[table])), ref1, 1))
    drive(coord, lambda: coord.read_position.get("0", 0) >= 6, "6 events read")
    assert coord.pending_files() == {table: len(first.files[table])}
    coord.commit_now()
    assert_exactly_once(make.catalog, table, first.ids[table])


def test_a_batch_is_pending_only_once_its_data_complete_is_read(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """A batch's files wait for its DataComplete (a poll may end inside a batch): a cycle in
    between neither commits them nor records a channel position that would make them look
    committed once they come. A batch cut short (the writer's next event is another batch:
    records of an aborted transaction a broker showed) is dropped, not committed."""
    table = TABLES[0]
    coord = make.coordinator(commit_timeout_s=0.3)
    lead(coord)
    ref = WriterRef("w", 1)

    def inject(payload: DataWritten | DataComplete, seq: int) -> None:
        make.backend.server.inject(group_id, encode_event(Event(group_id, payload, ref, seq)))

    waiting, cut, last = source.batch("w", 0), source.batch("w", 1), source.batch("w", 2)
    inject(DataWritten(table, tuple(waiting.files[table])), 0)
    other = source.publish(make.writer("v"), 0)  # a whole batch of another writer after it
    drive(coord, lambda: coord.read_position.get("0", 0) >= 3, "3 events read")
    assert coord.pending_files() == {t: len(fs) for t, fs in other.files.items()}
    assert not coord.commit_now().failed
    inject(DataComplete(()), 0)
    inject(DataWritten(table, tuple(cut.files[table])), 1)
    inject(DataWritten(table, tuple(last.files[table])), 2)
    inject(DataComplete(()), 2)
    drive(coord, lambda: coord.read_position.get("0", 0) >= 7, "7 events read")
    assert not coord.commit_now().failed
    kept = waiting.ids[table] + other.ids[table] + last.ids[table]
    assert_exactly_once(make.catalog, table, kept)


def test_undecodable_event_stops_the_coordinator(make: PipelineParts, group_id: str) -> None:
    coord = make.coordinator()
    lead(coord)
    make.backend.server.inject(group_id, b"IF\x01 definitely not an event")
    with pytest.raises(EventDecodeError):
        drive(coord, lambda: False, "the decode error")
    # a restarted coordinator stops at the same event instead of skipping it
    heir = make.coordinator("heir")
    with pytest.raises(EventDecodeError):
        drive(heir, lambda: False, "the decode error")


def test_commit_now_requires_leadership(make: PipelineParts) -> None:
    coord = make.coordinator()
    with pytest.raises(NotLeaderError):
        coord.commit_now()


_CLI_SCRIPT = """
import sys
from icefloe.plugins.manager import get_plugins
from icefloe.testing.memory import MemoryPlugin
get_plugins().pm.register(MemoryPlugin())
from icefloe.cli.main import main
sys.argv = ["icefloe", "coordinator", "--config", sys.argv[1], "--id", "standalone"]
main()
"""


def test_standalone_coordinator_command_commits_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`icefloe coordinator --config` in its own process, on a served reference channel."""
    group_id = f"pipe-{uuid.uuid4().hex[:8]}"
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    source = RowSource.create(catalog, TABLES)
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    with serve_memory_server() as (server, address):
        opts = memory_backend_options(address)
        config = tmp_path / "pipeline.toml"
        config.write_text(
            f'name = "{group_id}"\n'
            '[source]\ntopics = ["t"]\n'
            + "".join(f'[[tables]]\nname = "{t}"\n' for t in TABLES)
            + f'[catalog]\nname = "{catalog.name}"\n'
            f'[catalog.properties]\nuri = "{props["uri"]}"\nwarehouse = "{props["warehouse"]}"\n'
            '[coordination]\nbackend = "memory"\ncommit_interval_s = 0.3\nlease_ttl_s = 1.0\n'
            f'[coordination.memory]\nhost = "{opts["host"]}"\nport = {opts["port"]}\n'
            f'authkey = "{opts["authkey"]}"\n'
        )
        backend = MemoryBackend(server, group_id, TTL)
        writer = WriterClient(backend.writer("w"), group_id, "w")
        writer.start()
        env = {**os.environ, DISABLE_AUTOLOAD_ENV: "1"}
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLI_SCRIPT, str(config)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            source.publish(writer, 0)
            source.publish(writer, 1)
            drive_until_rows(catalog, source, timeout=120.0)  # a cold subprocess start
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            writer.close()
        assert proc.returncode == 0, err
        assert "commit " in err
        assert "coordinator standalone stopped" in err
        # it released the lease on the way out: another coordinator leads at once
        successor = backend.coordinator("successor")
        assert successor.acquire(0.1) is not None
        successor.close()
    for t in TABLES:
        assert_exactly_once(catalog, t, source.expected[t])


class _FlakyCoordinatorChannel(MemoryCoordinatorChannel):
    """Fails one poll after leading, as a dropped connection would."""

    failures = 1

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        if self.failures and self._token is not None:
            self.failures -= 1
            raise ChannelError("injected: connection reset")
        return super().poll(timeout, max_records)


def test_run_loop_survives_a_channel_error_and_starts_over(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    w = make.writer("w")
    channel = _FlakyCoordinatorChannel(make.backend.server, group_id, "flaky", TTL)
    coord = Coordinator(
        group_id,
        channel,
        make.catalog,
        CoordinatorSettings(commit_interval_s=0.2, commit_timeout_s=30.0),
        plugins=make.plugins,
    )
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    try:
        source.publish(w, 0)
        drive_until_rows(make.catalog, source)
    finally:
        stop.set()
        thread.join(30)
        coord.close()
    assert channel.failures == 0
    assert_every_table_exact(make, source)


@pytest.mark.timeout(120)  # without bounded recovery, lead() never returns
def test_recovery_ends_under_steady_publishing(make: PipelineParts, source: RowSource) -> None:
    """A writer that never pauses must not keep a new leader recovering forever."""
    data = make.writer("data")
    source.publish(data, 0)
    chatty = make.writer("chatty")
    stop = threading.Event()
    sent: list[int] = []

    def keep_publishing() -> None:
        # batches with no files: cheap, so the log never runs dry while the leader recovers
        while not stop.is_set():
            seq = len(sent)
            chatty.publish(seq, {}, [SourcePosition("chatter", 0, seq + 1, None)])
            sent.append(seq)

    thread = threading.Thread(target=keep_publishing, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30.0
        while len(sent) < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        coord = make.coordinator(commit_interval_s=0.5)
        lead(coord, timeout=60.0)  # never returns if recovery waits for the log to run dry
        assert stop.is_set() is False, "the writer must still be publishing"
        coord.commit_now()
    finally:
        stop.set()
        thread.join(timeout=30)
    assert_every_table_exact(make, source)


# --- issue 10 §2: one bad or obsolete control event never stops a table ------------------


def _fault_settings(**kw: Any) -> dict[str, Any]:
    """No backoff between attempts, so a test's cycles retry failing tables at once."""
    return {"table_retry_base_s": 0.0, "table_retry_max_s": 0.0, **kw}


def test_file_outside_the_table_is_quarantined_and_the_rest_committed(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    table, other = TABLES
    w = make.writer("w")
    coord = make.coordinator(**_fault_settings())
    lead(coord)
    good = source.batch("w", 0)
    # a file of the other table announced for ``table``: outside its location
    stray = write_rows(make.catalog.load_table(other), [999_001, 999_002], "w", 0)
    files = {t: list(fs) for t, fs in good.files.items()}
    files[table] = files[table] + stray
    w.publish(0, files, good.positions)
    for t, ids in good.ids.items():
        source.expected.setdefault(t, []).extend(ids)
    wait_pending(coord, good.file_count + len(stray))

    def counted() -> float:
        sample = REGISTRY.get_sample_value("icefloe_files_quarantined_total", {"table": table})
        return sample or 0.0

    before = counted()
    first = coord.commit_now()
    assert first.failed == {}
    assert first.quarantined == {table: len(stray)}
    assert coord.quarantined_files == len(stray)
    assert counted() == before + len(stray)
    entries = Quarantine(make.catalog).list(group_id)
    assert [(e.table_name, e.file_path, e.error_type) for e in entries] == [
        (table, f.path, "FileOutsideTableError") for f in stray
    ]
    assert [e.record_count for e in entries] == [f.record_count for f in stray]
    # the position advanced past the bad event: nothing blocks the table's later batches
    assert make.backend.server.stored_position(group_id) == coord.read_position
    wait_pending(coord, source.publish(w, 1).file_count)
    second = coord.commit_now()
    assert second.failed == {}
    assert second.quarantined == {}
    assert_every_table_exact(make, source)


def test_a_zombie_cannot_quarantine_after_its_heir_took_over(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """A leader deposed before it screened a table went on to quarantine a refused file of
    it: an entry its heir, which had read the quarantine already, never knew of (found by the
    simulation, seed 25004: the heir later committed that file too). The heir raises its
    fence in the quarantine before reading anything; the zombie's write is refused, ends its
    leadership and leaves no entry; the heir quarantines the file itself."""
    table, other = TABLES
    w = make.writer("w")
    heirs: list[Coordinator] = []

    def take_over_before_screening(_: str) -> None:
        if not heirs:
            heir = make.coordinator("heir", **_fault_settings())
            lead(heir)  # once the zombie's lease expired: recovered, the stray file pending
            heirs.append(heir)

    zombie = make.coordinator(
        "zombie", CoordinatorHooks(before_table_commit=take_over_before_screening)
    )
    lead(zombie)
    good = source.batch("w", 0)
    # a file of the other table announced for ``table``: outside its location, refused
    stray = write_rows(make.catalog.load_table(other), [999_001, 999_002], "w", 0)
    w.publish(0, {table: list(good.files[table]) + stray}, good.positions)
    wait_pending(zombie, len(good.files[table]) + len(stray))
    with pytest.raises(NotLeaderError):
        zombie.commit_now()
    assert not zombie.is_leader
    assert Quarantine(make.catalog).list(group_id) == []  # the zombie wrote nothing
    (heir,) = heirs
    result = heir.commit_now()
    assert result.failed == {}
    assert result.quarantined == {table: len(stray)}
    entries = Quarantine(make.catalog).list(group_id)
    assert sorted(e.file_path for e in entries) == sorted(f.path for f in stray)
    assert_exactly_once(make.catalog, table, good.ids[table])


def test_files_of_a_dropped_and_recreated_table_are_quarantined(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    table = TABLES[0]
    w = make.writer("w")
    coord = make.coordinator(**_fault_settings())
    lead(coord)
    old = source.batch("w", 0)
    old_uuid = str(make.catalog.load_table(table).metadata.table_uuid)
    w.publish(0, old.files, old.positions, table_uuids={table: old_uuid})
    for t in TABLES[1:]:
        source.expected.setdefault(t, []).extend(old.ids[t])
    make.catalog.drop_table(table)  # while the batch is in flight
    create_rows_table(make.catalog, table)
    new = source.batch("w", 1)
    new_uuid = str(make.catalog.load_table(table).metadata.table_uuid)
    w.publish(1, new.files, new.positions, table_uuids={table: new_uuid})
    for t, ids in new.ids.items():
        source.expected.setdefault(t, []).extend(ids)
    wait_pending(coord, old.file_count + new.file_count)

    result = coord.commit_now()
    assert result.failed == {}
    assert result.quarantined == {table: len(old.files[table])}
    entries = Quarantine(make.catalog).list(group_id, table)
    assert sorted(e.file_path for e in entries) == sorted(f.path for f in old.files[table])
    assert {e.error_type for e in entries} == {"TableMismatchError"}
    assert {e.table_uuid for e in entries} == {old_uuid}
    assert_every_table_exact(make, source)


def test_missing_table_backs_off_then_is_quarantined_and_the_others_keep_committing(
    make: PipelineParts, sqlite_catalog: SqlCatalog, group_id: str
) -> None:
    gone = "db.gone"
    source = RowSource.create(sqlite_catalog, (*TABLES, gone))
    w = make.writer("w")
    attempts = 3
    coord = make.coordinator(**_fault_settings(quarantine_after_failures=attempts))
    lead(coord)
    b0 = source.publish(w, 0)
    sqlite_catalog.drop_table(gone)  # missing for good from now on
    wait_pending(coord, b0.file_count)
    for n in range(1, attempts):
        result = coord.commit_now()
        assert set(result.failed) == {gone}
        assert "TableMissingError" in result.failed[gone]
        assert result.quarantined == {}
        assert coord.pending_files() == {gone: len(b0.files[gone])}, f"attempt {n}"
        # the others committed, and the position does not pass the missing table's event
        stored = make.backend.server.stored_position(group_id)
        assert stored is None or stored["0"] < coord.read_position["0"]
    last = coord.commit_now()
    assert last.quarantined == {gone: len(b0.files[gone])}
    assert coord.pending_files() == {}
    assert make.backend.server.stored_position(group_id) == coord.read_position
    entries = Quarantine(make.catalog).list(group_id, gone)
    assert sorted(e.file_path for e in entries) == sorted(f.path for f in b0.files[gone])
    assert {e.error_type for e in entries} == {"TableMissingError"}
    # the other tables' later batches commit as usual
    source.tables = list(TABLES)
    wait_pending(coord, source.publish(w, 1).file_count)
    coord.commit_now()
    assert_every_table_exact(make, source)


class _GremlinError(Exception):
    """An exception type nothing in icefloe expects (neither permanent nor a refusal)."""


def _gremlin(table: str) -> tuple[Callable[[str], None], list[bool]]:
    """A ``before_table_commit`` hook failing ``table``'s commits while ``broken[0]``."""
    broken = [True]

    def gremlin(t: str) -> None:
        if t == table and broken[0]:
            raise _GremlinError("the table's storage refuses writes")

    return gremlin, broken


def test_a_table_failing_quarantine_after_failures_times_in_a_row_is_loud(
    make: PipelineParts, source: RowSource, group_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the exception, the failure that reaches ``quarantine_after_failures`` in a row
    logs one ERROR naming the table and the error, sets ``icefloe_table_failing`` and shows in
    ``icefloe status``; the files stay pending (nothing lost) until the table commits again."""
    table, other = TABLES
    gremlin, broken = _gremlin(table)
    attempts = 3
    w = make.writer("w")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=gremlin),
        **_fault_settings(quarantine_after_failures=attempts),
    )
    config = config_from_dict(
        {
            "name": group_id,
            "source": {"topics": ["source"]},
            "tables": [{"name": table}, {"name": other}],
        }
    )
    lead(coord)
    b0 = source.publish(w, 0)
    wait_pending(coord, b0.file_count)
    started_ms = time.time() * 1000

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("icefloe_table_failing", {"table": table})

    def alarms() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.ERROR and "commits in a row" in r.getMessage()
        ]

    def status() -> TableStatus:
        return table_status(make.catalog, config, table, None, time.time() * 1000)

    with caplog.at_level(logging.INFO, logger="icefloe.coordinator"):
        for _ in range(attempts - 1):
            assert set(coord.commit_now().failed) == {table}
        assert alarms() == []
        assert gauge() in (None, 0.0)
        assert status().failing_commits is None
        third = coord.commit_now()
        assert set(third.failed) == {table}
        assert alarms() == [
            f"table {table} failed {attempts} commits in a row "
            f"(coordination.quarantine_after_failures = {attempts}), the last with _GremlinError: "
            f"the table's storage refuses writes. Its {len(b0.files[table])} pending file(s) "
            "stay pending and hold the channel position; retrying every 0s until it commits. "
            "Fix the cause (`icefloe status` shows it)"
        ]
        assert gauge() == attempts
        failing = status()
        assert failing.failing_commits == attempts
        assert failing.failing_error == "_GremlinError: the table's storage refuses writes"
        assert failing.failing_since_ms is not None
        assert started_ms <= failing.failing_since_ms <= time.time() * 1000
        assert failing.stuck
        lines = render_lines(PipelineStatus(group_id, "memory", None, None, [failing]))
        assert lines[-1] == (
            f"    FAILING: {attempts} commits in a row failed, the last with _GremlinError: the "
            "table's storage refuses writes"
        )
        # nothing quarantined, nothing lost: the files wait for the table
        assert third.quarantined == {}
        assert Quarantine(make.catalog).list(group_id) == []
        assert coord.pending_files() == {table: len(b0.files[table])}
        coord.commit_now()
        assert len(alarms()) == 1  # raised once, not every attempt
        assert gauge() == attempts + 1
        broken[0] = False
        healed = coord.commit_now()
    assert healed.failed == {}
    assert gauge() == 0
    assert status().failing_commits is None
    assert not status().stuck
    assert_every_table_exact(make, source)


def test_a_table_failing_for_more_than_a_thousand_cycles_still_backs_off(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """The backoff doubles per failure up to ``table_retry_max_s``: computed as
    ``base * 2 ** (failures - 1)`` it overflowed a float after 1,024 failures in a row, so the
    cycle raised ``OverflowError`` and no table committed any more. A rolled-back table
    waiting for its replay is retried every ``table_retry_base_s`` (1 s by default): 17
    minutes of waiting were enough (found by the simulation, seed 24732 of 40 rules, a drain
    looping over such a table). Counting failures must never stop the cycle."""
    table = TABLES[0]
    gremlin, broken = _gremlin(table)
    w = make.writer("w")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=gremlin),
        **_fault_settings(quarantine_after_failures=3),
    )
    lead(coord)
    b0 = source.publish(w, 0)
    wait_pending(coord, b0.file_count)
    for n in range(1, 1100):
        result = coord.commit_now(wait_for_writers=False)  # no round trip: 1,099 cycles
        assert set(result.failed) == {table}, f"failure {n}"
    assert result.failing == {table: 1099}
    broken[0] = False
    assert coord.commit_now().failed == {}
    assert make.backend.server.stored_position(group_id) == coord.read_position
    assert_every_table_exact(make, source)


def test_failing_table_backs_off_instead_of_spinning_cycles(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """A table that keeps failing holds more files than ``max_pending_files``: no cycle may
    run back to back for it, and the other table's files are still read and committed."""
    failing, healthy = TABLES
    calls: list[str] = []

    def always_fail(table: str) -> None:
        calls.append(table)
        if table == failing:
            raise CommitError("injected: catalog unavailable")

    w = make.writer("w")
    # a backoff far beyond the test's own duration
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=always_fail),
        max_pending_files=1,
        table_retry_base_s=3600.0,
        table_retry_max_s=3600.0,
    )
    lead(coord)
    source.publish(w, 0)
    cycles: list[CycleResult] = []

    def healthy_committed() -> bool:
        return sorted(table_ids(make.catalog, healthy)) == sorted(source.expected[healthy])

    def step() -> bool:
        result = coord.step(0.05)
        if result is not None:
            cycles.append(result)
        return healthy_committed() and failing in calls

    deadline = time.monotonic() + 60
    while not step():
        assert time.monotonic() < deadline, f"no commit and failure yet; cycles {cycles}"
    for _ in range(20):  # the failing table's file exceeds the bound, yet no cycle runs
        assert coord.step(0.01) is None
    assert calls.count(failing) == 1
    assert coord.pending_files() == {failing: len(source.expected[failing]) // 5}
    later = coord.commit_now()
    assert later.deferred == (failing,)
    assert later.failed == {}
    assert calls.count(failing) == 1
    assert_exactly_once(make.catalog, healthy, source.expected[healthy])


def test_same_file_announced_by_another_writer_is_not_appended_again(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    a, b = make.writer("a"), make.writer("b")
    coord = make.coordinator()
    lead(coord)
    first = source.publish(a, 0)
    wait_pending(coord, first.file_count)
    coord.commit_now()
    # the same DataFileMeta published again under another writer id, in a later cycle
    b.publish(0, first.files, [])
    wait_pending(coord, first.file_count)
    result = coord.commit_now()
    assert result.failed == {}
    assert sum(r.data_files for r in result.tables) == 0
    assert_every_table_exact(make, source)


# --- issue 10 §4 --------------------------------------------------------------------------


class _StoreFailsChannel(MemoryCoordinatorChannel):
    """Fails every store_position, as a backend losing its connection right then would."""

    def store_position(self, position: Mapping[str, int]) -> None:
        raise ChannelError("injected: store_position failed")


def test_commit_broadcasts_and_plugin_hook_run_before_store_position(
    make: PipelineParts, source: RowSource, group_id: str, recorder: _Recorder
) -> None:
    w = make.writer("w")
    listener = make.backend.writer("listener")
    listener.open()
    channel = _StoreFailsChannel(make.backend.server, group_id, "c1", TTL)
    coord = Coordinator(
        group_id,
        channel,
        make.catalog,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=30.0),
        coordinator_id="c1",
        plugins=make.plugins,
    )
    try:
        lead(coord)
        wait_pending(coord, source.publish(w, 0).file_count)
        with pytest.raises(ChannelError, match="store_position"):
            coord.commit_now()
    finally:
        coord.close()
    assert_every_table_exact(make, source)
    assert sorted(e.table for e in recorder.events) == sorted(TABLES)
    told: list[str] = []
    deadline = time.monotonic() + 30
    while len(told) < len(TABLES):
        assert time.monotonic() < deadline, f"CommitToTable seen for {told} only"
        told += [
            e.payload.table
            for e in listener.poll_broadcasts(0.2)
            if isinstance(e.payload, CommitToTable)
        ]
    assert sorted(told) == sorted(TABLES)
    listener.close()


def test_vtts_needs_every_source_partition_covered_by_a_live_writer(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    live = make.writer("live")
    # a writer that publishes once (its own source partition) and then dies
    dead = make.backend.writer("dead")
    ref = WriterRef("dead", dead.open())
    timeout_s = 1.0
    coord = make.coordinator(commit_timeout_s=0.5, writer_timeout_s=timeout_s)
    lead(coord)
    files = publish_unanswered(source, dead, ref, group_id, 0)
    files += source.publish(live, 0).file_count
    wait_pending(coord, files)
    assert not coord.commit_now().complete  # 'dead' never answers
    time.sleep(timeout_s * 2)  # 'dead' is now past the writer timeout
    wait_pending(coord, source.publish(live, 1).file_count)
    result = coord.commit_now()
    assert result.complete  # only live writers are waited for...
    assert result.valid_through_ms is None  # ...but dead's source partition is not covered
    assert "dead" not in coord.known_writers()  # and its state was dropped
    assert_every_table_exact(make, source)


def test_a_commit_records_the_source_offsets_of_a_writer_dropped_as_dead(
    make: PipelineParts, source: RowSource
) -> None:
    """A batch found in recovery from a writer silent for longer than ``writer_timeout_s``:
    the writer's state is dropped at the cycle's start, yet the cycle commits the batch's
    files, so the snapshot must record the source offsets the batch reached (a rollback to
    before it replays from them)."""
    w = make.writer("w")
    batch = source.publish(w, 0)
    w.close()
    time.sleep(0.3)  # the batch's events are older than the writer timeout below
    coord = make.coordinator(writer_timeout_s=0.2)
    lead(coord)
    wait_pending(coord, batch.file_count)
    assert not coord.commit_now().failed
    assert "w" not in coord.known_writers()
    reached = {p.topic: {str(p.partition): p.offset} for p in batch.positions}
    for t in TABLES:
        head = make.catalog.load_table(t).current_snapshot()
        assert head is not None
        assert head.summary is not None
        recorded = head.summary[SOURCE_OFFSETS_KEY]
        assert recorded is not None
        assert json.loads(recorded) == reached


def test_recovery_and_reading_stop_at_max_pending_files(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    w = make.writer("w")
    batches = [source.publish(w, seq) for seq in range(4)]
    per_batch = batches[0].file_count
    bound = per_batch  # one batch's worth
    coord = make.coordinator(max_pending_files=bound)
    lead(coord)
    assert sum(coord.pending_files().values()) == bound, "recovery read past the bound"
    peak = 0

    def done() -> bool:
        nonlocal peak
        peak = max(peak, sum(coord.pending_files().values()))
        return all(sorted(table_ids(make.catalog, t)) == sorted(source.expected[t]) for t in TABLES)

    drive(coord, done, "every batch committed")
    assert peak <= bound
    assert_every_table_exact(make, source)


def test_stop_cutting_a_cycle_short_is_not_a_timeout_warning(
    make: PipelineParts, source: RowSource, group_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    silent = make.backend.writer("silent")
    ref = WriterRef("silent", silent.open())
    assert silent.publish(WriterBatch(ref, 0, (Event(group_id, DataComplete(()), ref, 0),)))
    coord = make.coordinator(commit_timeout_s=3600.0)
    lead(coord)
    drive(coord, lambda: "silent" in coord.known_writers(), "the silent writer")
    stop = threading.Event()
    stop.set()
    coord._cycle.stop = stop  # what run() does; the stop arrives during the wait
    with caplog.at_level("INFO", logger="icefloe.coordinator"):
        result = coord.commit_now()
    assert not result.complete
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("stopping" in r.getMessage() for r in caplog.records)


def test_rolled_back_table_waits_for_its_replay_and_the_replay_writer_is_not_waited_for(
    make: PipelineParts, source: RowSource, group_id: str
) -> None:
    """A rolled-back table's files wait (no growing backoff) while the other table commits;
    the replay batch, published by a writer that never answers StartCommit, completes the
    next cycle without a timeout and lands once with the waiting files."""
    from icefloe.commit.committer import IcebergCommitter
    from icefloe.errors import RollbackPendingError

    live = make.writer("live")
    coord = make.coordinator(commit_timeout_s=3600.0, table_retry_base_s=0.01)
    lead(coord)
    for seq in range(2):
        wait_pending(coord, source.publish(live, seq).file_count)
        assert not coord.commit_now().failed
    orders = make.catalog.load_table("db.orders")
    first = group_snapshots(make.catalog, "db.orders", group_id)[0].snapshot_id
    orders.manage_snapshots().rollback_to_snapshot(first).commit()
    rollback = IcebergCommitter(make.catalog, group_id).rollback("db.orders")
    assert rollback is not None

    wait_pending(coord, source.publish(live, 2).file_count)
    waiting = coord.commit_now()
    assert waiting.complete
    assert RollbackPendingError.__name__ in waiting.failed["db.orders"]
    assert_exactly_once(make.catalog, "db.events", source.expected["db.events"])

    replayer = make.backend.writer(rollback.writer_id)
    ref = WriterRef(rollback.writer_id, replayer.open())
    lost = {"db.orders": source.expected_ids_of("live", 1)["db.orders"]}
    files = tuple(write_rows(orders, lost["db.orders"], rollback.writer_id, 0))
    events = (
        Event(group_id, DataWritten("db.orders", files), ref, 0),
        Event(group_id, DataComplete(()), ref, 0),
    )
    assert replayer.publish(WriterBatch(ref, 0, events))
    drive(coord, lambda: rollback.writer_id in coord.known_writers(), "the replay batch")
    time.sleep(0.02)  # past the table's short retry wait (not an assertion on time)
    done = coord.commit_now()
    assert done.complete
    assert not done.failed
    assert_every_table_exact(make, source)
    assert IcebergCommitter(make.catalog, group_id).rollback("db.orders") is None


def test_idle_cycles_log_at_debug_and_a_cycle_that_commits_at_info(
    make: PipelineParts, source: RowSource, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle pipeline cycles every interval: 360-720 INFO lines an hour said nothing."""
    w = make.writer("w")
    coord = make.coordinator()
    lead(coord)
    with caplog.at_level(logging.DEBUG, logger="icefloe"):
        for _ in range(3):
            assert not coord.commit_now().tables  # idle: nothing to commit
        idle = [r for r in caplog.records if r.getMessage().startswith("commit ")]
        assert [r.levelno for r in idle] == [logging.DEBUG] * 3, [r.getMessage() for r in idle]
        caplog.clear()
        source.publish(w, 0)
        drive(coord, lambda: len(coord.pending_files()) > 0, "the batch")
        assert coord.commit_now().tables
    assert_every_table_exact(make, source)
    cycles = [r for r in caplog.records if r.name == "icefloe.coordinator.cycles"]
    assert [r.levelno for r in cycles] == [logging.INFO], [r.getMessage() for r in cycles]
    assert f"{len(TABLES)} tables committed" in cycles[0].getMessage()


def test_largest_tables_commit_first_and_a_table_that_failed_commits_last(
    make: PipelineParts, sqlite_catalog: SqlCatalog
) -> None:
    """Tables commit in order of pending bytes, largest first; a table whose last attempt
    failed goes after the healthy ones, and its failure keeps none of them from committing."""
    small, large, mid = "db.a_small", "db.c_large", "db.b_mid"  # not in name order
    source = RowSource.create(sqlite_catalog, (small, large, mid))
    order: list[str] = []
    failures: list[str] = []

    def record(table: str) -> None:
        order.append(table)
        if table == large and not failures:
            failures.append(table)
            raise CommitError("injected: catalog unavailable")

    w = make.writer("w")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=record), **_fault_settings()
    )
    lead(coord)
    sizes = {small: 1, mid: 500, large: 5000}  # rows: the files' sizes follow
    rows = iter(range(1, 10**6))
    ids = {t: [next(rows) for _ in range(n)] for t, n in sizes.items()}
    batch = source.batch(w.writer_id, 0, ids=ids, group_id=w.group_id)
    w.publish(0, batch.files, batch.positions)
    wait_pending(coord, batch.file_count)
    first = coord.commit_now()
    assert order == [large, mid, small]
    assert set(first.failed) == {large}
    assert [r.table for r in first.tables] == [mid, small]

    order.clear()
    ids2 = {t: [next(rows) for _ in range(n)] for t, n in sizes.items()}
    batch2 = source.batch(w.writer_id, 1, ids=ids2, group_id=w.group_id)
    w.publish(1, batch2.files, batch2.positions)
    wait_pending(coord, batch2.file_count)
    second = coord.commit_now()
    assert order == [mid, small, large]  # the table that failed goes last
    assert second.failed == {}
    for t in sizes:
        assert_exactly_once(make.catalog, t, ids[t] + ids2[t])


# ---------------------------------------------------------------- parallel commits

PAR_TABLES = tuple(f"par.t{i}" for i in range(8))


def test_commit_parallelism_is_validated_and_named() -> None:
    with pytest.raises(ValueError, match="commit_parallelism"):
        CoordinationConfig(commit_parallelism=0)
    with pytest.raises(ValueError, match=r"coordination\.commit_parallelism"):
        CoordinatorSettings(commit_parallelism=0)
    assert CoordinatorSettings.from_config(CoordinationConfig()).commit_parallelism == 1
    s = CoordinatorSettings.from_config(CoordinationConfig(commit_parallelism=4))
    assert s.commit_parallelism == 4


def test_parallel_cycle_commits_each_table_once_on_several_threads(
    make: PipelineParts, group_id: str
) -> None:
    parallel_cycles_commit_each_table_once(make, group_id)


def test_parallel_cycle_on_the_sql_catalog_on_postgresql(
    backend: MemoryBackend,
    postgres_catalog_properties: dict[str, str],
    group_id: str,
    plugins: Plugins,
) -> None:
    """The threads share one SqlCatalog (one SQLAlchemy engine and pool) on the real
    PostgreSQL, whose commits of different tables may run at the same time."""
    catalog = SqlCatalog("parallel", **postgres_catalog_properties)
    factory = PipelineParts(backend, catalog, group_id, plugins)
    try:
        parallel_cycles_commit_each_table_once(factory, group_id)
    finally:
        factory.close()
        catalog.engine.dispose()


def parallel_cycles_commit_each_table_once(make: PipelineParts, group_id: str) -> None:
    """Two cycles of 8 tables on 4 threads: each table's rows once, one snapshot per cycle."""
    source = RowSource.create(make.catalog, PAR_TABLES)
    threads: set[str] = set()

    def record(_: str) -> None:
        threads.add(threading.current_thread().name)
        time.sleep(0.02)  # overlap the workers even on a loaded machine

    a, b = make.writer("a"), make.writer("b")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=record), commit_parallelism=4
    )
    lead(coord)
    files = sum(source.publish(w, seq).file_count for w in (a, b) for seq in (0, 1))
    wait_pending(coord, files)
    result = coord.commit_now()
    assert result.complete
    assert not result.failed
    assert not result.deferred
    assert sorted(r.table for r in result.tables) == sorted(PAR_TABLES)
    assert len(threads) > 1, threads
    assert all(name.startswith("icefloe-commit") for name in threads), threads
    assert_rows_once(make.catalog, source)
    for t in PAR_TABLES:
        (snap,) = group_snapshots(make.catalog, t, group_id)
        assert snap.summary is not None
        assert snap.summary[VALID_THROUGH_KEY] == str(result.valid_through_ms)
    assert make.backend.server.stored_position(group_id) == coord.read_position
    # a second cycle over new files: again once per table
    wait_pending(coord, source.publish(a, 2).file_count)
    assert not coord.commit_now().failed
    assert_rows_once(make.catalog, source)
    for t in PAR_TABLES:
        assert len(group_snapshots(make.catalog, t, group_id)) == 2


def test_a_table_failing_in_one_worker_does_not_stop_the_others(
    make: PipelineParts, group_id: str
) -> None:
    source = RowSource.create(make.catalog, PAR_TABLES)
    failing = PAR_TABLES[3]
    w = make.writer("w")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=fail_once(failing)),
        commit_parallelism=4,
        table_retry_base_s=0.05,
    )
    lead(coord)
    wait_pending(coord, source.publish(w, 0).file_count)
    first = coord.commit_now()
    assert set(first.failed) == {failing}
    assert sorted(r.table for r in first.tables) == sorted(set(PAR_TABLES) - {failing})
    stored = make.backend.server.stored_position(group_id)
    assert stored is None or stored["0"] < coord.read_position["0"], "stored past a failure"
    assert group_snapshots(make.catalog, failing, group_id) == []
    assert list(coord.pending_files()) == [failing]
    time.sleep(0.1)  # its backoff
    second = coord.commit_now()
    assert not second.failed
    assert [r.table for r in second.tables] == [failing]
    assert_rows_once(make.catalog, source)
    for t in PAR_TABLES:
        assert len(group_snapshots(make.catalog, t, group_id)) == 1
    assert make.backend.server.stored_position(group_id) == coord.read_position


def test_each_table_commit_is_timed_once_and_a_failed_one_not(
    make: PipelineParts, group_id: str
) -> None:
    """``icefloe_table_commit_seconds`` gets one observation per table committed in a
    parallel cycle (the failing table none), each no longer than the cycle itself."""
    from icefloe import metrics

    def samples() -> tuple[float, float]:
        got = {s.name: s.value for m in metrics.TABLE_COMMIT_SECONDS.collect() for s in m.samples}
        return got["icefloe_table_commit_seconds_count"], got["icefloe_table_commit_seconds_sum"]

    source = RowSource.create(make.catalog, PAR_TABLES)
    w = make.writer("w")
    coord = make.coordinator(
        hooks=CoordinatorHooks(before_table_commit=fail_once(PAR_TABLES[0])),
        commit_parallelism=4,
    )
    lead(coord)
    wait_pending(coord, source.publish(w, 0).file_count)
    count, total = samples()
    started = time.monotonic()
    result = coord.commit_now()
    took = time.monotonic() - started
    assert set(result.failed) == {PAR_TABLES[0]}
    count_after, total_after = samples()
    assert count_after - count == len(PAR_TABLES) - 1
    assert 0 < total_after - total <= took * (len(PAR_TABLES) - 1)


def test_deposed_leaders_parallel_commits_are_refused_per_table(
    make: PipelineParts, group_id: str
) -> None:
    """Every worker of the zombie passed its lease check, then waits while a new leader takes
    over and commits; resumed, each one's commit is refused by its table's fencing token."""
    source = RowSource.create(make.catalog, PAR_TABLES[:4])
    w = make.writer("w")
    heirs: list[Coordinator] = []
    first = threading.Lock()
    heir_done = threading.Event()
    checked: list[str] = []

    def pause_and_let_a_successor_commit(_: str) -> None:
        checked.append(threading.current_thread().name)
        if not first.acquire(blocking=False):
            assert heir_done.wait(60)
            return
        heirs.append(make.take_over(zombie))
        heir_done.set()

    zombie = make.coordinator(
        "zombie",
        hooks=CoordinatorHooks(after_lease_check=pause_and_let_a_successor_commit),
        commit_parallelism=4,
    )
    lead(zombie)
    wait_pending(zombie, source.publish(w, 0).file_count)
    with pytest.raises(NotLeaderError):
        zombie.commit_now()
    assert not zombie.is_leader
    assert len(checked) >= 2, "the zombie's tables were not in flight together"
    (heir,) = heirs
    assert heir.lease is not None
    assert_rows_once(make.catalog, source)
    for t in source.tables:
        (snap,) = group_snapshots(make.catalog, t, group_id)
        assert snap.summary is not None
        assert snap.summary[FENCING_TOKEN_KEY] == str(heir.lease.token)


def test_coordinator_killed_mid_parallel_cycle_then_recovery_commits_each_table_once(
    tmp_path: Path,
) -> None:
    """SIGKILL while 4 threads commit 8 tables (at the 6th table's start: at least two tables
    committed, two never started); the heir finishes the cycle, each table's rows once."""
    group_id, props, catalog, source = pipeline_on_disk(tmp_path, PAR_TABLES)
    with serve_memory_server() as (server, address):
        backend = MemoryBackend(server, group_id, TTL)
        w = WriterClient(backend.writer("w"), group_id, "w")
        w.start()
        try:
            files = source.publish(w, 0).file_count
            spec = DoomedCoordinator(
                address, catalog.name, props, group_id, TTL, files, None, False, 4, 6
            )
            kill_doomed_coordinator(spec)
            done = [t for t in PAR_TABLES if group_snapshots(catalog, t, group_id)]
            assert 2 <= len(done) <= 6, done
            assert server.stored_position(group_id) is None
            heir = heir_of(backend, catalog, commit_parallelism=4)
            try:
                lead(heir)
                result = heir.commit_now()
                assert not result.failed
                assert server.stored_position(group_id) == heir.read_position
            finally:
                heir.close()
        finally:
            w.close()
    assert_rows_once(catalog, source)
    for t in PAR_TABLES:
        assert len(group_snapshots(catalog, t, group_id)) == 1, t


def test_a_cycles_broadcasts_go_out_in_chunks_with_the_lease_renewed_between() -> None:
    """A backend that sends a cycle's CommitToTable events one by one (the default
    ``broadcast_all``) checks the lease for each; at a thousand tables they can outlast a
    short lease (the conformance rule saw it on a file-based backend under load). The cycle
    sends them in calls of at most ``BROADCAST_CHUNK``, renewing the lease when due between
    calls: every event once, in order. (Pure logic: a recording channel.)"""
    calls: list[tuple[str, list[str]]] = []

    class Recording:
        def broadcast_all(self, events: Sequence[Event]) -> None:
            calls.append(("send", [e.event_id for e in events]))

    events = [Event("g", CommitToTable("c", f"db.t{i}", i, None)) for i in range(1200)]
    channel: Any = Recording()
    cycle_module.broadcast_in_chunks(channel, events, lambda: calls.append(("renew", [])))
    assert [(kind, len(ids)) for kind, ids in calls] == [
        ("send", 500),
        ("renew", 0),
        ("send", 500),
        ("renew", 0),
        ("send", 200),
    ]
    assert [i for _, ids in calls for i in ids] == [e.event_id for e in events]
    calls.clear()
    cycle_module.broadcast_in_chunks(channel, [], lambda: calls.append(("renew", [])))
    assert calls == []
