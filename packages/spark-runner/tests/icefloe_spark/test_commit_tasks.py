"""Commit tasks on the Spark executors (``spark.commit_tasks``): a coordinator whose cycles
commit their tables as Spark jobs, on a real local Spark session, a real SQLite catalog, real
Parquet files and the reference channel. A Python worker killed by SIGKILL right after its
table's commit landed leaves every table committed once; a deposed leader's commit job is
refused per table by the fencing token. Rows are counted with pyarrow over the tables'
files, not through the committer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from pyspark import TaskContext
from pyspark.sql import SparkSession

from icefloe.commit.merge import merged_name
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.processes import CommitTask, WorkerSpec
from icefloe.coordination.settings import CatalogSpec
from icefloe.errors import ConfigError
from icefloe.events import DataFileMeta
from icefloe.testing.fixtures import create_rows_table, sqlite_catalog_properties, write_rows
from icefloe.testing.harness import CommittersPipeline, KillCommitter
from icefloe.testing.memory import MemoryServer
from icefloe_spark import committers
from icefloe_spark.committers import SparkCommitters, commit_slices, spread, task_attempt
from icefloe_spark.runtime import jvm

TABLES = tuple(f"sparkc.t{i}" for i in range(5))
TTL = 1.0


class _Pipeline(CommittersPipeline):
    """The scenario's pipeline, with coordinators committing on Spark tasks."""

    def __init__(self, tmp_path: Path, spark: SparkSession) -> None:
        super().__init__(tmp_path, MemoryServer(), TABLES, TTL)
        self.spark = spark
        self.committers: list[SparkCommitters] = []

    def _spark_committers(self, spec: WorkerSpec) -> SparkCommitters:
        c = SparkCommitters(lambda: self.spark, 2, spec)
        self.committers.append(c)
        return c

    def on_spark(self, name: str, hooks: CoordinatorHooks | None = None) -> Coordinator:
        """A coordinator committing on two Spark tasks per round."""
        return self.coordinator(
            name, hooks, self._spark_committers, catalog=self.spec, table_retry_base_s=0.01
        )


@pytest.fixture
def pipe(tmp_path: Path, spark: SparkSession) -> Iterator[_Pipeline]:
    p = _Pipeline(tmp_path, spark)
    try:
        yield p
    finally:
        p.close()


def test_commit_tasks_is_validated_against_commit_processes() -> None:
    base = {
        "name": "p",
        "source": {"topics": ["t"]},
        "tables": [{"name": "db.t"}],
        "spark": {"commit_tasks": 2},
    }
    spec = CoordinatorSettings.for_pipeline(config_from_dict(base))
    assert spec.catalog is not None, "the Python workers need the catalog's configuration"
    both = dict(base, coordination={"backend": "memory", "commit_processes": 2})
    with pytest.raises(ConfigError, match=r"spark\.commit_tasks.*coordination\.commit_processes"):
        config_from_dict(both)
    with pytest.raises(ConfigError, match="commit_tasks"):
        config_from_dict(dict(base, spark={"commit_tasks": -1}))


def test_commit_tasks_get_a_fair_scheduler_unless_the_user_chose_one() -> None:
    data = {
        "name": "p",
        "source": {"topics": ["t"]},
        "tables": [{"name": "db.t"}],
        "spark": {"commit_tasks": 2},
    }
    assert jvm.session_conf(config_from_dict(data))["spark.scheduler.mode"] == "FAIR"
    data["spark"] = {"commit_tasks": 2, "conf": {"spark.scheduler.mode": "FIFO"}}
    assert jvm.session_conf(config_from_dict(data))["spark.scheduler.mode"] == "FIFO"
    del data["spark"]
    assert "spark.scheduler.mode" not in jvm.session_conf(config_from_dict(data))


def _task(table: str, files: int, size: int) -> CommitTask:
    metas = [DataFileMeta(f"s3://w/{table}/{i}.parquet", 1, size) for i in range(files)]
    pending = tuple(PendingFile(m, "w", 0, "0", i) for i, m in enumerate(metas))
    request = TableCommitRequest(
        table=table,
        commit_id="c",
        files=pending,
        positions={},
        source_offsets={},
        fencing_token=1,
        valid_through_ms=None,
        channel_id="ch",
        live_writers=frozenset(),
    )
    return CommitTask(request, screen=True)


def test_tables_are_spread_over_the_tasks_largest_first() -> None:
    """Each slice starts with its largest table; slices get about equal numbers of commits
    (a commit's cost is mostly per table), never more slices than tables."""
    tasks = [_task(f"db.t{i}", 2, size) for i, size in enumerate([10, 500, 30, 20, 400, 5])]
    slices = spread(tasks, 2)
    assert [[tasks[i].request.table for i, _ in s] for s in slices] == [
        ["db.t1", "db.t2", "db.t0"],
        ["db.t4", "db.t3", "db.t5"],
    ]
    assert sorted(i for s in slices for i, _ in s) == list(range(6))
    assert len(spread(tasks[:1], 4)) == 1


class _Attempt:
    """Spark's TaskContext as a commit task sees it (only what the task asks)."""

    def __init__(self, task_attempt_id: int) -> None:
        self._id = task_attempt_id

    def taskAttemptId(self) -> int:  # noqa: N802  (Spark's name)
        return self._id


def test_a_commit_task_merges_under_names_of_its_own_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two attempts of one commit task may run at once (speculation, a zombie beside its
    retry): the task passes its attempt to the committer, so its merged files are named for
    it and never overwrite those another attempt committed. Pure logic: no Spark, Spark's
    TaskContext stood in for; a real SQLite catalog and real files."""
    properties = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = CatalogSpec("c", properties)
    table = create_rows_table(catalog.load(), "db.m")
    files = tuple(
        PendingFile(m, "w", seq, "0", seq)
        for seq in range(2)
        for m in write_rows(table, [seq], "w", seq, group_id="pipe")
    )
    request = TableCommitRequest("db.m", "commit-1", files, {"0": 2}, {}, fencing_token=1)
    policies = TablePolicies(TablePolicy(merge_small_files=True))
    spec = WorkerSpec(catalog, "pipe", "main", policies)
    monkeypatch.setattr(committers, "_committers", OrderedDict())
    context = _Attempt(7)
    monkeypatch.setattr(TaskContext, "get", staticmethod(lambda: context))

    answers = dict(commit_slices("k", spec, [[(0, CommitTask(request, screen=True))]]))
    result = answers[0].result
    assert result is not None, answers[0].error
    assert (result.data_files, result.added_files) == (2, 1)
    (committed,) = [t.file.file_path for t in catalog.load().load_table("db.m").scan().plan_files()]
    group = [f.meta for f in files]
    assert str(merged_name("commit-1", group, "spark-task-7")) in committed
    other = cast(TaskContext, _Attempt(8))
    assert task_attempt(other) != task_attempt(cast(TaskContext, context))  # other names
    assert task_attempt(None) == ""  # not in a Spark task: the names of the only run


def test_spark_tasks_commit_each_table_once_per_cycle(pipe: _Pipeline) -> None:
    pipe.two_cycles_commit_each_table_once(lambda: pipe.on_spark("c1"))
    (committers,) = pipe.committers
    tracker = pipe.spark.sparkContext.statusTracker()
    # a warm-up job at leadership, then one per cycle (every table screened and accepted in
    # the first round)
    assert len(tracker.getJobIdsForGroup(committers.job_group)) == 3


def test_python_worker_killed_after_its_commit_leaves_every_table_committed_once(
    pipe: _Pipeline, tmp_path: Path
) -> None:
    """SIGKILL of the Python worker committing ``victim`` right after its commit landed: the
    job fails (local mode does not retry a task), so the round's tables fail this cycle and
    stay pending, the position below them; the next cycle commits what is missing and finds
    the victim's landed commit, every row once."""
    master = pipe.spark.sparkContext.master or ""
    if "," in master:  # e.g. local[2,2] of tests/conftest.py when run in one process with it
        pytest.skip(f"needs a session that retries no task; this one is {master}")
    victim = TABLES[2]
    w = pipe.writer("w")
    kill = KillCommitter("after_commit", victim, str(tmp_path / "killed"))
    coord = pipe.on_spark("c1", CoordinatorHooks(in_committer=kill))
    first = pipe.cycle_losing_a_committer(
        coord, w, kill, "Python worker", "CommitterProcessError: Spark commit job failed"
    )
    pipe.next_cycle_commits_what_is_missing(coord, first, kill)


@pytest.mark.spark  # starts a JVM of its own in a child process (no fixture)
def test_a_task_retried_by_spark_after_its_worker_died_commits_nothing_twice(
    tmp_path: Path,
) -> None:
    """With task retries (``local[2,2]``), a Python worker killed right after its table's
    commit landed fails only that task attempt: Spark runs the task again, the retry finds
    the landed commit by its commit id, and the cycle ends with no table failed, every table
    committed once (``commit_tasks_retry_proc.py``, in a child: one JVM per process)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("commit_tasks_retry_proc.py")),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines, proc.stdout[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["killed"], "the Python worker was not killed"
    assert out["failed"] == {}
    assert out["committed"][out["victim"]] is None, "the landed commit was made again"
    assert set(out["snapshots"].values()) == {1}
    assert out["stored"]


def test_deposed_leaders_commit_job_is_refused_per_table(pipe: _Pipeline) -> None:
    """The leader proves its lease, then pauses before handing the cycle to Spark; a new
    leader takes over and commits. Resumed, the old leader's Spark tasks are refused by each
    table's fencing token, and the old leader steps down."""
    pipe.deposed_leader_is_refused(pipe.on_spark)
