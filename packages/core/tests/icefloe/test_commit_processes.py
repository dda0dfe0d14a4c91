"""Committer processes (``coordination.commit_processes``): a cycle's tables committed by
worker processes with their own catalog, on a real SQLite catalog with real Parquet files and
the reference channel. A committer process killed by SIGKILL before or after its Iceberg
commit leaves its tables committed once or pending, never twice; a deposed leader's processes
are refused by each table's fencing token. Rows are counted with pyarrow over the tables'
files, not through the committer."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from icefloe.commit.quarantine import Quarantine
from icefloe.config import CoordinationConfig, config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.processes import pool_for
from icefloe.coordination.settings import CatalogSpec
from icefloe.coordination.writer import WriterClient
from icefloe.testing.fixtures import group_snapshots, write_rows
from icefloe.testing.harness import (
    CommittersPipeline,
    DoomedCoordinator,
    KillCommitter,
    assert_rows_once,
    heir_finds_every_commit,
    heir_of,
    kill_doomed_coordinator,
    lead,
    pipeline_on_disk,
    start_committers_then_die,
    wait_pending,
)
from icefloe.testing.memory import MemoryBackend, MemoryServer, serve_memory_server

TABLES = tuple(f"procs.t{i}" for i in range(6))
TTL = 1.0


class _Pipeline(CommittersPipeline):
    """The scenario's pipeline, with coordinators on committer processes."""

    def processes(
        self, name: str = "c1", hook: KillCommitter | None = None, **settings: Any
    ) -> Coordinator:
        """A coordinator committing on two committer processes."""
        return self.coordinator(
            name,
            CoordinatorHooks(in_committer=hook),
            commit_processes=2,
            catalog=self.spec,
            table_retry_base_s=0.01,
            **settings,
        )


@pytest.fixture
def pipe(tmp_path: Path, memory_server: MemoryServer) -> Iterator[_Pipeline]:
    p = _Pipeline(tmp_path, memory_server, TABLES, TTL)
    try:
        yield p
    finally:
        p.close()


def test_commit_processes_is_validated_and_needs_the_catalog() -> None:
    with pytest.raises(ValueError, match="commit_processes"):
        CoordinationConfig(commit_processes=-1)
    with pytest.raises(ValueError, match=r"coordination\.commit_processes"):
        CoordinatorSettings(commit_processes=-1)
    assert CoordinatorSettings.from_config(CoordinationConfig()).commit_processes == 0
    with pytest.raises(ValueError, match="catalog"):
        pool_for(2, None, "g", "main", None, None)
    assert pool_for(0, None, "g", "main", None, None) is None
    cfg = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "catalog": {"name": "cat", "properties": {"uri": "sqlite:///x"}},
            "tables": [{"name": "db.t"}],
            "coordination": {"backend": "memory", "commit_processes": 3},
        }
    )
    s = CoordinatorSettings.for_pipeline(cfg)
    assert s.commit_processes == 3
    assert s.catalog == CatalogSpec("cat", {"uri": "sqlite:///x"})
    assert "sqlite:///x" not in repr(s), "catalog properties (credentials) in a repr"
    # in-process commits need no catalog configuration: the default path is unchanged
    plain = dict(cfg.model_dump(), coordination={"backend": "memory"})
    assert CoordinatorSettings.for_pipeline(config_from_dict(plain)).catalog is None


def test_processes_commit_each_table_once_per_cycle(pipe: _Pipeline) -> None:
    pipe.two_cycles_commit_each_table_once(pipe.processes)


@pytest.mark.parametrize("moment", ["before_commit", "after_commit"])
def test_committer_process_killed_leaves_its_tables_committed_once_or_pending(
    pipe: _Pipeline, tmp_path: Path, moment: str
) -> None:
    """SIGKILL of the process committing ``victim``, right before its catalog commit or
    right after it landed (before the answer): its tables of the cycle fail this cycle only,
    the position stays below them, and the next cycle (on a replaced process) commits what
    is missing, every row once."""
    victim = TABLES[2]
    w = pipe.writer("w")
    kill = KillCommitter(moment, victim, str(tmp_path / "killed"))
    coord = pipe.processes(hook=kill, quarantine_after_failures=1)
    first = pipe.cycle_losing_a_committer(
        coord, w, kill, "committer process", "CommitterProcessError: committer process died"
    )
    assert victim in first.failing, "a death counts as a failure of the table"
    assert not first.deferred
    # the victim's own commit landed only if its process died after it
    assert pipe.snapshots(victim) == (1 if moment == "after_commit" else 0)
    # after the backoff, a new process commits them (or finds them landed)
    second = pipe.next_cycle_commits_what_is_missing(coord, first, kill)
    assert not second.failing
    # the replaced process keeps committing
    wait_pending(coord, pipe.source.publish(w, 1).file_count)
    assert not coord.commit_now().failed
    pipe.assert_rows_once()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_committer_processes_end_when_the_coordinators_process_is_killed(
    pipe: _Pipeline, tmp_path: Path
) -> None:
    """A coordinator killed by SIGKILL leaves no committer process behind (each would wait
    for tasks forever, holding its catalog connections)."""
    pids_file = tmp_path / "pids"
    child = multiprocessing.get_context("spawn").Process(
        target=start_committers_then_die, args=(pipe.spec, str(pids_file))
    )
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 60  # a liveness bound, not a speed assertion
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)], "committer processes outlived the coordinator"


def test_deposed_leaders_committer_processes_are_refused_per_table(pipe: _Pipeline) -> None:
    """The leader proves its lease, then pauses before handing the cycle to its processes; a
    new leader takes over and commits. Resumed, each of the old leader's processes is refused
    by its table's fencing token, and the old leader steps down."""

    def on_processes(name: str, hooks: CoordinatorHooks) -> Coordinator:
        return pipe.coordinator(name, hooks, commit_processes=2, catalog=pipe.spec)

    pipe.deposed_leader_is_refused(on_processes)


def test_coordinator_killed_after_its_processes_committed_then_heir_commits_nothing_twice(
    tmp_path: Path,
) -> None:
    """SIGKILL of a coordinator process whose committer processes committed every table,
    before the position store; an heir (on committer processes too) finds each commit by its
    commit id and makes none again."""
    group_id, props, catalog, source = pipeline_on_disk(tmp_path, TABLES)
    with serve_memory_server() as (server, address):
        backend = MemoryBackend(server, group_id, TTL)
        w = WriterClient(backend.writer("w"), group_id, "w")
        w.start()
        try:
            files = sum(source.publish(w, seq).file_count for seq in range(2))
            doomed = DoomedCoordinator(
                address, catalog.name, props, group_id, TTL, files, commit_processes=2
            )
            kill_doomed_coordinator(doomed)
            for t in TABLES:
                assert len(group_snapshots(catalog, t, group_id)) == 1, t
            assert server.stored_position(group_id) is None
            heir = heir_of(
                backend, catalog, commit_processes=2, catalog=CatalogSpec(catalog.name, props)
            )
            try:
                heir_finds_every_commit(heir, server, group_id)
            finally:
                heir.close()
        finally:
            w.close()
    for t in TABLES:
        assert len(group_snapshots(catalog, t, group_id)) == 1, t
    assert_rows_once(catalog, source)


def test_a_refused_file_is_quarantined_by_the_coordinator_before_its_process_commits(
    pipe: _Pipeline,
) -> None:
    """A file the table refuses (outside its location): the process screens, commits
    nothing and answers with the screening; the coordinator quarantines the file, then the
    same process commits the rest. The position passes the refused file's event."""
    table, other = TABLES[0], TABLES[1]
    w = pipe.writer("w")
    coord = pipe.processes()
    lead(coord)
    good = pipe.source.batch("w", 0)
    stray = write_rows(pipe.catalog.load_table(other), [999_001, 999_002], "w", 0)
    files = {t: list(fs) for t, fs in good.files.items()}
    files[table] = files[table] + stray
    w.publish(0, files, good.positions)
    for t, ids in good.ids.items():
        pipe.source.expected.setdefault(t, []).extend(ids)
    wait_pending(coord, good.file_count + len(stray))
    result = coord.commit_now()
    assert result.failed == {}
    assert result.quarantined == {table: len(stray)}
    entries = Quarantine(pipe.catalog).list(pipe.group_id)
    assert [(e.table_name, e.file_path, e.error_type) for e in entries] == [
        (table, f.path, "FileOutsideTableError") for f in stray
    ]
    assert sorted(r.table for r in result.tables) == sorted(TABLES)
    assert coord.pending_files() == {}
    assert pipe.stored() == coord.read_position
    pipe.assert_rows_once()
