"""What keeps start-up short: light modules for Spark's planner processes, the JVM launched
early, and a commit reported when the writer hears of it (docs/benchmarks.md, start-up)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from icefloe.config import PipelineConfig, config_from_dict
from icefloe.errors import UnknownBackendError
from icefloe.testing.cli import write_config
from icefloe_spark.cli import console as cli
from icefloe_spark.cli.progress import TableProgress
from icefloe_spark.runtime import jvm
from icefloe_spark.sink.publish import PublishStats

# what only the write tasks need: pyiceberg's catalog and Parquet writer, the converter
TASK_ONLY = (
    "pyiceberg.catalog",
    "pyiceberg.io.pyarrow",
    "icefloe.records.converter",
    "icefloe.coordination.coordinator",
)


def config(name: str = "orders") -> PipelineConfig:
    return config_from_dict(
        {
            "name": name,
            "source": {"topics": ["orders"]},
            "tables": [{"name": "db.orders"}],
            "catalog": {"properties": {"uri": "sqlite:///x.db"}},
        }
    )


@pytest.mark.parametrize("module", ["icefloe_spark.sink.datasource", "icefloe_spark.kafka.source"])
def test_modules_spark_planners_import_leave_the_task_only_parts_out(module: str) -> None:
    """Spark imports these in a fresh process for each planning step of a query and for the
    sink's commit; the parts only write tasks use load when a task uses them."""
    code = f"import sys, {module}; print(sorted(m for m in {TASK_ONLY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_early_launch_hands_its_settings_to_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[dict[str, str]] = []
    monkeypatch.setattr(jvm, "_early", None)
    monkeypatch.setattr(
        jvm, "launch_detached_gateway", lambda conf, *_: launched.append(dict(conf))
    )
    jvm.launch_early(config(), logging.INFO)
    jvm.launch_early(config(), logging.INFO)  # once per process
    conf = jvm.early_conf(config(), logging.INFO)
    assert launched == [conf]  # the session is built with the settings the JVM started with
    assert jvm.early_conf(config("other"), logging.INFO) is None
    assert jvm.early_conf(config(), logging.DEBUG) is None  # its log goes elsewhere


def test_a_failed_early_launch_is_left_to_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(conf: Any, *_: Any) -> None:
        raise RuntimeError("no java")

    monkeypatch.setattr(jvm, "_early", None)
    monkeypatch.setattr(jvm, "launch_detached_gateway", fail)
    jvm.launch_early(config(), logging.INFO)
    # the settings are still handed on: building the session launches again and raises there
    assert jvm.early_conf(config(), logging.INFO) is not None


@dataclass
class FakePublisher:
    committed_through: int | None = None
    stats: PublishStats = field(default_factory=PublishStats)


class FakeQuery:
    isActive = True  # noqa: N815 (Spark's name)
    lastProgress = None  # noqa: N815 (Spark's name)


@dataclass
class FakePipeline:
    config: PipelineConfig
    publisher: FakePublisher
    query: FakeQuery = field(default_factory=FakeQuery)
    catalog: object = object()
    source_extra_options: dict[str, str] = field(default_factory=dict)
    coordinator: None = None
    reads_ranges: bool = True

    @property
    def stats(self) -> PublishStats:
        return self.publisher.stats


def test_a_commit_the_writer_hears_of_is_logged_without_waiting_for_the_table_poll(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tables are polled every TABLE_REFRESH_S (here: never); a CommitComplete for this
    writer's batches (``committed_through`` moves) makes the next tick read them at once."""
    pipeline = FakePipeline(config(), FakePublisher())
    snapshots = iter([None, 7])
    reads = 0

    class FakeMonitor:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def tables(self) -> list[TableProgress]:
            nonlocal reads
            reads += 1
            snapshot = next(snapshots, 7)
            return [TableProgress("db.orders", snapshot, None, 40 if snapshot else None, 0)]

        def close(self) -> None:
            pass

    monkeypatch.setattr("icefloe_spark.cli.progress.Monitor", FakeMonitor)
    monkeypatch.setattr(cli, "TABLE_REFRESH_S", float("inf"))

    def until() -> bool:
        if reads == 1:  # after the start's read: the writer hears its batches were committed
            pipeline.publisher.committed_through = 0
        return reads >= 2

    stop = threading.Event()
    guard = threading.Timer(120, stop.set)  # only ends a broken run; nothing is timed
    guard.start()
    try:
        with caplog.at_level(logging.INFO, logger="icefloe.progress"):
            cli.watch(pipeline, stop, live=False, until=until)  # type: ignore[arg-type]
    finally:
        guard.cancel()
    assert reads == 2, "the tables were not read again after the writer heard of a commit"
    assert any(getattr(r, "event", None) == "table_commit" for r in caplog.records)


def test_the_ranges_path_runs_the_jvms_with_the_quick_compiler_only() -> None:
    """docs/benchmarks.md: C2's compiles cost the driver JVM ~9 CPU s before the first commit
    and never pay back when the records stay in Python; the records path keeps C2."""
    driver, executor = "spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"
    ranges = jvm.session_conf(config())
    assert jvm.QUICK_JIT in ranges[driver].split()
    assert ranges[executor] == jvm.QUICK_JIT
    records = config().model_copy(
        update={"spark": config().spark.model_copy(update={"data_path": "records"})}
    )
    assert jvm.QUICK_JIT not in jvm.session_conf(records)[driver]
    assert executor not in jvm.session_conf(records)
    mine = {driver: "-XX:-TieredCompilation", executor: "-XX:TieredStopAtLevel=4"}
    assert jvm.quick_jit(mine) == {}  # the user's choice of compilers holds


EARLY_LAUNCH_PROBE = """
import sys
from icefloe.config import config_from_dict
from icefloe_spark.runtime import jvm

seen = []
jvm.launch_detached_gateway = lambda conf, *_: seen.append(
    "concurrent.futures.thread" in sys.modules
)
before = "concurrent.futures.thread" in sys.modules
config = config_from_dict({
    "name": "p", "source": {"topics": ["t"]}, "tables": [{"name": "db.t"}],
    "catalog": {"properties": {"uri": "sqlite:///x.db"}},
})
jvm.launch_early(config)
jvm.early_conf(config)  # returns once the launch thread has run
print(before, seen)
"""


def test_fork_handlers_the_runner_registers_exist_before_the_early_launch_forks() -> None:
    """The runner's imports meet the launch thread's fork: a fork handler pair registered in
    between ran its release without its acquire (CI: "release unlocked lock" at start-up)."""
    out = subprocess.run(
        [sys.executable, "-c", EARLY_LAUNCH_PROBE], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "[True]"], out.stdout + out.stderr


def test_run_refuses_an_unknown_backend_before_launching_the_jvm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 item 7: `coordination.backend = "nats"` failed only once the JVM was up."""
    from icefloe_spark.cli import commands

    def launched(*_: object) -> None:
        raise AssertionError("the JVM was launched before the backend was checked")

    monkeypatch.setattr(jvm, "launch_early", launched)
    path = write_config(
        tmp_path / "p.toml",
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "tables": [{"name": "db.t"}],
            "coordination": {"backend": "nats"},
        },
    )
    with pytest.raises(UnknownBackendError, match="coordination backend 'nats' is not installed"):
        commands.run(config=path)
