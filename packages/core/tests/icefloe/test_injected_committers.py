"""Committers a runner injects (``Coordinator(committers=...)``, the
:class:`~icefloe.coordination.processes.Committers` protocol), on a real SQLite catalog
with real Parquet files and the reference channel: the cycle flushes each round of
submits (every table, then the tables screened again), so a runner with a cost per
hand-out (a Spark job) runs a round at once; and a cycle that ends in an error leaves
nothing queued for a later round to hand out."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks
from icefloe.coordination.processes import (
    CommitAnswer,
    CommitTask,
    CommitWorker,
    WorkerSpec,
    pool_for,
)
from icefloe.coordination.settings import CatalogSpec
from icefloe.errors import NotLeaderError, StaleFencingTokenError
from icefloe.testing.fixtures import write_rows
from icefloe.testing.harness import CommittersPipeline, lead, wait_pending
from icefloe.testing.memory import MemoryServer
from icefloe.testing.readers import independent_rows

TABLES = tuple(f"inj.t{i}" for i in range(4))


class RoundCommitters:
    """Committers that run each flushed round in one background thread, one committer for
    all (as one Spark job would), recording every round's tables."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = CommitWorker(spec)
        self.rounds: list[list[str]] = []
        self.queued: list[tuple[CommitTask, Future[CommitAnswer]]] = []
        self.jobs = ThreadPoolExecutor(1)

    def start(self) -> None:
        pass

    def submit(self, task: CommitTask) -> Future[CommitAnswer]:
        future: Future[CommitAnswer] = Future()
        self.queued.append((task, future))
        return future

    def flush(self) -> None:
        batch = [(t, f) for t, f in self.queued if f.set_running_or_notify_cancel()]
        self.queued = []
        if batch:
            self.rounds.append(sorted(t.request.table for t, _ in batch))
            self.jobs.submit(self._run, batch)

    def _run(self, batch: list[tuple[CommitTask, Future[CommitAnswer]]]) -> None:
        for task, future in batch:
            future.set_result(self.worker.run(task))

    def worker_of(self, table: str) -> int:
        return 0

    def replace(self, i: int) -> None:
        pass

    def close(self) -> None:
        self.jobs.shutdown()


class _Pipeline(CommittersPipeline):
    """The scenario's pipeline: one writer ``w`` and coordinators on :class:`RoundCommitters`."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, MemoryServer(), TABLES)
        self.built: list[RoundCommitters] = []
        self.w = self.writer("w")

    def _committers(self, spec: WorkerSpec) -> RoundCommitters:
        self.built.append(RoundCommitters(spec))
        return self.built[-1]

    def on_rounds(self, hooks: CoordinatorHooks | None = None) -> Coordinator:
        return self.coordinator("c", hooks, self._committers, catalog=self.spec)


@pytest.fixture
def pipe(tmp_path: Path) -> Iterator[_Pipeline]:
    p = _Pipeline(tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_injected_committers_are_checked_against_processes_and_the_catalog() -> None:
    spec = CatalogSpec("c", {})
    with pytest.raises(ValueError, match=r"commit_processes = 0"):
        pool_for(2, spec, "g", "main", None, None, RoundCommitters)
    with pytest.raises(ValueError, match="catalog"):
        pool_for(0, None, "g", "main", None, None, RoundCommitters)


def test_each_round_of_a_cycle_is_flushed_as_one(pipe: _Pipeline) -> None:
    """A file ``table`` refuses: its committer commits nothing and answers with the
    screening; the coordinator quarantines the file and sends the rest as a second round.
    Every row lands once."""
    table, other = TABLES[0], TABLES[1]
    coord = pipe.on_rounds()
    lead(coord)
    good = pipe.source.batch("w", 0)
    stray = write_rows(pipe.catalog.load_table(other), [999_001], "w", 0)
    files = {t: list(fs) for t, fs in good.files.items()}
    files[table] = files[table] + stray
    pipe.w.publish(0, files, good.positions)
    wait_pending(coord, good.file_count + len(stray))
    result = coord.commit_now()
    assert result.failed == {}
    assert result.quarantined == {table: 1}
    (committers,) = pipe.built
    assert committers.rounds == [sorted(TABLES), [table]]
    for t in TABLES:
        got = sorted(r[0] for r in independent_rows(pipe.catalog.load_table(t), ["id"]))
        assert got == sorted(good.ids[t]), t


def test_a_cycle_ended_by_an_error_leaves_nothing_queued(pipe: _Pipeline) -> None:
    """The leadership ends while the first round is being submitted (a table's hook finds a
    newer coordinator): the tables submitted so far are cancelled, never handed out, so no
    later flush runs this cycle's tasks."""

    seen: list[str] = []

    def deposed_at_the_third_table(table: str) -> None:
        seen.append(table)
        if len(seen) == 3:
            raise StaleFencingTokenError("a newer coordinator has taken over (test)")

    coord = pipe.on_rounds(CoordinatorHooks(before_table_commit=deposed_at_the_third_table))
    lead(coord)
    wait_pending(coord, pipe.source.publish(pipe.w, 0).file_count)
    with pytest.raises(NotLeaderError):
        coord.commit_now()
    assert len(seen) == 3, "two tables were submitted before the error"
    (committers,) = pipe.built
    assert committers.queued == []
    assert committers.rounds == []
