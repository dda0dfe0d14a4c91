"""Helpers for coordinator scenarios: drive a coordinator until something holds, publish
batches of real Parquet files with unique row ids, simulate a crash.

Shared by core's coordinator tests and the conformance suite (every backend runs the same
scenarios), and importable by a child process that a test kills.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import Backend
from icefloe.commit.policy import TablePolicies
from icefloe.commit.summary import FENCING_TOKEN_KEY
from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.coordination.processes import CommitterPool, CommittersFactory, WorkerSpec
from icefloe.coordination.settings import CatalogSpec
from icefloe.coordination.writer import WriterClient
from icefloe.errors import NotLeaderError
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.plugins.manager import Plugins, new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    group_snapshots,
    make_sqlite_catalog,
    sqlite_catalog_properties,
    write_rows,
)
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    MemoryServerAddress,
    connect_memory_server,
)
from icefloe.testing.readers import independent_rows


class SimulatedCrash(BaseException):
    """Raised from a fault hook to stop a coordinator dead at that point. A BaseException,
    so no ``except Exception`` in the code under test can swallow it."""


def crash(*_: object) -> None:
    """A fault hook that crashes the coordinator where it runs."""
    raise SimulatedCrash


def once(action: Callable[[], object]) -> Callable[[], None]:
    """A ``before_commit`` callback that runs ``action`` on the first attempt only (its
    ``calls`` attribute counts the attempts)."""
    calls: list[int] = []

    def callback() -> None:
        calls.append(1)
        if len(calls) == 1:
            action()

    callback.calls = calls  # type: ignore[attr-defined]
    return callback


def drive(
    coordinator: Coordinator, until: Callable[[], bool], what: str, timeout: float = 30.0
) -> None:
    """Step the coordinator until ``until()`` holds; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        coordinator.step(0.1)


def lead(coordinator: Coordinator, timeout: float = 30.0) -> None:
    """Step until the coordinator leads (and has recovered)."""
    drive(coordinator, lambda: coordinator.is_leader, "leadership", timeout)


def wait_pending(coordinator: Coordinator, files: int, timeout: float = 30.0) -> None:
    """Step until ``files`` files are pending in total."""
    drive(
        coordinator,
        lambda: sum(coordinator.pending_files().values()) >= files,
        f"{files} pending files (have {coordinator.pending_files()})",
        timeout,
    )


@dataclass
class Batch:
    """One writer batch: files per table, positions, and the ids it carries per table."""

    seq: int
    files: dict[str, list[DataFileMeta]]
    positions: list[SourcePosition]
    ids: dict[str, list[int]]

    @property
    def file_count(self) -> int:
        return sum(len(fs) for fs in self.files.values())


@dataclass
class RowSource:
    """Writes real Parquet files with globally unique ids into real tables and remembers
    which ids each table should end up with exactly once."""

    catalog: Catalog
    tables: Sequence[str]
    rows_per_table: int = 5
    expected: dict[str, list[int]] = field(default_factory=dict)
    published: dict[tuple[str, int], dict[str, list[int]]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _offsets: dict[str, int] = field(default_factory=dict)
    _partitions: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, catalog: Catalog, tables: Sequence[str], rows_per_table: int = 5) -> RowSource:
        for t in tables:
            create_rows_table(catalog, t)
        return cls(catalog, list(tables), rows_per_table)

    def batch(
        self,
        writer_id: str,
        seq: int,
        ids: dict[str, list[int]] | None = None,
        group_id: str | None = None,
    ) -> Batch:
        """New files for every table (``ids`` re-writes given rows: a replay with new files),
        named for pipeline ``group_id`` if given. Source positions: partition per writer,
        offsets advance, a record time per batch."""
        files: dict[str, list[DataFileMeta]] = {}
        used: dict[str, list[int]] = {}
        for t in self.tables:
            rows = (
                list(ids[t])
                if ids is not None
                else [next(self._ids) for _ in range(self.rows_per_table)]
            )
            files[t] = write_rows(self.catalog.load_table(t), rows, writer_id, seq, group_id)
            used[t] = rows
        offset = self._offsets.get(writer_id, 0) + self.rows_per_table
        self._offsets[writer_id] = offset
        part = self._partitions.setdefault(writer_id, len(self._partitions))
        positions = [SourcePosition("source", part, offset, 1_700_000_000_000 + seq)]
        return Batch(seq, files, positions, used)

    def publish(self, writer: WriterClient, seq: int) -> Batch:
        """Write and publish a new batch; its rows become expected if the channel took it."""
        b = self.batch(writer.writer_id, seq, group_id=writer.group_id)
        writer.publish(seq, b.files, b.positions)
        self.published[(writer.writer_id, seq)] = b.ids
        for t, rows in b.ids.items():
            self.expected.setdefault(t, []).extend(rows)
        return b

    def expected_ids_of(self, writer_id: str, seq: int) -> dict[str, list[int]]:
        """The rows of an earlier batch (to replay it)."""
        return self.published[(writer_id, seq)]


@dataclass(frozen=True)
class DoomedCoordinator:
    """What a child process needs to run a coordinator that kills itself (picklable)."""

    address: MemoryServerAddress
    catalog_name: str  # a SqlCatalog's tables belong to its name
    catalog_properties: dict[str, str]
    group_id: str
    lease_ttl_s: float
    pending_files: int
    policies: TablePolicies | None = None
    die_in_compaction: bool = False
    """Die in the compaction round after the cycle (its files written, not committed),
    instead of right after the Iceberg commits."""
    commit_parallelism: int = 1
    die_at_table: int | None = None
    """Die when the cycle starts its ``die_at_table``-th table (counted across the commit
    threads): mid-cycle, some tables committed, some in flight, some not started."""
    commit_processes: int = 0
    """Committer processes (``coordination.commit_processes``) that commit the cycle."""


@dataclass(frozen=True)
class KillCommitter:
    """An ``in_committer`` hook (picklable, for ``commit_processes``): SIGKILL the committer
    process at ``moment`` (``before_commit``, ``after_commit``) of ``table``'s commit, once:
    ``marker``, a file created as it strikes, spares the process that replaces it."""

    moment: str
    table: str
    marker: str

    def __call__(self, moment: str, table: str) -> None:
        if (moment, table) != (self.moment, self.table):
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


_BY_HAND = CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=30.0)


@dataclass(eq=False)
class PipelineParts:
    """The writers and coordinators of one pipeline (its channel, catalog and group id),
    closed by :meth:`close` in the reverse order of opening. Coordinators commit by hand
    (``commit_now``) with the given ``plugins`` (default: none, fresh per coordinator)."""

    backend: MemoryBackend
    catalog: Catalog
    group_id: str
    plugins: Plugins | None = None
    _open: list[Coordinator | WriterClient] = field(default_factory=list, init=False)

    def coordinator(
        self,
        name: str = "c1",
        hooks: CoordinatorHooks | None = None,
        committers: CommittersFactory | None = None,
        **settings: Any,
    ) -> Coordinator:
        """A coordinator that commits by hand; ``settings`` (as :class:`CoordinatorSettings`
        takes them) replace the defaults, the commit interval and timeout included."""
        c = Coordinator(
            self.group_id,
            self.backend.coordinator(name),
            self.catalog,
            dataclasses.replace(_BY_HAND, **settings),
            coordinator_id=name,
            plugins=self.plugins if self.plugins is not None else new_plugins(autoload=False),
            hooks=hooks,
            committers=committers,
        )
        self._open.append(c)
        return c

    def writer(self, writer_id: str) -> WriterClient:
        w = WriterClient(self.backend.writer(writer_id), self.group_id, writer_id)
        w.start()
        self._open.append(w)
        return w

    def take_over(self, zombie: Coordinator) -> Coordinator:
        """A new leader ``heir`` takes over from the paused ``zombie`` (once its lease
        expired) and commits what the zombie holds."""
        heir = self.coordinator("heir")
        lead(heir)
        wait_pending(heir, sum(zombie.pending_files().values()))
        assert not heir.commit_now().failed
        return heir

    def close(self) -> None:
        for x in reversed(self._open):
            x.close()


class CommittersPipeline(PipelineParts):
    """One pipeline for committer scenarios (processes, a runner's committers): a real
    SQLite catalog (also as properties, for committers that open their own), the reference
    channel, a row source over ``tables``, its writers and coordinators, closed by
    :meth:`close`."""

    def __init__(
        self, path: Path, server: MemoryServer, tables: Sequence[str], ttl: float = 1.0
    ) -> None:
        group_id = f"pipe-{uuid.uuid4().hex[:8]}"
        catalog: SqlCatalog = make_sqlite_catalog(path / "iceberg")
        super().__init__(MemoryBackend(server, group_id, ttl), catalog, group_id)
        self.catalog: SqlCatalog = catalog
        self.tables = tuple(tables)
        self.spec = CatalogSpec(catalog.name, sqlite_catalog_properties(path / "iceberg"))
        self.source = RowSource.create(catalog, self.tables)

    def stored(self) -> dict[str, int] | None:
        return self.backend.server.stored_position(self.group_id)

    def assert_rows_once(self) -> None:
        """Each table's live files, read with pyarrow, hold every published row once."""
        assert_rows_once(self.catalog, self.source)

    def snapshots(self, table: str) -> int:
        """The pipeline's snapshots of ``table``."""
        return len(group_snapshots(self.catalog, table, self.group_id))

    def two_cycles_commit_each_table_once(
        self, coordinator_of: Callable[[], Coordinator]
    ) -> Coordinator:
        """Two writers publish, ``coordinator_of()`` commits in one cycle, then one writer
        publishes again and a second cycle commits: every table gets one snapshot per cycle,
        every row lands once and the stored position follows the read one. Returns the
        coordinator."""
        a, b = self.writer("a"), self.writer("b")
        coord = coordinator_of()
        lead(coord)
        wait_pending(coord, sum(self.source.publish(w, 0).file_count for w in (a, b)))
        first = coord.commit_now()
        assert first.complete
        assert not first.failed
        assert not first.deferred
        assert sorted(r.table for r in first.tables) == sorted(self.tables)
        assert self.stored() == coord.read_position
        wait_pending(coord, self.source.publish(a, 1).file_count)
        assert not coord.commit_now().failed
        self.assert_rows_once()
        for t in self.tables:
            assert self.snapshots(t) == 2, t
        assert self.stored() == coord.read_position
        return coord

    def cycle_losing_a_committer(
        self, coord: Coordinator, writer: WriterClient, kill: KillCommitter, who: str, error: str
    ) -> CycleResult:
        """``coord`` (its ``in_committer`` hook ``kill``) leads and commits a new batch of
        ``writer`` in a cycle whose committer of ``kill.table`` is killed (``who`` names the
        committer): that table fails with ``error`` in its message, every table either commits
        or fails, the failed ones stay pending and the stored position stays below them.
        Returns the cycle's result."""
        lead(coord)
        wait_pending(coord, self.source.publish(writer, 0).file_count)
        first = coord.commit_now()
        assert Path(kill.marker).exists(), f"the {who} was not killed"
        assert kill.table in first.failed
        assert error in first.failed[kill.table]
        assert {r.table for r in first.tables} | set(first.failed) == set(self.tables)
        assert set(coord.pending_files()) == set(first.failed)
        stored = self.stored()
        assert stored is None or stored["0"] < coord.read_position["0"], "stored past a failure"
        return first

    def next_cycle_commits_what_is_missing(
        self, coord: Coordinator, first: CycleResult, kill: KillCommitter
    ) -> CycleResult:
        """After the backoff (``table_retry_base_s`` of at most 0.05 s), ``coord``'s next cycle
        commits the tables ``first`` failed; a commit that landed before ``kill`` struck
        (``after_commit``) is found, not made again. The position follows, every row lands
        once, one snapshot per table. Returns the cycle's result."""
        time.sleep(0.05)  # table_retry_base_s
        second = coord.commit_now()
        assert not second.failed
        assert not second.deferred
        assert sorted(r.table for r in second.tables) == sorted(first.failed)
        if kill.moment == "after_commit":
            committed = {r.table: r.snapshot_id for r in second.tables}
            assert committed[kill.table] is None, "the landed commit was made again"
        assert self.stored() == coord.read_position
        self.assert_rows_once()
        for t in self.tables:
            assert self.snapshots(t) == 1, t
        return second

    def deposed_leader_is_refused(
        self, zombie_of: Callable[[str, CoordinatorHooks], Coordinator]
    ) -> None:
        """The coordinator ``zombie_of(name, hooks)`` builds proves its lease, then pauses
        before handing its cycle to its committers; a new leader (committing in its own
        process) takes over and commits. Resumed, the zombie's committers must be refused
        per table by the fencing token and the zombie step down; every row lands once, under
        the heir's token."""
        w = self.writer("w")
        heirs: list[Coordinator] = []

        def pause_and_let_a_successor_commit(_: str) -> None:
            if not heirs:
                heirs.append(self.take_over(zombie))

        zombie = zombie_of(
            "zombie", CoordinatorHooks(after_lease_check=pause_and_let_a_successor_commit)
        )
        lead(zombie)
        wait_pending(zombie, self.source.publish(w, 0).file_count)
        # the lease renewal while the committers work, or a refused table, says so
        with _logged("icefloe.coordinator") as messages:
            try:
                zombie.commit_now()
            except NotLeaderError:
                pass
            else:
                raise AssertionError("the deposed leader's cycle ended without NotLeaderError")
        assert not zombie.is_leader
        assert any("a newer coordinator" in m for m in messages), "no committer was refused"
        (heir,) = heirs
        assert heir.lease is not None
        self.assert_rows_once()
        for t in self.tables:
            (snap,) = group_snapshots(self.catalog, t, self.group_id)
            assert snap.summary is not None
            assert snap.summary[FENCING_TOKEN_KEY] == str(heir.lease.token)

    def close(self) -> None:
        for x in reversed(self._open):
            x.close()


@contextmanager
def _logged(logger: str) -> Iterator[list[str]]:
    """The messages ``logger`` logs at WARNING or above meanwhile."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    target = logging.getLogger(logger)
    level = target.level
    target.addHandler(handler)
    if target.getEffectiveLevel() > logging.WARNING:
        target.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        target.removeHandler(handler)
        target.setLevel(level)


def start_committers_then_die(catalog: CatalogSpec, pids_file: str) -> None:
    """Child process body: start two committer processes (``commit_processes``), write their
    ids to ``pids_file``, die by SIGKILL."""
    pool = CommitterPool(2, WorkerSpec(catalog, "committers", "main", None, None))
    Path(pids_file).write_text(" ".join(str(p) for p in pool.pids()))
    os.kill(os.getpid(), signal.SIGKILL)


def _sigkill_self(_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _doomed_hooks(spec: DoomedCoordinator) -> CoordinatorHooks:
    if spec.die_at_table is not None:
        started = itertools.count(1)
        count = threading.Lock()

        def die_at(_: str) -> None:
            with count:
                n = next(started)
            if n == spec.die_at_table:
                _sigkill_self(None)

        return CoordinatorHooks(before_table_commit=die_at)
    if spec.die_in_compaction:
        return CoordinatorHooks(during_compaction=_sigkill_self)
    return CoordinatorHooks(after_iceberg_commits=_sigkill_self)


def run_doomed_coordinator(spec: DoomedCoordinator) -> None:
    """Child process body: lead, read ``pending_files`` files, commit them to Iceberg and die
    by SIGKILL right after the Iceberg commits, before the channel position is stored (or,
    with ``die_in_compaction``, in the compaction round after the cycle; with
    ``die_at_table``, in the middle of the cycle)."""
    backend = MemoryBackend(connect_memory_server(spec.address), spec.group_id, spec.lease_ttl_s)
    coordinator = Coordinator(
        spec.group_id,
        backend.coordinator("doomed"),
        SqlCatalog(spec.catalog_name, **spec.catalog_properties),
        CoordinatorSettings(
            commit_interval_s=3600.0,
            commit_timeout_s=30.0,
            policies=spec.policies,
            commit_parallelism=spec.commit_parallelism,
            commit_processes=spec.commit_processes,
            catalog=CatalogSpec(spec.catalog_name, spec.catalog_properties),
        ),
        coordinator_id="doomed",
        plugins=new_plugins(autoload=False),
        hooks=_doomed_hooks(spec),
    )
    lead(coordinator)
    wait_pending(coordinator, spec.pending_files)
    coordinator.commit_now()
    raise SystemExit("the doomed coordinator survived its commit")


def kill_doomed_coordinator(spec: DoomedCoordinator, timeout: float = 120.0) -> None:
    """Run :func:`run_doomed_coordinator` in a child process and check it died by SIGKILL."""
    child = multiprocessing.get_context("spawn").Process(
        target=run_doomed_coordinator, args=(spec,)
    )
    child.start()
    child.join(timeout)
    assert child.exitcode == -signal.SIGKILL, f"child exit code {child.exitcode}"


def pipeline_on_disk(
    path: Path, tables: Sequence[str]
) -> tuple[str, dict[str, str], SqlCatalog, RowSource]:
    """A group id, and a SQLite catalog (its properties, for a child process) with ``tables``
    and a row source over them."""
    props = sqlite_catalog_properties(path / "iceberg")
    catalog = make_sqlite_catalog(path / "iceberg")
    return f"pipe-{uuid.uuid4().hex[:8]}", props, catalog, RowSource.create(catalog, tables)


def heir_of(backend: MemoryBackend, catalog: Catalog, /, **settings: Any) -> Coordinator:
    """The coordinator ``heir`` that takes over from a killed one (closed by the caller);
    ``settings`` as :class:`CoordinatorSettings` takes them."""
    return Coordinator(
        backend.group_id,
        backend.coordinator("heir"),
        catalog,
        dataclasses.replace(_BY_HAND, **settings),
        plugins=new_plugins(autoload=False),
    )


def assert_rows_once(catalog: Catalog, source: RowSource) -> None:
    """Every table of ``source``: its live files (read by pyarrow, not pyiceberg's scan) hold
    each row the source published to it exactly once."""
    for t in source.tables:
        got = sorted(r[0] for r in independent_rows(catalog.load_table(t), ["id"]))
        assert got == sorted(source.expected[t]), t


def heir_finds_every_commit(heir: Coordinator, server: MemoryServer, group_id: str) -> None:
    """Lead with ``heir`` after a coordinator died past its Iceberg commits and commit: every
    table's commit is found landed (none is made again), and the position is stored."""
    lead(heir)
    result = heir.commit_now()
    assert not result.failed
    assert all(r.snapshot_id is None for r in result.tables)
    assert server.stored_position(group_id) == heir.read_position


_IDENTITY_SETTINGS = CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=5.0)


def _writer_and_coordinator(
    backend: Backend, catalog: Catalog, group_id: str, name: str
) -> tuple[WriterClient, Coordinator]:
    writer = WriterClient(backend.writer("w"), group_id, "w")
    writer.start()
    coordinator = Coordinator(
        group_id,
        backend.coordinator(name),
        catalog,
        _IDENTITY_SETTINGS,
        plugins=new_plugins(autoload=False),
    )
    return writer, coordinator


def commit_batches(
    backend: Backend,
    catalog: Catalog,
    group_id: str,
    source: RowSource,
    seqs: Sequence[int],
    pending: Sequence[int] = (),
) -> str:
    """Publish ``seqs`` from writer ``w`` and commit them with a coordinator of ``backend``,
    then publish ``pending`` and leave them uncommitted; returns the channel id the commit
    recorded. For channel reset and swap tests, and a running pipeline's state for status."""
    writer, coordinator = _writer_and_coordinator(backend, catalog, group_id, "first")
    try:
        lead(coordinator)
        for seq in seqs:
            source.publish(writer, seq)
        wait_pending(coordinator, len(seqs) * len(source.tables))
        cycle = coordinator.commit_now()
        assert not cycle.failed, cycle.failed
        for seq in pending:
            source.publish(writer, seq)
        return coordinator.channel.channel_id()
    finally:
        writer.close()
        coordinator.close()


def refused_restart(
    backend: Backend, catalog: Catalog, group_id: str, source: RowSource, seq: int
) -> BaseException:
    """Publish batch ``seq`` and run a new coordinator of ``backend`` until it raises; returns
    the exception (a test asserts its type and that the table is unchanged)."""
    writer, coordinator = _writer_and_coordinator(backend, catalog, group_id, "second")
    try:
        # a new batch that must not be taken for committed (its rows are not expected: the
        # test asserts the table is unchanged)
        batch = source.batch("w", seq)
        writer.publish(seq, batch.files, batch.positions)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                coordinator.step(0.2)
                if coordinator.is_leader and coordinator.pending_files():
                    coordinator.commit_now()
                    raise AssertionError("the coordinator committed instead of refusing")
            except AssertionError:
                raise
            except Exception as exc:
                return exc
        raise AssertionError("the coordinator neither refused nor failed within 30 s")
    finally:
        writer.close()
        coordinator.close()


@dataclass
class Pipe:
    """One pipeline for a scenario: its channel, catalog, source rows, an open writer ``w``
    and the settings its coordinators get (per-table policies included)."""

    backend: Backend
    catalog: Catalog
    group_id: str
    source: RowSource
    writer: WriterClient
    settings: CoordinatorSettings

    @classmethod
    def open(
        cls,
        backend: Backend,
        catalog: Catalog,
        group_id: str,
        source: RowSource,
        settings: CoordinatorSettings,
    ) -> Pipe:
        writer = WriterClient(backend.writer("w"), group_id, "w")
        writer.start()
        return cls(backend, catalog, group_id, source, writer, settings)

    def coordinator(self, name: str, hooks: CoordinatorHooks | None = None) -> Coordinator:
        return Coordinator(
            self.group_id,
            self.backend.coordinator(name),
            self.catalog,
            self.settings,
            coordinator_id=name,
            plugins=new_plugins(autoload=False),
            hooks=hooks,
        )

    def commit_each(self, seqs: Sequence[int]) -> list[CycleResult]:
        """Lead, then publish and commit each batch of ``seqs`` in a cycle of its own."""
        coordinator = self.coordinator("c1")
        results: list[CycleResult] = []
        try:
            lead(coordinator)
            for seq in seqs:
                wait_pending(coordinator, self.source.publish(self.writer, seq).file_count)
                results.append(coordinator.commit_now())
                assert not results[-1].failed, results[-1].failed
        finally:
            coordinator.close()
        return results


@dataclass
class FanOut:
    """What :func:`fan_out_cycle` saw: the cycle's result and how many writers answered."""

    result: CycleResult
    answered: int
    during: object = None  # what the ``during`` callback returned


def fan_out_cycle(
    backend: Backend,
    catalog: Catalog,
    group_id: str,
    writers: int,
    during: Callable[[], object] | None = None,
    timeout_s: float = 600.0,
) -> FanOut:
    """``writers`` WriterClients of one process (one backend object, as a Spark driver or a
    writer process has) each publish one batch of a real Parquet file, then one commit cycle
    runs; the table must hold every row exactly once (pyiceberg scan). ``during()`` runs while
    every writer is open and idle (e.g. to count server connections). No timing is asserted:
    the cycle must be complete (every writer answered), however long it takes."""
    table = "fan.rows"
    source = RowSource.create(catalog, [table], rows_per_table=2)
    clients = [
        WriterClient(backend.writer(f"w{i:04d}"), group_id, f"w{i:04d}") for i in range(writers)
    ]
    coordinator = Coordinator(
        group_id,
        backend.coordinator("fan-out"),
        catalog,
        CoordinatorSettings(
            commit_interval_s=3600.0, commit_timeout_s=timeout_s, writer_timeout_s=3600.0
        ),
        plugins=new_plugins(autoload=False),
    )
    try:
        for client in clients:
            client.start()
        seen = during() if during is not None else None
        lead(coordinator, timeout=timeout_s)
        for client in clients:
            source.publish(client, 0)
        wait_pending(coordinator, writers, timeout=timeout_s)
        result = coordinator.commit_now()
        assert_exactly_once(catalog, table, source.expected[table])
        return FanOut(result, sum(1 for c in clients if c.answered), seen)
    finally:
        for client in clients:
            client.close()
        coordinator.close()
